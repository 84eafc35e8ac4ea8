"""SIGTERM drain of a real ``omni-sidecar serve`` process (docs/design.md, Admission and lifecycle;
Code rules (7)).

The sequence under test: SIGTERM → ``STOPPING=1`` and /readyz 503 → no new
sessions (503 before the upgrade) → live sessions may finish until
``drain_timeout`` → the rest get ``session.closed`` {reason shutdown} and
close 1001 → the engine child is stopped → exit status 0, no child left.

The process is the installed console script with the simulator as its engine,
pacing audio in real time so a response is really in flight at SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.children import SidecarChild, child_pids
from tests.conftest import DEADLINE, MS, wait_until

pytestmark = pytest.mark.timeout(60)

DRAIN_TIMEOUT = 3000 * MS  # seconds, scaled like every other delay
START = [
    '{"type":"session.update","session":{"modalities":["audio","text"]}}',
    '{"type":"input_audio_buffer.append","audio":"AAAAAAAAAAAAAAAA"}',
    '{"type":"input_audio_buffer.commit"}',
    '{"type":"response.create"}',
]


class Served(SidecarChild):
    """``omni-sidecar serve`` as a child process, with its log and sd_notify socket."""

    def __init__(self, tmp_path: Path) -> None:
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp_path / "notify"))
        self.notify.setblocking(False)
        super().__init__(
            "--drain-timeout", str(DRAIN_TIMEOUT), "--heartbeat-interval", "0",
            "--log-level", "info",
            base_env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")},
            env={
                "NOTIFY_SOCKET": str(tmp_path / "notify"),
                "OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS": (
                    "--chunk-ms 200 --realtime-factor 1 --response-seconds 1.6"
                ),
                "OMNI_SIDECAR_ENGINE_HEALTH_INTERVAL": "0.2",
            },
            log_path=tmp_path / "sidecar.log",
            ready_timeout=3 * DEADLINE,
            stop_grace=DEADLINE,
        )  # fmt: skip

    @property
    def http(self) -> str:
        return self.http_url

    @property
    def ws(self) -> str:
        return self.ws_url

    def datagrams(self) -> list[str]:
        received = []
        with contextlib.suppress(BlockingIOError):
            while True:
                received.append(self.notify.recv(65536).decode())
        return received


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    process = Served(tmp_path)
    try:
        yield process.start()
    finally:
        process.stop()
        process.notify.close()


async def readyz(http: aiohttp.ClientSession, base: str) -> tuple[int, dict[str, Any]]:
    try:
        async with http.get(f"{base}/readyz", timeout=aiohttp.ClientTimeout(total=1)) as resp:
            return resp.status, await resp.json()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 0, {}


async def start_response(http: aiohttp.ClientSession, url: str) -> tuple[Any, list[str]]:
    ws = await http.ws_connect(url, max_msg_size=0)
    for text in START:
        await ws.send_str(text)
    types: list[str] = []
    while not types or types[-1] != "response.output_audio.delta":
        msg = await ws.receive(timeout=DEADLINE)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        types.append(orjson.loads(msg.data)["type"])
    return ws, types


async def read_to_close(ws: Any, *, leave: bool) -> tuple[list[dict[str, Any]], float]:
    """Every event until the close frame; ``leave``: close the session after the response."""
    events: list[dict[str, Any]] = []
    while True:
        msg = await ws.receive(timeout=3 * DEADLINE)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            return events, time.monotonic()
        event = orjson.loads(msg.data)
        events.append(event)
        if event["type"] == "response.done" and leave:
            await ws.send_str('{"type":"session.close"}')


async def test_sigterm_drains_then_closes_with_1001(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        await served.ready()
        engine_pids = child_pids(served.proc.pid)
        assert len(engine_pids) == 1, engine_pids
        engine_pid = engine_pids[0]

        # Two sessions, each with a response in flight: `stays` keeps its session
        # open after the response, `leaves` closes its own once it is done.
        stays, _ = await start_response(http, served.ws)
        leaves, _ = await start_response(http, served.ws)
        readers = [
            asyncio.ensure_future(read_to_close(stays, leave=False)),
            asyncio.ensure_future(read_to_close(leaves, leave=True)),
        ]

        served.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()

        # Draining: not ready, and a new session is refused before the upgrade.
        await wait_until(
            lambda: _status(http, served, 503), timeout=DEADLINE, what="/readyz 503 while draining"
        )
        status, body = await readyz(http, served.http)
        assert (status, body["reason"]) == (503, "draining")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(served.ws)
        assert refused.value.status == 503
        assert not all(r.done() for r in readers)  # the refusals came during the drain

        async with asyncio.timeout(DRAIN_TIMEOUT + DEADLINE):
            (stay_events, stay_closed_at), (leave_events, leave_closed_at) = await asyncio.gather(
                *readers
            )

    # Both responses ran to completion inside the drain window.
    for events in (stay_events, leave_events):
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "completed", events
    # The session that finished on its own closed normally, well before the deadline.
    assert leave_events[-1]["type"] == "session.closed"
    assert leave_events[-1]["reason"] != "shutdown"
    assert leaves.close_code == 1000
    assert leave_closed_at - sigterm_at < DRAIN_TIMEOUT
    # The one that stayed open was closed at the drain deadline: shutdown + 1001.
    types = [e["type"] for e in stay_events]
    assert types.index("response.done") < types.index("session.closed")
    assert stay_events[-1] == {**stay_events[-1], "type": "session.closed", "reason": "shutdown"}
    assert stays.close_code == 1001
    assert DRAIN_TIMEOUT * 0.9 <= stay_closed_at - sigterm_at < DRAIN_TIMEOUT + DEADLINE

    # Exit 0, and the engine child (and its process group) are gone.
    loop = asyncio.get_running_loop()
    code = await loop.run_in_executor(None, lambda: served.proc.wait(timeout=DEADLINE))
    log = served.log()
    assert code == 0, log
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(engine_pid, 0)
    assert child_pids(served.proc.pid) == []
    assert "shutting down: draining 2 sessions" in log
    assert "engine stopped (status 0)" in log  # the simulator obeyed SIGTERM
    assert log.rstrip().endswith("stopped")
    # systemd was told: READY=1 after the engine came up, STOPPING=1 at SIGTERM.
    datagrams = served.datagrams()
    ready = next(i for i, d in enumerate(datagrams) if d.startswith("READY=1"))
    stopping = next(i for i, d in enumerate(datagrams) if d.startswith("STOPPING=1"))
    assert ready < stopping


async def _status(http: aiohttp.ClientSession, served: Served, status: int) -> bool:
    return (await readyz(http, served.http))[0] == status
