"""Fault injection with real processes (issue "hardening", docs/design.md, Admission and lifecycle;
Engine launcher).

Engines die (SIGKILL), stall (``--stall-after`` with failing health, or a real
SIGSTOP hang), clients vanish without a close frame or while their buffer is
full, 100 clients arrive in the same second, and a real ``omni-sidecar serve``
gets SIGTERM in the middle of all that. For each fault:

* every affected session ends with the documented events and close code, and
  the time from the fault to the close is measured and printed;
* every other session receives every event in order: the simulator stamps
  ``server_event_seq`` 1, 2, 3... and the client checks there is no gap;
* nothing leaks: tasks (in-process sidecar), open fds, child processes and RSS
  come back to where they were (``tests/integration/leakcheck.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.settings import EngineConfig
from tests.aiohttp_private import abort
from tests.children import SidecarChild
from tests.conftest import DEADLINE, MS, wait_until
from tests.fakes.scripted_engine import ScriptedEngine
from tests.fakes.stall_engine import StallEngine
from tests.integration.helpers import (
    AUDIO_DELTA,
    SILENCE_100MS,
    Client,
    RawWebSocket,
    connect,
)
from tests.integration.leakcheck import MIB, Slack, Snapshot, child_pids, wait_settled


@pytest.fixture
def sidecar(sidecar: Any) -> Any:
    """The shared fixture with acks on the clients' behalf off: these sessions
    check that every engine event arrives (gapless ``server_event_seq``), and
    the engine's answers to the sidecar's own acks are hidden from clients."""

    async def start(**overrides: Any) -> Any:
        overrides.setdefault("playback_ack", "off")
        return await sidecar(**overrides)

    return start


pytestmark = pytest.mark.timeout(90)

Event = dict[str, Any]
#: 200 ms chunks of 8 kHz PCM16 (4.3 KB frames) paced in real time: light enough
#: for dozens of sessions on two cores, and a response is always in flight.
PACED = tuple(
    shlex.split("--chunk-ms 200 --realtime-factor 1 --response-seconds 30 --sample-rate 8000")
)
#: Responses as fast as possible: 1 s of audio in one frame.
FAST = tuple(
    shlex.split("--chunk-ms 1000 --realtime-factor 0 --response-seconds 1 --sample-rate 8000")
)
LEAK_SLACK = Slack(tasks=2, fds=4, rss_bytes=48 * MIB)


# -- sessions that check what they receive -------------------------------------------------------


@dataclass
class Watched:
    """One client session; checks ``server_event_seq`` and remembers how it ended."""

    client: Client
    closed_at: float | None = None
    #: Arrival time of the last engine event (one with server_event_seq).
    last_engine_event_at: float | None = None
    gaps: list[str] = field(default_factory=list)

    @property
    def events(self) -> list[Event]:
        return self.client.events

    def check_order(self) -> None:
        """Engine events carry seq 1, 2, 3...; only the proxy's own tail has none."""
        last = 0
        tail = False
        for event in self.events:
            seq = event.get("server_event_seq")
            if event["type"] == "session.created":
                continue
            if seq is None:
                tail = True  # the proxy's error / session.closed: nothing of the engine after
                continue
            if tail or seq != last + 1:
                self.gaps.append(f"{event['type']} seq {seq} after {last} (tail={tail})")
            last = seq
        assert self.gaps == [], self.gaps[:5]

    async def start_response(self) -> None:
        for event in (
            {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
            {"type": "input_audio_buffer.append", "audio": SILENCE_100MS},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            await self.client.send(event)

    async def until_audio(self) -> None:
        await self.client.recv_until(AUDIO_DELTA)

    async def read_to_close(self, timeout: float = DEADLINE) -> list[Event]:
        """Read to the server's Close frame, noting when engine events stopped."""
        start = self.client.mark()
        ws = self.client.ws
        async with asyncio.timeout(timeout):
            while True:
                msg = await ws.receive()
                if msg.type is aiohttp.WSMsgType.TEXT:
                    event = orjson.loads(msg.data)
                    self.client.events.append(event)
                    if "server_event_seq" in event:
                        self.last_engine_event_at = time.monotonic()
                    continue
                if msg.type is aiohttp.WSMsgType.CLOSE:
                    self.client.close_frame_code = int(msg.data)
                break
        self.closed_at = time.monotonic()
        return self.client.events[start:]

    def tail_types(self, n: int) -> list[str]:
        return [str(e.get("type")) for e in self.events[-n:]]


@contextlib.asynccontextmanager
async def sessions(url: str, n: int) -> AsyncIterator[list[Watched]]:
    """``n`` open sessions (opened concurrently), closed on exit."""
    async with contextlib.AsyncExitStack() as stack:
        clients = await asyncio.gather(*(stack.enter_async_context(connect(url)) for _ in range(n)))
        yield [Watched(c) for c in clients]


def report(name: str, fault_at: float, watched: list[Watched]) -> list[float]:
    """Print and return the fault-to-close times (seconds)."""
    times = [w.closed_at - fault_at for w in watched if w.closed_at is not None]
    assert len(times) == len(watched), "every session must have closed"
    print(
        f"\n{name}: {len(times)} sessions closed; time to close "
        f"min {min(times) * 1000:.0f} ms, median {statistics.median(times) * 1000:.0f} ms, "
        f"max {max(times) * 1000:.0f} ms"
    )
    return times


def assert_engine_unavailable_tail(w: Watched) -> None:
    assert w.tail_types(2) == ["error", "session.closed"], w.tail_types(6)
    error, closed = w.events[-2:]
    assert error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "engine_unavailable"
    assert closed["reason"] == "engine_unavailable"
    assert w.client.close_code == 1011


def simulator_engine(*args: str, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "kind": "simulator",
        "simulator_args": args,
        # Each probe may take as long as the interval: 100 ms probes timed out twice
        # in a row on a loaded 2-core machine and failed healthy sessions before the
        # fault under test. Only the stall test needs fast health detection, and it
        # asks for it.
        "health_interval": 500 * MS,
        "health_failures": 3,
        "stop_grace": 1.0,
        "startup_timeout": 30.0,
    }
    values.update(overrides)
    return EngineConfig(**values)


async def warm_up(url: str) -> None:
    """One full session, so lazily created pools exist before the 'before' snapshot."""
    async with connect(url) as client:
        w = Watched(client)
        await w.start_response()
        await w.until_audio()


async def no_sessions(proxy: Any) -> None:
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0,
        timeout=3 * DEADLINE,
        what="no session active",
    )


# -- the engine dies -----------------------------------------------------------------------------


async def test_engine_sigkill_fails_20_sessions_then_restarts(sidecar) -> None:
    proxy = await sidecar(engine=simulator_engine(*PACED), upstream_close_timeout=0.5)
    supervisor = proxy.sidecar.supervisor
    await warm_up(proxy.url)
    await no_sessions(proxy)
    before = Snapshot.take()
    old_pid = supervisor.pid
    assert old_pid in before.children

    async with sessions(proxy.url, 20) as watched:
        await asyncio.gather(*(w.start_response() for w in watched))
        await asyncio.gather(*(w.until_audio() for w in watched))
        readers = [asyncio.ensure_future(w.read_to_close()) for w in watched]
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await asyncio.gather(*readers)
    times = report("engine SIGKILL, 20 sessions", killed_at, watched)
    # While the engine restarts, new clients are refused before the upgrade.
    async with aiohttp.ClientSession() as http:
        try:
            refused = await http.ws_connect(proxy.url)
        except aiohttp.WSServerHandshakeError as exc:
            assert exc.status == 503 and exc.headers is not None and "Retry-After" in exc.headers
        else:  # the restart was already done: then the session must work
            await refused.close()
    for w in watched:
        w.check_order()
        assert_engine_unavailable_tail(w)
        assert sum(e["type"] == AUDIO_DELTA for e in w.events) >= 1
    assert max(times) < 2.0

    # The supervisor restarts the engine and sessions work again.
    await wait_until(
        lambda: supervisor.pid not in (None, old_pid) and proxy.sidecar.state.engine_ready,
        timeout=3 * DEADLINE,
        what="engine restarted",
    )
    restarted_at = time.monotonic()
    assert proxy.metric("omni_sidecar_engine_restarts_total", {"reason": "exited"}) == 1
    await warm_up(proxy.url)
    print(f"engine back and serving {restarted_at - killed_at:.2f} s after the kill")
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "engine_unavailable"}) == 20
    await no_sessions(proxy)
    await wait_settled(before, LEAK_SLACK, what="engine SIGKILL")
    assert supervisor.pid in child_pids() and old_pid not in child_pids()


#: Fast enough that a stall is detected (2 probes + one probe timeout = 0.75 s) well
#: inside the test's 2 s bound, slow enough that a loaded machine answers each probe.
STALL_HEALTH_INTERVAL = 0.25


async def test_engine_stall_fails_health_then_sessions_and_restarts(sidecar) -> None:
    """``--stall-after``: sockets go silent and ``/health`` says 503 from the same moment."""
    stall_after = 3.0
    proxy = await sidecar(
        engine=simulator_engine(
            *PACED,
            "--stall-after",
            str(stall_after),
            "--health-fail-after",
            str(stall_after),
            health_interval=STALL_HEALTH_INTERVAL,
            health_failures=2,
        ),
        upstream_close_timeout=0.5,
        close_timeout=1.0,
    )
    supervisor = proxy.sidecar.supervisor
    old_pid = supervisor.pid
    async with sessions(proxy.url, 5) as watched:
        await asyncio.gather(*(w.start_response() for w in watched))
        await asyncio.gather(*(w.until_audio() for w in watched))
        assert supervisor.pid == old_pid and proxy.sidecar.state.engine_ready, (
            "the engine stalled before the sessions were set up; raise stall_after"
        )
        readers = [asyncio.ensure_future(w.read_to_close()) for w in watched]
        await asyncio.gather(*readers)
    # The engine fell silent at the stall: measure from each session's last engine event
    # (an upper bound: chunks come every 200 ms, so the stall is up to 200 ms later).
    silences = [w.closed_at - w.last_engine_event_at for w in watched]  # type: ignore[operator]
    print(
        f"\nengine stall (health_interval {STALL_HEALTH_INTERVAL:g} s, health_failures 2): "
        f"sessions closed "
        f"{min(silences) * 1000:.0f}-{max(silences) * 1000:.0f} ms after their last engine event"
    )
    assert max(silences) < 2.0
    for w in watched:
        w.check_order()
        assert_engine_unavailable_tail(w)
    await wait_until(
        lambda: supervisor.pid not in (None, old_pid) and proxy.sidecar.state.engine_ready,
        timeout=3 * DEADLINE,
        what="engine restarted",
    )
    assert proxy.metric("omni_sidecar_engine_restarts_total", {"reason": "unhealthy"}) == 1
    # The new engine serves (it will stall too, after another stall_after seconds).
    async with connect(proxy.url) as client:
        w = Watched(client)
        await w.start_response()
        await w.until_audio()


async def test_engine_hang_sigstop_is_caught_by_the_heartbeat(sidecar) -> None:
    """A frozen engine answers nothing, not even pings: each session fails on its own."""
    heartbeat = 200 * MS
    proxy = await sidecar(
        engine=simulator_engine(*PACED),
        heartbeat_interval=heartbeat,
        upstream_close_timeout=0.3,
        close_timeout=0.5,
    )
    pid = proxy.sidecar.supervisor.pid
    try:
        async with sessions(proxy.url, 5) as watched:
            await asyncio.gather(*(w.start_response() for w in watched))
            await asyncio.gather(*(w.until_audio() for w in watched))
            readers = [asyncio.ensure_future(w.read_to_close()) for w in watched]
            stopped_at = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            await asyncio.gather(*readers)
        times = report("engine SIGSTOP (heartbeat 0.2 s)", stopped_at, watched)
        for w in watched:
            w.check_order()
            assert_engine_unavailable_tail(w)
        assert max(times) < 2.0 + 3 * heartbeat
    finally:
        os.kill(pid, signal.SIGCONT)
    await no_sessions(proxy)


# -- the client goes away --------------------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


@pytest.mark.parametrize("how", ["frozen", "reset"])
async def test_client_vanishes_without_a_close_frame(engine, sidecar, how: str) -> None:
    """``frozen``: never reads, never answers pings (a dead NAT entry, a suspended laptop).
    ``reset``: the TCP connection is reset. Either way the engine gets ``session.close``."""
    heartbeat = 200 * MS
    proxy = await sidecar(upstream=engine.ws_url, heartbeat_interval=heartbeat)
    before = Snapshot.take()
    async with connect(proxy.url) as healthy:
        healthy_conn = await engine.next_connection()
        raw = await RawWebSocket.connect(proxy.url)
        conn = await engine.next_connection()
        raw.send_text('{"type":"x.hello"}')
        assert (await conn.receive_event())["type"] == "x.hello"
        vanished_at = time.monotonic()
        if how == "reset":
            raw.writer.transport.abort()
        # The healthy session keeps talking meanwhile, in both directions.
        ticks = 0
        while not conn.closed.is_set() or ticks < 20:
            await healthy_conn.send({"type": "x.tick", "n": ticks})
            ticks += 1
            assert (await healthy.recv()) == {"type": "x.tick", "n": ticks - 1}
            if ticks > 2000:
                pytest.fail("the vanished client was never detected")
            if not conn.closed.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(10 * MS):
                        await conn.closed.wait()
        detected = time.monotonic() - vanished_at
        assert conn.received_types() == ["x.hello", "session.close"]
        await healthy.send({"type": "x.still_here"})
        assert (await healthy_conn.receive_event())["type"] == "x.still_here"
    print(f"\nclient vanished ({how}): engine got session.close after {detected * 1000:.0f} ms")
    if how == "frozen":
        assert heartbeat <= detected < 3 * heartbeat + 1.0
    else:
        assert detected < 1.0
    raw.writer.transport.abort()
    await no_sessions(proxy)
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "client_closed"}) == 2
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "error"}) == 0
    await wait_settled(before, LEAK_SLACK, what=f"client vanished ({how})")


async def test_client_disconnects_while_its_buffer_is_full(simulator, sidecar, caplog) -> None:
    sim = await simulator(
        "--chunk-ms", "1000", "--realtime-factor", "0.01", "--response-seconds", "40"
    )
    proxy = await sidecar(
        upstream=sim.ws_url,
        max_pending_output_bytes=16 * MIB,
        client_write_buffer_bytes=16 * 1024,
        upstream_close_timeout=0.5,
        client_resume_grace=0,  # its buffer is freed now, not held for a resume
    )
    await warm_up(proxy.url)
    await no_sessions(proxy)
    before = Snapshot.take()
    async with connect(proxy.url) as healthy_client:
        healthy = Watched(healthy_client)
        # A small receive buffer: the kernel must not absorb what the sidecar holds.
        stuck_client_cm = connect(proxy.url, receive_buffer_bytes=4096)
        stuck = Watched(await stuck_client_cm.__aenter__())
        try:
            await stuck.start_response()  # ...and never read again
            await healthy.start_response()
            await healthy.client.recv_until("response.done", timeout=3 * DEADLINE)
            await wait_until(
                lambda: proxy.sidecar.sessions.total_pending_bytes > 1 * MIB,
                what="the stuck session's buffer fills",
            )
            pending = proxy.sidecar.sessions.total_pending_bytes
            gone_at = time.monotonic()
            abort(stuck.client.ws)
            await wait_until(
                lambda: proxy.metric("omni_sidecar_sessions_active") == 1,
                what="the stuck session is gone",
            )
            cleaned = time.monotonic() - gone_at
        finally:
            with contextlib.suppress(Exception):
                await stuck_client_cm.__aexit__(None, None, None)
        # The healthy session runs another response, gap-free.
        await healthy.start_response()
        await healthy.client.recv_until(
            lambda e: e["type"] == "response.done" and e["server_event_seq"] > 60,
            timeout=3 * DEADLINE,
        )
        healthy.check_order()
    print(
        f"\nclient gone with {pending / MIB:.1f} MiB queued: session gone after "
        f"{cleaned * 1000:.0f} ms"
    )
    await no_sessions(proxy)
    assert proxy.sidecar.sessions.total_pending_bytes == 0
    # The engine side was closed too.
    async with aiohttp.ClientSession() as http:

        async def sim_sessions() -> bool:
            async with http.get(f"{sim.http_url}/metrics") as resp:
                return "vllm_omni_sim_sessions_active 0" in await resp.text()

        await wait_until(sim_sessions, what="simulator sessions closed")
    failed = [r for r in caplog.records if r.levelname == "ERROR"]
    assert failed == [], [r.getMessage() for r in failed]
    await wait_settled(before, LEAK_SLACK, what="client gone with a full buffer")


# -- a crowd -----------------------------------------------------------------------------------------


async def _one_session(url: str, hold: asyncio.Event | None) -> tuple[str, float, Watched | None]:
    started = time.monotonic()
    try:
        async with connect(url) as client:
            admitted = time.monotonic() - started
            w = Watched(client)
            if hold is not None:
                await hold.wait()
            await w.start_response()
            await w.client.recv_until("response.done")
            w.check_order()
            return "served", admitted, w
    except aiohttp.WSServerHandshakeError as exc:
        assert exc.status == 503, exc
        assert exc.headers is not None and "Retry-After" in exc.headers
        return "refused", time.monotonic() - started, None


@pytest.mark.parametrize("max_sessions", [0, 10], ids=["unlimited", "max10"])
async def test_100_sessions_in_the_same_second(simulator, sidecar, max_sessions: int) -> None:
    sim = await simulator(*FAST)
    proxy = await sidecar(upstream=sim.ws_url, max_sessions=max_sessions)
    await warm_up(proxy.url)
    await no_sessions(proxy)
    before = Snapshot.take()
    hold = asyncio.Event() if max_sessions else None
    started = time.monotonic()
    tasks = [asyncio.ensure_future(_one_session(proxy.url, hold)) for _ in range(100)]
    if hold is not None:
        # Everyone has an answer (a slot or a 503) while the admitted ones hold on.
        await wait_until(
            lambda: sum(t.done() for t in tasks) == 100 - max_sessions,
            timeout=3 * DEADLINE,
            what="every refused client answered",
        )
        await wait_until(
            lambda: proxy.metric("omni_sidecar_sessions_active") == max_sessions,
            what="the admitted sessions are open",
        )
        assert sum(t.done() for t in tasks) == 100 - max_sessions
        hold.set()
    async with asyncio.timeout(6 * DEADLINE):
        results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    served = [r for r in results if r[0] == "served"]
    refused = [r for r in results if r[0] == "refused"]
    if max_sessions:
        assert (len(served), len(refused)) == (max_sessions, 100 - max_sessions)
        assert (
            proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"})
            == 100 - max_sessions
        )
    else:
        assert len(served) == 100
    slowest = max(r[1] for r in results)
    print(
        f"\n100 sessions at once (max_sessions={max_sessions}): {len(served)} served, "
        f"{len(refused)} refused 503; slowest answer {slowest * 1000:.0f} ms, "
        f"all done in {elapsed:.2f} s"
    )
    await no_sessions(proxy)
    await wait_settled(before, LEAK_SLACK, what=f"100 sessions (max_sessions={max_sessions})")


# -- SIGTERM on a real process in the middle of it all ----------------------------------------------


class Served(SidecarChild):
    """``omni-sidecar serve`` with the simulator engine, as a child process."""

    def __init__(self, tmp_path: Path, *flags: str, simulator_args: str) -> None:
        super().__init__(
            # Gapless server_event_seq is checked: no acks on the clients' behalf.
            "--playback-ack", "off", *flags,
            base_env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")},
            env={
                "OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS": simulator_args,
                "OMNI_SIDECAR_ENGINE_HEALTH_INTERVAL": "0.2",
                "OMNI_SIDECAR_ENGINE_STOP_GRACE": "2",
            },
            log_path=tmp_path / "sidecar.log",
            ready_timeout=3 * DEADLINE,
            stop_grace=DEADLINE,
        )  # fmt: skip

    @property
    def ws(self) -> str:
        return self.ws_url

    async def metric(self, http: aiohttp.ClientSession, line_prefix: str) -> float | None:
        try:
            async with http.get(f"{self.admin_url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError):
            return None
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.rsplit(" ", 1)[1])
        return None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    process = Served(
        tmp_path,
        "--drain-timeout",
        "1.0",
        "--close-timeout",
        "1.0",
        "--heartbeat-interval",
        "0",
        "--upstream-close-timeout",
        "0.3",
        "--log-level",
        "info",
        simulator_args=" ".join(PACED),
    )
    try:
        yield process.start()
    finally:
        process.stop()


async def test_sigterm_during_all_of_it(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        await served.ready()
        pid = served.proc.pid
        [engine_pid] = child_pids(pid)

        # Leak check of the real process across a round of sessions.
        await warm_up(served.ws)
        await wait_until(
            lambda: _zero(served.metric(http, "omni_sidecar_sessions_active")),
            what="warm-up over",
        )
        before = Snapshot.take(pid)
        async with sessions(served.ws, 10) as round_one:
            await asyncio.gather(*(w.start_response() for w in round_one))
            await asyncio.gather(*(w.until_audio() for w in round_one))
        await wait_until(
            lambda: _zero(served.metric(http, "omni_sidecar_sessions_active")),
            what="round one over",
        )
        await wait_settled(
            before, Slack(fds=2, rss_bytes=24 * MIB), what="serve process, 10 sessions"
        )

        # Now everything at once: readers mid-response, a client that stopped
        # reading, a frozen raw client, then SIGTERM and a late arrival.
        async with sessions(served.ws, 20) as watched, connect(served.ws) as lazy_client:
            lazy = Watched(lazy_client)
            raw = await RawWebSocket.connect(served.ws)
            raw.send_text('{"type":"session.update","session":{}}')
            await lazy.start_response()
            await asyncio.gather(*(w.start_response() for w in watched))
            await asyncio.gather(*(w.until_audio() for w in watched))
            readers = [asyncio.ensure_future(w.read_to_close(3 * DEADLINE)) for w in watched]
            sigterm_at = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            # A new client during the drain is refused before the upgrade.
            await wait_until(lambda: _status(http, served, 503), what="readyz 503")
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(served.ws)
            assert refused.value.status == 503
            await asyncio.gather(*readers)
            # The client that did not read finds the same ending in its buffer.
            await lazy.read_to_close()
            raw_events, raw_code = await raw.read_until_close()
            raw.writer.transport.abort()
        times = report("SIGTERM (drain_timeout 1 s)", sigterm_at, watched)
        for w in [*watched, lazy]:
            w.check_order()
            assert w.events[-1]["type"] == "session.closed", w.tail_types(4)
            assert w.events[-1]["reason"] == "shutdown"
            assert w.client.close_code == 1001
        assert raw_events[-1]["type"] == "session.closed" and raw_code == 1001
        assert 1.0 * 0.9 <= min(times) and max(times) < 1.0 + 2.0

        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(None, lambda: served.proc.wait(timeout=DEADLINE))
        exited = time.monotonic() - sigterm_at
    print(f"omni-sidecar exited {code} {exited:.2f} s after SIGTERM")
    assert code == 0, served.log()
    with pytest.raises(ProcessLookupError):
        os.killpg(engine_pid, 0)
    assert child_pids(pid) == []
    assert "Traceback" not in served.log(), served.log()


async def _zero(value: Any) -> bool:
    return (await value) == 0


async def _status(http: aiohttp.ClientSession, served: Served, status: int) -> bool:
    try:
        async with http.get(f"http://127.0.0.1:{served.port}/readyz") as resp:
            return resp.status == status
    except (aiohttp.ClientError, OSError):
        return False


async def test_shutdown_with_a_stuck_client_is_bounded(simulator, sidecar) -> None:
    """A client that stopped reading cannot hold the shutdown past its deadlines."""
    sim = await simulator(
        "--chunk-ms", "1000", "--realtime-factor", "0.01", "--response-seconds", "40"
    )
    drain, close = 0.5, 0.5
    proxy = await sidecar(
        upstream=sim.ws_url,
        max_pending_output_bytes=16 * MIB,
        client_write_buffer_bytes=16 * 1024,
        drain_timeout=drain,
        close_timeout=close,
        upstream_close_timeout=0.3,
    )
    # The stuck client's small receive buffer keeps the kernel from absorbing its output.
    async with (
        connect(proxy.url, receive_buffer_bytes=4096) as stuck_client,
        connect(proxy.url) as reader_client,
    ):
        stuck, reader = Watched(stuck_client), Watched(reader_client)
        await stuck.start_response()  # ...and never read again
        await reader.start_response()
        await reader.client.recv_until("response.done", timeout=3 * DEADLINE)
        await wait_until(
            lambda: proxy.sidecar.sessions.total_pending_bytes > 1 * MIB,
            what="the stuck session's buffer fills",
        )
        stop_at = time.monotonic()
        code = await proxy.stop()
        stopped = time.monotonic() - stop_at
        await reader.read_to_close()
    print(
        f"\nshutdown with a stuck client (drain {drain} s, close {close} s): "
        f"stopped in {stopped:.2f} s"
    )
    assert code == 0
    # The stuck session is aborted after close_timeout; the bound below keeps
    # the last resort (runner cleanup) in it as well.
    assert stopped < drain + (close + 1.0) + 1.0 + 1.5
    reader.check_order()
    assert reader.events[-1]["reason"] == "shutdown" and reader.client.close_code == 1001


async def test_sigterm_while_a_session_is_still_connecting_upstream(sidecar) -> None:
    slow = await StallEngine(complete_handshake=True, handshake_delay=0.5).start()
    try:
        proxy = await sidecar(upstream=slow.ws_url, drain_timeout=1.0, close_timeout=1.0)

        async def client() -> tuple[int, list[Event], int | None]:
            try:
                async with connect(proxy.url) as c:
                    return 101, await c.recv_until_closed(), c.close_code
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status, [], None

        task = asyncio.ensure_future(client())
        await asyncio.wait_for(slow.connected.wait(), DEADLINE)  # admitted, connecting upstream
        await proxy.stop()
        status, events, code = await asyncio.wait_for(task, DEADLINE)
        if status == 101:
            assert [e["type"] for e in events] == ["session.closed"], (events, code)
            assert events[0]["reason"] == "shutdown" and code == 1001
        else:
            assert status == 503
    finally:
        await slow.aclose()


async def test_overflowed_session_with_a_stuck_client_ends_after_close_timeout(
    simulator, sidecar
) -> None:
    sim = await simulator(
        "--chunk-ms", "1000", "--realtime-factor", "0.01", "--response-seconds", "40"
    )
    close = 0.5
    proxy = await sidecar(
        upstream=sim.ws_url,
        max_pending_output_bytes=256 * 1024,
        client_write_buffer_bytes=16 * 1024,
        close_timeout=close,
        upstream_close_timeout=0.3,
    )
    async with connect(proxy.url) as stuck_client:
        stuck = Watched(stuck_client)
        await stuck.start_response()  # ...and never read again
        await wait_until(
            lambda: proxy.metric("omni_sidecar_overflows_total", {"policy": "close_session"}) == 1,
            what="overflow",
        )
        overflowed_at = time.monotonic()
        await wait_until(
            lambda: proxy.metric("omni_sidecar_sessions_active") == 0,
            timeout=close + 2.0,
            what="the overflowed session ends",
        )
        ended = time.monotonic() - overflowed_at
    print(f"\noverflow with a stuck client: session ended {ended:.2f} s after the overflow")
    assert ended < close + 1.0
