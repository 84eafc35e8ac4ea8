"""The engine supervisor with real child processes, seen through an in-process Sidecar.

Each test runs a whole ``proxy.server.Sidecar`` on ephemeral loopback ports
whose engine is a real simulator child (``python -m engine_launcher.simulator``)
with a fault knob, and asserts what clients and operators observe: /readyz,
events and close codes, restart metrics, exit status, log lines, processes.
docs/design.md, Admission and lifecycle (engine goes away, admission), Engine launcher and Engine
supervision.

The same rules in virtual time, without children or sockets:
tests/engine_launcher/test_supervisor_shell.py.

Every wait has a deadline (multiples of ``MS``, scaled by
``OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR``); nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

import engine_launcher.supervisor
from engine_launcher.launcher_errors import RestartBudgetExhausted
from engine_launcher.policy import EngineState
from engine_launcher.supervisor import Supervisor
from proxy.server import Sidecar
from proxy.settings import EngineConfig, Settings
from tests.conftest import DEADLINE, MS, RunningSidecar, wait_until

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
RESTARTS = "omni_sidecar_engine_restarts_total"

#: Fast supervision for tests: poll health every 200 ms (each probe may take as
#: long), 2 failures = unhealthy.
FAST: dict[str, Any] = {
    "health_interval": 200 * MS,
    "health_failures": 2,
    "stop_grace": 2000 * MS,
    "startup_timeout": 3 * DEADLINE,
}
#: Paced audio: a 200 ms chunk every 200 ms, so a response is really "in progress".
PACED = ("--chunk-ms", "200", "--realtime-factor", "1")

#: ``kind = "command"`` engine: the simulator with ``--crash-after`` on its first
#: run only (a marker file remembers the run), so that the restarted engine
#: stays up and a new session can succeed on it.
CRASH_ONCE = """\
import os, sys
marker, args = sys.argv[1], sys.argv[2:]
if os.path.exists(marker):
    i = args.index("--crash-after")
    del args[i:i + 2]
else:
    open(marker, "w").close()
os.execv(sys.executable, [sys.executable, "-m", "engine_launcher.simulator", *args])
"""

START = [
    '{"type":"session.update","session":{"modalities":["audio","text"]}}',
    '{"type":"input_audio_buffer.append","audio":"AAAAAAAAAAAAAAAA"}',
    '{"type":"input_audio_buffer.commit"}',
    '{"type":"response.create"}',
]
AUDIO_DELTAS = {"response.output_audio.delta", "response.audio.delta"}


# -- helpers ------------------------------------------------------------------------------------


def engine(*simulator_args: str, **overrides: Any) -> EngineConfig:
    return EngineConfig(kind="simulator", simulator_args=simulator_args, **{**FAST, **overrides})


async def readyz(proxy_http: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{proxy_http}/readyz") as resp:
        return resp.status, await resp.json()


def gone(pid: int) -> bool:
    """The process no longer exists (a zombie still counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def engine_children() -> list[int]:
    """Simulator processes whose parent is this test process (leaks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"engine_launcher.simulator" in cmdline:
            found.append(int(entry))
    return found


@contextlib.asynccontextmanager
async def run_sidecar(
    settings: Settings, environ: dict[str, str] | None = None
) -> AsyncIterator[tuple[Sidecar, asyncio.Task[int]]]:
    """A Sidecar whose run() the test awaits itself (no wait for readiness)."""
    instance = Sidecar(settings, environ=environ or {})
    task = asyncio.ensure_future(instance.run())
    try:
        await wait_until(lambda: "listen" in instance.bound or task.done(), what="listeners")
        yield instance, task
    finally:
        if not task.done():
            instance.stop_requested.set()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3 * DEADLINE):
                    await task


def sidecar_settings(engine_config: EngineConfig, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "heartbeat_interval": 0.0,
        "engine": engine_config,
    }
    values.update(overrides)
    return Settings(**values)


@dataclass
class Client:
    """One client session: every text event it got, and how it ended."""

    ws: aiohttp.ClientWebSocketResponse
    events: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None
    closed_at: float | None = None  # time.time() of the close frame

    async def receive_until(self, types: set[str]) -> dict[str, Any]:
        while True:
            msg = await self.ws.receive(timeout=DEADLINE)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            event: dict[str, Any] = orjson.loads(msg.data)
            self.events.append(event)
            if event["type"] in types:
                return event

    async def read_to_close(self) -> None:
        while True:
            msg = await self.ws.receive(timeout=DEADLINE)
            if msg.type is not aiohttp.WSMsgType.TEXT:
                self.closed_at = time.time()
                self.close_code = self.ws.close_code
                return
            self.events.append(orjson.loads(msg.data))


async def start_response(http: aiohttp.ClientSession, url: str) -> Client:
    """Open a session, start a response, return once its first audio arrived."""
    client = Client(await http.ws_connect(url, max_msg_size=0))
    for text in START:
        await client.ws.send_str(text)
    await client.receive_until(AUDIO_DELTAS)
    return client


def child_timestamp(records: list[logging.LogRecord], pattern: str) -> float:
    """Wall-clock time a child logged a line (its own asctime, ms resolution)."""
    regex = re.compile(r"engine: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + pattern)
    for record in records:
        match = regex.search(record.getMessage())
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"no engine log line matching {pattern!r}")


def launcher_lines(records: list[logging.LogRecord]) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in records
        if r.name in ("engine_launcher", "omni_sidecar")
        or (r.name == "engine_launcher.child" and "crash" in r.getMessage())
    ]


@pytest.fixture(autouse=True)
def no_leaked_engines() -> Any:
    yield
    leaked = engine_children()
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert leaked == [], "engine child processes outlived the test"


# -- start-up -----------------------------------------------------------------------------------


async def test_slow_start_is_not_ready_until_the_engine_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(engine_launcher.supervisor, "PROGRESS_INTERVAL", 200 * MS)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setblocking(False)
    settings = sidecar_settings(engine("--startup-delay", str(1500 * MS)))
    async with run_sidecar(settings, {"NOTIFY_SOCKET": str(tmp_path / "notify")}) as (sc, task):
        host, port = sc.bound["listen"]
        base = f"http://{host}:{port}"
        started = time.monotonic()
        status, body = await readyz(base)
        assert status == 503
        assert body["status"] == "not_ready" and body["reason"] == "not_ready"
        assert "starting" in body["detail"]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as resp:
                assert resp.status == 200  # alive while the engine loads
            # Sessions are refused before the upgrade while the engine loads.
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"ws://{host}:{port}/v1/realtime")
            assert refused.value.status == 503

        not_ready_answers = 0
        datagrams: list[str] = []

        def drain() -> None:
            # As systemd would: read as they come (a full queue drops notifications).
            with contextlib.suppress(BlockingIOError):
                while True:
                    datagrams.append(notify.recv(65536).decode())

        async def ready() -> bool:
            nonlocal not_ready_answers
            drain()
            status, _ = await readyz(base)
            not_ready_answers += status == 503
            return status == 200

        await wait_until(ready, timeout=3 * DEADLINE, what="/readyz 200")
        assert time.monotonic() - started >= 1.0  # it really waited for the load
        assert not_ready_answers >= 1
        start_seconds = sc.registry.get_sample_value("omni_sidecar_engine_start_seconds")
        assert start_seconds is not None and start_seconds >= 1500 * MS * 0.99
        assert sc.registry.get_sample_value("omni_sidecar_engine_up") == 1.0
        assert not task.done()
        drain()
    notify.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "engine_launcher"]
    progress = [m for m in messages if m.startswith("engine starting: ")]
    assert progress, messages
    assert re.match(
        r"engine starting: \d+ s elapsed, last probe: connect 127\.0\.0\.1:\d+", progress[0]
    )
    assert any(m.startswith("engine starting -> ready (ready)") for m in messages)
    # systemd heard about the slow start, then READY=1 once the engine answered.
    extends = [d for d in datagrams if "EXTEND_TIMEOUT_USEC=" in d]
    assert extends and extends[0].startswith("STATUS=engine starting (")
    assert re.search(r"\nEXTEND_TIMEOUT_USEC=\d+$", extends[0])
    ready_at = next(i for i, d in enumerate(datagrams) if d.startswith("READY=1\n"))
    assert datagrams.index(extends[0]) < ready_at


async def test_cancelling_the_supervisor_during_startup_propagates() -> None:
    """Cancellation is never swallowed (docs/design.md, Code rules (6)), and the child still
    goes."""
    supervisor = Supervisor(engine("--startup-delay", str(5 * DEADLINE), stop_grace=DEADLINE))
    task = asyncio.ensure_future(supervisor.run())
    await wait_until(lambda: supervisor.pid is not None, what="engine spawned")
    pid = supervisor.pid
    assert pid is not None
    await wait_until(lambda: pid in engine_children(), what="engine process running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(DEADLINE):
            await task
    assert task.cancelled()
    assert gone(pid)


# -- engine death ------------------------------------------------------------------------------


async def test_crash_mid_response_fails_every_session_then_restarts(
    sidecar: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    crash_after = 3000 * MS
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)
    config = EngineConfig(
        kind="command",
        command=(
            PY,
            str(script),
            str(tmp_path / "crashed-once"),
            "--host",
            "{host}",
            "--port",
            "{port}",
            *PACED,
            "--response-seconds",
            "60",
            "--crash-after",
            str(crash_after),
        ),
        **FAST,
    )
    proxy: RunningSidecar = await sidecar(engine=config, drain_timeout=1.0, close_timeout=1.0)
    first_pid = proxy.sidecar.supervisor.pid
    async with aiohttp.ClientSession() as http:
        clients = await asyncio.gather(*(start_response(http, proxy.url) for _ in range(3)))
        assert proxy.metric("omni_sidecar_sessions_active") == 3
        async with asyncio.timeout(crash_after + DEADLINE):
            await asyncio.gather(*(c.read_to_close() for c in clients))

        crashed_at = child_timestamp(caplog.records, "--crash-after reached")
        delays = [c.closed_at - crashed_at for c in clients if c.closed_at is not None]
        print(f"\nengine death -> client close (s): {', '.join(f'{d:.3f}' for d in delays)}")
        for client in clients:
            # Mid-response: audio had been flowing, no response.done reached the client.
            types = [e["type"] for e in client.events]
            assert "response.done" not in types
            error, closed = client.events[-2:]
            assert error["type"] == "error"
            assert error["error"]["type"] == "server_error"
            assert error["error"]["code"] == "engine_unavailable"
            assert closed["type"] == "session.closed"
            assert closed["reason"] == "engine_unavailable"
            assert client.close_code == 1011
        assert len(delays) == 3
        assert max(delays) < 1.0, delays
        assert min(delays) > -0.01, delays  # the crash came first (clock sanity)

        # Not ready while the engine is down, ready again after the restart.
        await wait_until(
            lambda: _status_is(proxy.http_url, 503), timeout=DEADLINE, what="/readyz 503"
        )
        await wait_until(
            lambda: _status_is(proxy.http_url, 200), timeout=2 * DEADLINE, what="/readyz 200"
        )
        assert proxy.sidecar.supervisor.pid != first_pid
        assert gone(first_pid)

        # A new session works on the restarted engine.
        client = await start_response(http, proxy.url)
        await client.ws.send_str('{"type":"session.close"}')
        await client.read_to_close()
        assert client.events[-1]["type"] == "session.closed"
        assert client.close_code == 1000

    assert proxy.metric(RESTARTS, {"reason": "exited"}) == 1
    assert proxy.metric(RESTARTS, {"reason": "unhealthy"}) == 0
    assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "engine_unavailable"}) == 3
    lines = launcher_lines(caplog.records)
    print("\n".join(lines))
    # "unhealthy ->" when a health poll hit the dead port before the exit was reaped.
    exited = re.compile(
        r"engine (ready|unhealthy) -> restarting \(exited\) engine exited with status 1"
    )
    assert any(exited.search(m) for m in lines), lines
    assert any(m.startswith("WARNING engine_launcher: restarting engine in ") for m in lines)
    assert any("engine starting -> ready (ready)" in m for m in lines)


async def _status_is(base: str, status: int) -> bool:
    return (await readyz(base))[0] == status


#: A 100 ms chunk every 100 ms: frames reach the session far more often than the
#: failure window (3 failures x 200 ms) of the tests below.
STREAMING = ("--chunk-ms", "100", "--realtime-factor", "1")


@pytest.mark.parametrize("health", ["--health-fail-after", "--health-hang-after"])
async def test_failing_health_while_streaming_degrades_then_restarts_once_quiet(
    sidecar: Any, caplog: pytest.LogCaptureFixture, health: str
) -> None:
    """/health answers 503, or nothing at all, from 3 s on (an engine busy under load)
    while a response streams. Frames still reach the session: the engine is degraded, not dead: the
    response plays to its end, nothing new is admitted (/readyz 503). Once the
    response is done and no frame comes any more, the next failed probes restart
    it (reason unhealthy) and the quiet session ends with engine_unavailable."""
    caplog.set_level(logging.INFO)
    config = engine(*STREAMING, "--response-seconds", "7", health, "3.0", health_failures=3)
    proxy: RunningSidecar = await sidecar(engine=config, drain_timeout=1.0, close_timeout=1.0)
    supervisor = proxy.sidecar.supervisor
    first_pid = supervisor.pid
    degraded = {"state": "degraded"}
    async with aiohttp.ClientSession() as http:
        client = await start_response(http, proxy.url)
        await wait_until(
            lambda: proxy.metric("omni_sidecar_engine_state", degraded) == 1,
            what="degraded while the response streams",
        )
        status, body = await readyz(proxy.http_url)
        assert status == 503, body
        done = await client.receive_until({"response.done"})
        assert done["response"]["status"] == "completed", done
        assert proxy.metric(RESTARTS, {"reason": "unhealthy"}) == 0, "restarted under a stream"
        assert supervisor.pid == first_pid
        await client.read_to_close()
    assert not [e for e in client.events if e["type"] == "error"][:-1], client.events[-3:]
    error, closed = client.events[-2:]
    assert (error["type"], error["error"]["code"]) == ("error", "engine_unavailable")
    assert (closed["type"], closed["reason"]) == ("session.closed", "engine_unavailable")
    assert client.close_code == 1011
    await wait_until(
        lambda: proxy.metric(RESTARTS, {"reason": "unhealthy"}) >= 1,
        timeout=2 * DEADLINE,
        what="a restart once the frames stopped",
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "engine_launcher"]
    assert any("degraded, not restarted" in m for m in messages), messages
    assert any("degraded -> restarting (unhealthy)" in m for m in messages), messages
    await wait_until(lambda: gone(first_pid), what="old engine gone")
    await wait_until(
        lambda: supervisor.state is EngineState.READY,
        timeout=2 * DEADLINE,
        what="ready again after the restart",
    )


async def test_an_engine_without_frames_or_health_is_restarted_under_its_session(
    sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Really dead: from 2 s on the engine neither sends a frame (``--stall-after``,
    sockets kept open) nor answers /health with 200. Its streaming session does not
    keep it: restarted (reason unhealthy), the session ends with engine_unavailable."""
    caplog.set_level(logging.INFO)
    config = engine(
        *STREAMING, "--response-seconds", "60", "--health-fail-after", "2.0",
        "--stall-after", "2.0", health_failures=3,
    )  # fmt: skip
    proxy: RunningSidecar = await sidecar(engine=config, drain_timeout=1.0, close_timeout=1.0)
    first_pid = proxy.sidecar.supervisor.pid
    async with aiohttp.ClientSession() as http:
        client = await start_response(http, proxy.url)
        await client.read_to_close()
    error, closed = client.events[-2:]
    assert (error["type"], error["error"]["code"]) == ("error", "engine_unavailable")
    assert (closed["type"], closed["reason"]) == ("session.closed", "engine_unavailable")
    assert client.close_code == 1011
    assert not any(e["type"] == "response.done" for e in client.events)
    await wait_until(
        lambda: proxy.metric(RESTARTS, {"reason": "unhealthy"}) >= 1,
        timeout=2 * DEADLINE,
        what="a restart for failed health checks",
    )
    assert proxy.metric(RESTARTS, {"reason": "exited"}) == 0
    messages = [
        r.getMessage() for r in caplog.records if r.name in ("engine_launcher", "omni_sidecar")
    ]
    assert any("failing 1 live sessions" in m for m in messages), messages
    await wait_until(lambda: gone(first_pid), what="old engine gone")


async def test_restart_budget_exhausted_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    settings = sidecar_settings(
        engine("--crash-after", "0", max_restarts=1, restart_window=30 * DEADLINE)
    )
    async with run_sidecar(settings) as (sc, task):
        async with asyncio.timeout(3 * DEADLINE):
            code = await task
        assert code == 1
        assert sc.supervisor.state is EngineState.FAILED
        assert sc.supervisor.restarts == 1
        assert sc.registry.get_sample_value("omni_sidecar_engine_up") == 0.0
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name == "omni_sidecar"
    ]
    assert any(m.startswith("engine failed: engine restarted 1 times within") for m in errors), (
        errors
    )


async def test_restarts_metric_counts_only_restarts_that_happened() -> None:
    settings = sidecar_settings(
        engine("--crash-after", "0", max_restarts=1, restart_window=30 * DEADLINE)
    )
    async with run_sidecar(settings) as (sc, task):
        async with asyncio.timeout(3 * DEADLINE):
            assert await task == 1
        assert sc.supervisor.restarts == 1
        assert sc.registry.get_sample_value(RESTARTS, {"reason": "exited"}) == 1


async def test_engine_ignoring_sigterm_is_killed_after_grace(
    sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    grace = 500 * MS
    proxy: RunningSidecar = await sidecar(engine=engine("--ignore-sigterm", stop_grace=grace))
    pid = proxy.sidecar.supervisor.pid
    assert pid is not None and not gone(pid)
    started = time.monotonic()
    assert await proxy.stop() == 0
    elapsed = time.monotonic() - started
    assert elapsed >= grace  # it waited the grace period before SIGKILL
    assert elapsed < grace + DEADLINE
    assert gone(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing left in the engine's process group either
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"engine ignored SIGTERM for {grace:.1f} s; sending SIGKILL" in warnings
    assert proxy.sidecar.supervisor.state is EngineState.STOPPED


# -- admission -----------------------------------------------------------------------------------


async def test_capacity_refuses_with_retry_after(sidecar: Any) -> None:
    proxy: RunningSidecar = await sidecar(engine=engine(), max_sessions=1)
    async with aiohttp.ClientSession() as http, http.ws_connect(proxy.url) as first:
        await first.send_str(START[0])
        msg = await first.receive(timeout=DEADLINE)
        assert orjson.loads(msg.data)["type"] == "session.created"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(proxy.url)
        assert refused.value.status == 503
        assert refused.value.headers is not None
        assert int(refused.value.headers["Retry-After"]) >= 1
        status, body = await readyz(proxy.http_url)
        assert (status, body["reason"]) == (503, "capacity")
    assert proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"}) == 1


async def test_admission_timeout_waits_for_a_free_slot(sidecar: Any) -> None:
    proxy: RunningSidecar = await sidecar(
        engine=engine(), max_sessions=1, admission_timeout=DEADLINE
    )
    admission = proxy.sidecar.admission
    async with aiohttp.ClientSession() as http:
        first = await http.ws_connect(proxy.url)
        await first.send_str(START[0])
        await first.receive(timeout=DEADLINE)
        second = asyncio.ensure_future(http.ws_connect(proxy.url))
        # The second handshake is parked on the admission condition, not refused.
        await wait_until(
            lambda: len(admission._freed._waiters) == 1 or second.done(), what="second waiting"
        )
        assert not second.done()
        await first.send_str('{"type":"session.close"}')
        async for _msg in first:
            pass
        left_at = time.monotonic()
        async with asyncio.timeout(DEADLINE):
            ws = await second
        assert time.monotonic() >= left_at
        await ws.send_str(START[0])
        msg = await ws.receive(timeout=DEADLINE)
        assert orjson.loads(msg.data)["type"] == "session.created"
        await ws.close()
    assert proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"}) == 0


# -- detection: exit, stop, output ---------------------------------------------------------------


async def test_killed_engine_closes_admission_before_the_next_handshake(sidecar: Any) -> None:
    """The exit is awaited, not polled: with health probes 30 s apart, only the
    exit waiter can close admission, and it does before the next client arrives
    (503 not_ready, never 502 from a dead engine port)."""
    proxy: RunningSidecar = await sidecar(engine=engine(health_interval=30.0))
    pid = proxy.sidecar.supervisor.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: gone(pid), what="the engine reaped")
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(proxy.url)
    assert refused.value.status == 503
    status, body = await readyz(proxy.http_url)
    assert (status, body["reason"]) == (503, "not_ready")
    assert "engine exited with status -9" in body["detail"]
    assert proxy.metric("omni_sidecar_engine_up") == 0
    rejected = "omni_sidecar_sessions_rejected_total"
    assert proxy.metric(rejected, {"reason": "not_ready"}) == 1
    assert proxy.metric(rejected, {"reason": "upstream_unavailable"}) == 0
    await wait_until(
        lambda: proxy.sidecar.supervisor.state is EngineState.READY,
        timeout=2 * DEADLINE,
        what="restarted",
    )


async def test_stopped_engine_is_declared_within_the_documented_bound_then_killed(
    sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP: the port still accepts, /health never answers. Declared unhealthy
    after exactly ``health_failures`` failed probes, within ``failures × interval +
    probe timeout``; SIGTERM (with SIGCONT) is ignored, so SIGKILL after the grace."""
    caplog.set_level(logging.INFO)
    interval, failures, grace = 300 * MS, 3, 500 * MS
    proxy: RunningSidecar = await sidecar(
        engine=engine(
            "--ignore-sigterm",
            health_interval=interval,
            health_failures=failures,
            stop_grace=grace,
        )
    )
    supervisor = proxy.sidecar.supervisor
    pid = supervisor.pid
    assert pid is not None
    bound = failures * interval + min(interval, 5.0)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    ready_after_stop = 0

    async def not_ready() -> bool:
        nonlocal ready_after_stop
        status, _ = await readyz(proxy.http_url)
        ready_after_stop += status == 200
        return status == 503

    await wait_until(not_ready, timeout=bound + DEADLINE, what="/readyz 503")
    declared = time.monotonic() - stopped_at
    print(f"\nSIGSTOP -> /readyz 503 in {declared:.2f} s (bound {bound:.2f} s)")
    assert declared >= failures * interval * 0.95  # not at the first failed probe
    assert declared <= bound + 500 * MS
    assert ready_after_stop >= 1
    messages = [r.getMessage() for r in caplog.records if r.name == "engine_launcher"]
    assert any(f"-> restarting (unhealthy) {failures} failed health checks" in m for m in messages)
    try:
        await wait_until(lambda: gone(pid), timeout=grace + DEADLINE, what="stopped engine killed")
    finally:
        if not gone(pid):  # our own child: do not leave the teardown waiting on it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"engine ignored SIGTERM for {grace:.1f} s; sending SIGKILL" in warnings
    await wait_until(
        lambda: supervisor.state is EngineState.READY and supervisor.pid != pid,
        timeout=2 * DEADLINE,
        what="a new engine ready",
    )


async def test_stopped_engine_is_continued_so_that_sigterm_stops_it(
    sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGCONT goes with SIGTERM: a stopped engine that honours SIGTERM exits at
    once instead of costing the whole ``stop_grace`` (and a SIGKILL)."""
    caplog.set_level(logging.INFO)
    grace = DEADLINE
    proxy: RunningSidecar = await sidecar(
        engine=engine(health_interval=200 * MS, health_failures=2, stop_grace=grace)
    )
    pid = proxy.sidecar.supervisor.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_until(
            lambda: (
                proxy.sidecar.supervisor.state is not EngineState.READY
                and proxy.sidecar.supervisor.state is not EngineState.UNHEALTHY
            ),
            what="declared unhealthy",
        )
        declared_at = time.monotonic()
        await wait_until(lambda: gone(pid), timeout=grace + DEADLINE, what="engine gone")
        took = time.monotonic() - declared_at
    finally:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert took < grace / 2, took
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not any("ignored SIGTERM" in m for m in warnings), warnings


ENGINE_OUTPUT = """\
import sys
print("plain progress on stdout", flush=True)
print("WARNING a warning on stderr", file=sys.stderr, flush=True)
print("a bare stderr line", file=sys.stderr, flush=True)
import vllm_omni_is_not_here  # noqa
"""


async def test_engine_output_reaches_our_log_by_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """stdout at INFO, stderr at WARNING, a traceback at ERROR, each line ``engine: ``."""
    caplog.set_level(logging.INFO)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_OUTPUT)
    config = EngineConfig(kind="command", command=(PY, str(script)), max_restarts=0, **FAST)
    with pytest.raises(RestartBudgetExhausted) as failed:
        async with asyncio.timeout(DEADLINE):
            await Supervisor(config).run()
    assert "engine exited with status 1 before it was ready" in str(failed.value)
    lines = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "engine_launcher.child"
    ]
    print("\n".join(f"{level} {text}" for level, text in lines))
    assert ("INFO", "engine: plain progress on stdout") in lines
    assert ("WARNING", "engine: WARNING a warning on stderr") in lines
    assert ("WARNING", "engine: a bare stderr line") in lines
    traceback = [text for level, text in lines if level == "ERROR"]
    assert traceback[0] == "engine: Traceback (most recent call last):"
    assert traceback[-1] == "engine: ModuleNotFoundError: No module named 'vllm_omni_is_not_here'"
    assert any(text.startswith('engine:   File "') for text in traceback)
    assert all(level in ("INFO", "WARNING", "ERROR") for level, _ in lines)
