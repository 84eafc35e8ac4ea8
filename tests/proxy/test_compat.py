"""The aiohttp compatibility layer fails loudly: a missing internal stops ``serve``
with status 2 and one line, instead of silently turning a feature off."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import base_protocol, client_ws, web_runner, web_ws

from proxy import compat
from proxy.compat import check
from tests.aiohttp_private import websocket_helpers

TEXT_PUSH_HOOK = (
    "web_ws.WebSocketDataQueue built by _post_start, its feed_data called by the parser"
)
RESUME_HOOK = "ResponseHandler.resume_writing, wrapped per instance"

# (object, attribute) pairs whose removal must be noticed, and the hook named.
REMOVALS = [
    (base_protocol.BaseProtocol, "_drain_helper", "BaseProtocol._drain_helper"),
    (base_protocol.BaseProtocol, "writing_paused", "BaseProtocol.writing_paused"),
    (web_ws.WebSocketResponse, "send_frame", "WebSocketResponse._writer (send_frame/close)"),
    (aiohttp, "ClientWSTimeout", "ClientWSTimeout"),
    # Both engine links mask their frames with it.
    (websocket_helpers, "websocket_mask", "_websocket.helpers.websocket_mask"),
    # The aiohttp engine link resumes reading the client when the engine drains.
    (base_protocol.BaseProtocol, "resume_writing", RESUME_HOOK),
    # Client text frames skip aiohttp's queue through it (the push path).
    (web_ws, "WebSocketDataQueue", TEXT_PUSH_HOOK),
]


def test_the_installed_aiohttp_has_every_hook() -> None:
    assert compat.missing_hooks() == []
    compat.require_hooks()


@pytest.fixture
def removed(request: pytest.FixtureRequest) -> Iterator[str]:
    owner, attribute, hook = request.param
    saved = owner.__dict__[attribute] if attribute in vars(owner) else getattr(owner, attribute)
    delattr(owner, attribute)
    try:
        yield hook
    finally:
        setattr(owner, attribute, saved)


@pytest.mark.parametrize("removed", REMOVALS, indirect=True, ids=[r[2] for r in REMOVALS])
def test_a_missing_internal_is_named(removed: str) -> None:
    assert removed in compat.missing_hooks()
    with pytest.raises(compat.AiohttpHookMissing) as info:
        compat.require_hooks()
    assert aiohttp.__version__ in str(info.value) and removed in str(info.value)


def test_a_text_push_that_the_parser_does_not_reach_is_a_missing_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked by parsing a frame: an override of ``feed_data`` that aiohttp's parser
    skips (as a C build calling its own method directly would) stops ``serve``."""
    assert compat.install_text_push()
    queue = web_ws.WebSocketDataQueue  # type: ignore[attr-defined]
    monkeypatch.setattr(queue, "feed_data", queue.__mro__[1].feed_data)
    assert TEXT_PUSH_HOOK in compat.missing_hooks()


def test_hooks_that_read_attributes_set_in_constructors_see_them() -> None:
    # Attributes assigned in __init__ are checked through the constructor's code.
    assert check._assigns(client_ws.ClientWebSocketResponse.__init__, "_writer", "_reader")
    assert check._assigns(web_runner.BaseSite.__init__, "_server")
    assert not check._assigns(web_runner.BaseSite.__init__, "_no_such_attribute")


def test_serve_exits_2_with_one_line_when_a_hook_is_missing() -> None:
    code = (
        "import aiohttp.base_protocol as b\n"
        "del b.BaseProtocol._drain_helper\n"
        "from proxy.cli import main\n"
        "raise SystemExit(main(['serve', '--listen', '127.0.0.1:0',"
        " '--admin-listen', '127.0.0.1:0']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"aiohttp {aiohttp.__version__}" in lines[0] and "_drain_helper" in lines[0]


def test_only_an_accepted_upgrade_counts_as_upgraded() -> None:
    """A declined upgrade (aiohttp parses heads again) must keep the edge's guard."""

    class Protocol:
        def __init__(self, parser: object) -> None:
            self._payload_parser = parser

    assert compat.upgraded(Protocol(object())), "a WebSocket reader parses the connection"
    assert not compat.upgraded(Protocol(None)), "upgrade requested or declined, not accepted"


class _Protocol:
    """What aiohttp's reader queue calls on its protocol (flow control)."""

    def __init__(self) -> None:
        self._reading_paused = False

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        self._reading_paused = False


class _Client:
    """A prepared WebSocketResponse as push_text sees it: its reader queue."""

    def __init__(self, queue: object) -> None:
        self._reader = queue


async def test_text_messages_skip_the_queue_once_it_is_empty() -> None:
    import asyncio

    assert compat.install_text_push()
    assert compat.install_text_push(), "idempotent"
    queue_class = web_ws.WebSocketDataQueue  # what WebSocketResponse.prepare builds now
    queue = queue_class(_Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    client = _Client(queue)
    text = aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, '{"type":"x.first"}', None)
    queue.feed_data(text, 18)
    got: list[str] = []
    assert not compat.push_text(client, got.append), "refused while a message is queued"
    assert (await queue.read()).data == '{"type":"x.first"}'
    assert compat.push_text(client, got.append)
    queue.feed_data(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, '{"type":"x.second"}', None), 19)
    ping = aiohttp.WSMessage(aiohttp.WSMsgType.PING, b"p", None)
    queue.feed_data(ping, 1)
    assert got == ['{"type":"x.second"}'], "text handed over at once"
    assert (await queue.read()).type is aiohttp.WSMsgType.PING, "control frames still queued"
    assert compat.push_text(client, None)
    queue.feed_data(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, '{"type":"x.third"}', None), 18)
    assert got == ['{"type":"x.second"}'], "off: queued again"
    assert (await queue.read()).data == '{"type":"x.third"}'


def test_push_text_on_a_plain_queue_is_refused_but_off_is_fine() -> None:
    plain = _Client(object())
    assert not compat.push_text(plain, print)  # type: ignore[arg-type]
    assert compat.push_text(plain, None)  # type: ignore[arg-type]
