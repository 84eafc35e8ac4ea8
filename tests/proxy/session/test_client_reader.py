"""``ClientReader`` (proxy/session/client_reader.py): a session's client frames, one path.

Frames reach the relay in the order the client sent them, pushed by the parser
or read from the queue; a client cut off for flooding is read no more; while
the engine link is above its mark the client's socket is not read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from proxy.session.client_reader import ClientReader
from proxy.session.frames import ControlPayload
from tests.conftest import wait_until
from tests.proxy.session.fakes import FakeClient, FakeProtocol, FakeUpstream

T = aiohttp.WSMsgType


class Frames:
    """The relay's side: what reached it, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, object]] = []
        self.ended = 0

    def client_text(self, text: str) -> None:
        self.got.append(("text", text))

    def client_binary(self, size: int) -> None:
        self.got.append(("binary", size))

    def client_ping(self, payload: ControlPayload) -> None:
        self.got.append(("ping", bytes(payload)))

    def client_control(self) -> None:
        self.got.append(("pong", None))

    def client_error(self, error: object) -> None:
        self.got.append(("error", error))

    def client_ended(self) -> None:
        self.ended += 1


class Push:
    """aiohttp's hand-over of parsed text frames: who it hands them to now."""

    def __init__(self) -> None:
        self.handler: Callable[[str], None] | None = None
        self.calls = 0

    def __call__(self, handler: Callable[[str], None] | None) -> bool:
        self.calls += 1
        self.handler = handler
        return True


def _reader(push: Push | None = None) -> tuple[ClientReader, FakeClient, FakeProtocol]:
    client, protocol = FakeClient(), FakeProtocol()
    return ClientReader(client, protocol, FakeUpstream(), push), client, protocol  # type: ignore[arg-type]


async def test_every_kind_of_frame_reaches_the_relay_in_order_until_a_close() -> None:
    reader, client, _ = _reader()
    frames = Frames()
    client.send(T.TEXT, '{"type":"a"}')
    client.send(T.PING, b"p")
    client.send(T.PONG, b"")
    client.send(T.BINARY, b"12345")
    client.send(T.TEXT, '{"type":"b"}')
    client.send(T.CLOSE, 1000)
    await asyncio.wait_for(reader.run(frames), timeout=10)
    assert frames.got == [
        ("text", '{"type":"a"}'),
        ("ping", b"p"),
        ("pong", None),
        ("binary", 5),
        ("text", '{"type":"b"}'),
    ]
    assert reader.closed_cleanly and reader.finished and frames.ended == 1
    assert reader.frames_read == 2


async def test_a_dropped_connection_is_not_a_clean_close() -> None:
    reader, client, _ = _reader()
    frames = Frames()
    client.lose()
    await asyncio.wait_for(reader.run(frames), timeout=10)
    assert not reader.closed_cleanly and frames.ended == 1


async def test_a_reader_error_is_told_to_the_relay() -> None:
    reader, client, _ = _reader()
    frames = Frames()
    client.send(T.ERROR, ValueError("bad frame"))
    await asyncio.wait_for(reader.run(frames), timeout=10)
    assert [kind for kind, _ in frames.got] == ["error"] and frames.ended == 1


async def test_the_message_the_edge_read_first_is_handled_first() -> None:
    reader, client, _ = _reader()
    frames = Frames()
    reader.first = aiohttp.WSMessage(T.TEXT, "first", None)
    client.send(T.TEXT, "second")
    client.send(T.CLOSE, 1000)
    await asyncio.wait_for(reader.run(frames), timeout=10)
    assert frames.got == [("text", "first"), ("text", "second")]


async def test_a_client_cut_off_is_read_no_more_and_its_socket_paused() -> None:
    reader, client, protocol = _reader()

    class CutAtFirst(Frames):
        def client_text(self, text: str) -> None:
            super().client_text(text)
            reader.cut()

    frames = CutAtFirst()
    client.send(T.TEXT, "flood 1")
    client.send(T.TEXT, "flood 2")
    task = asyncio.create_task(reader.run(frames))
    await wait_until(lambda: reader.cut_off, what="the cut")
    await asyncio.sleep(0)
    assert frames.got == [("text", "flood 1")]
    assert protocol.transport is not None and protocol.transport.reading_paused
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert frames.ended == 1


async def test_reads_pause_while_the_engine_link_is_above_its_mark() -> None:
    protocol, upstream = FakeProtocol(), FakeUpstream()
    reader = ClientReader(FakeClient(), protocol, upstream, None)  # type: ignore[arg-type]
    transport = protocol.transport
    assert transport is not None
    reader.pause_for_upstream()
    assert transport.reading_paused
    assert upstream.on_drained is not None, "the reader asked the link to say when it drains"
    upstream.on_drained()
    assert not transport.reading_paused


async def test_text_frames_are_pushed_once_the_queue_is_empty_and_not_when_over_rate() -> None:
    push = Push()
    reader, client, _ = _reader(push)
    frames = Frames()
    task = asyncio.create_task(reader.run(frames))
    await wait_until(lambda: reader.pushing, what="the hand-over")
    assert push.handler is not None
    push.handler("pushed")
    reader.over_rate()
    assert not reader.pushing and push.handler is None, "back to the queue"
    client.send(T.TEXT, "queued")
    client.send(T.CLOSE, 1000)
    await asyncio.wait_for(task, timeout=10)
    assert frames.got == [("text", "pushed"), ("text", "queued")]
    assert push.handler is None, "the hand-over is off when the reader ends"
