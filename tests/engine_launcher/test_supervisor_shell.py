"""The supervisor shell (engine_launcher/supervisor.py), socket-free and in virtual time.

A :class:`~tests.fakes.supervision.FakeClock` replaces time, a ``Spawner`` of
``FakeChild`` replaces the engine process and a ``ScriptedProbe`` replaces
the health check, so each test states exactly which sleeps the supervisor
asked for, which states it reported through ``on_state``, and when it gave
up. Nothing here opens a socket, starts a child or really sleeps; the only
real waits are deadlines on the test itself.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from engine_launcher.launcher_errors import RestartBudgetExhausted
from engine_launcher.policy import Backoff, EngineState, Observation
from engine_launcher.process import HealthProbe, UpstreamProbe, build_argv
from engine_launcher.supervisor import Supervisor, default_probe, probe_timeout
from proxy.settings import EngineConfig
from tests.conftest import DEADLINE, wait_until
from tests.fakes.supervision import HANG, FakeClock, ScriptedProbe, Spawner

pytestmark = pytest.mark.timeout(30)

S, O = EngineState, Observation
SEED = 1234
BACKOFF = Backoff(initial=1.0, cap=60.0, jitter=0.1)
PORT = 18_091


def command(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "kind": "command",
        "command": ("engine", "--port", "{port}"),
        "port": PORT,
        "health_interval": 2.0,
        "health_failures": 3,
        "max_restarts": 3,
        "restart_window": 600.0,
        "stop_grace": 7.0,
    }
    values.update(overrides)
    return EngineConfig(**values)


class Harness:
    """A Supervisor wired to fakes; ``states`` is every on_state call, with ``serving``."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        probe: ScriptedProbe | None = None,
        spawner: Spawner | None = None,
        clock: FakeClock | None = None,
        activity: Any = None,
    ) -> None:
        self.clock = clock or FakeClock()
        self.probe = probe or ScriptedProbe()
        self.spawner = spawner or Spawner()
        self.states: list[tuple[EngineState, Observation]] = []
        self.serving: list[bool] = []
        self.supervisor = Supervisor(
            config,
            on_state=self._on_state,
            backoff=BACKOFF,
            rng=random.Random(SEED),
            clock=self.clock,
            spawn=self.spawner,
            probe_factory=self.probe.factory,
            activity=activity,
        )

    def _on_state(self, state: EngineState, cause: Observation, detail: str) -> None:
        assert state is self.supervisor.state  # reported after the move, never before
        self.states.append((state, cause))
        self.serving.append(self.supervisor.serving)

    def start(self) -> asyncio.Task[None]:
        return asyncio.ensure_future(self.supervisor.run())


async def finish(task: asyncio.Task[None]) -> None:
    async with asyncio.timeout(DEADLINE):
        await task


def expected_delays(count: int) -> list[float]:
    """What Backoff(1, 60, 0.1) with Random(SEED) gives: 1·2^n ± 10 %, computed here."""
    rng = random.Random(SEED)
    delays = []
    for attempt in range(count):
        base = min(60.0, 2.0**attempt)
        delays.append(max(0.0, min(60.0, base + rng.uniform(-0.1 * base, 0.1 * base))))
    return delays


# -- restarts: backoff and budget ---------------------------------------------------------------


async def test_waits_exactly_the_backoff_between_restarts_then_gives_up() -> None:
    h = Harness(
        command(max_restarts=3), spawner=Spawner(exit_on_start=1), probe=ScriptedProbe(default=HANG)
    )
    task = h.start()
    with pytest.raises(RestartBudgetExhausted) as failed:
        await finish(task)
    assert failed.value.restarts == 3
    delays = expected_delays(3)
    assert delays[0] != 1.0  # the jitter is really applied (seeded)
    assert h.clock.sleeps == pytest.approx(delays, rel=1e-12, abs=0)
    assert h.clock.time == pytest.approx(1000.0 + sum(delays))
    assert len(h.spawner.children) == 4  # the first start and 3 restarts
    assert h.supervisor.restarts == 3
    assert h.supervisor.state is S.FAILED
    crash = [(S.RESTARTING, O.EXITED), (S.STARTING, O.RESTART)]
    assert h.states == crash * 3 + [(S.RESTARTING, O.EXITED), (S.FAILED, O.GIVE_UP)]
    assert not any(h.serving)
    # Every old process group was swept before the next start.
    assert all(child.stops for child in h.spawner.children)


@pytest.mark.parametrize("max_restarts", [0, 1, 2, 5])
async def test_gives_up_exactly_when_the_budget_is_spent(max_restarts: int) -> None:
    h = Harness(
        command(max_restarts=max_restarts),
        spawner=Spawner(exit_on_start=1),
        probe=ScriptedProbe(default=HANG),
    )
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert len(h.spawner.children) == max_restarts + 1
    assert h.supervisor.restarts == max_restarts
    assert len(h.clock.sleeps) == max_restarts
    assert h.states[-1] == (S.FAILED, O.GIVE_UP)


async def test_restarts_older_than_the_window_do_not_count() -> None:
    """Each run lives 6 s of virtual time (3 failed probes at 2 s) > the 5 s window:
    with a budget of one restart the supervisor keeps going, because the budget
    reads the injected clock."""
    h = Harness(command(max_restarts=1, restart_window=5.0), probe=ScriptedProbe(default=False))
    h.probe.script = [True]  # ready once; then every probe fails
    task = h.start()

    def ready_again() -> None:
        h.probe.script = [True] * (h.probe.calls + 1)

    h.spawner.on_spawn = lambda n: ready_again() if n < 4 else h.supervisor.request_stop()
    await finish(task)
    assert len(h.spawner.children) == 4
    assert h.supervisor.restarts == 3
    assert h.supervisor.state is S.STOPPED
    # Every restart is attempt 0 of its window: the initial delay, jittered.
    assert [round(d) for d in h.clock.sleeps if d != 2.0] == [1, 1, 1]


# -- health ------------------------------------------------------------------------------------


async def test_unhealthy_after_exactly_health_failures_consecutive_failures() -> None:
    script = [True, True, False, False, True, False, False, False]
    h = Harness(command(max_restarts=0), probe=ScriptedProbe(script, default=HANG))
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert h.probe.calls == len(script)
    assert h.states == [
        (S.READY, O.READY),
        (S.READY, O.HEALTH_OK),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.READY, O.HEALTH_OK),  # the good probe reset the count
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.RESTARTING, O.UNHEALTHY),  # the third in a row
        (S.FAILED, O.GIVE_UP),
    ]
    # Admitted until the failure is declared, not after.
    assert h.serving == [True] * 7 + [False, False]
    # Probes every health_interval (virtual probes take no time).
    assert h.clock.sleeps == [2.0] * (len(script) - 1)
    assert h.spawner.children[0].stops == [7.0]


async def test_failing_health_while_frames_flow_degrades_instead_of_restarting() -> None:
    """docs/design.md, Engine supervision: busy is not dead. The limit reached while
    the engine's frames still reach its sessions: DEGRADED (kept, admitting nothing
    new), asked again at each failed probe, READY again on a good one; the same
    limit once the frames stopped (none within failures × interval): restarted."""
    frames_until = {"probe": 7}  # the engine's frames reach a session up to probe 7

    def activity() -> float | None:
        return h.clock.now() - 1.0 if h.probe.calls <= frames_until["probe"] else 0.0

    script = [True, True, False, False, False, False, True, False, False, False]
    h = Harness(
        command(max_restarts=0),
        probe=ScriptedProbe(script, default=HANG),
        activity=activity,
    )
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert h.states == [
        (S.READY, O.READY),
        (S.READY, O.HEALTH_OK),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.DEGRADED, O.BUSY),  # the third failure, frames 1 s ago: kept
        (S.DEGRADED, O.BUSY),  # still failing, still busy
        (S.READY, O.HEALTH_OK),  # health answers again
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.UNHEALTHY, O.HEALTH_FAILED),
        (S.RESTARTING, O.UNHEALTHY),  # the limit again, no frame since probe 7
        (S.FAILED, O.GIVE_UP),
    ]
    # Degraded admits nothing new; its engine was not stopped under its sessions.
    assert h.serving == [True] * 4 + [False, False] + [True] * 3 + [False, False]
    assert h.spawner.children[0].stops == [7.0]  # once: at the restart, not before
    assert len(h.spawner.children) == 1


async def test_frames_older_than_the_failure_window_do_not_keep_an_engine() -> None:
    """A last frame longer ago than health_failures × health_interval (6 s here) is
    not busy: the engine is restarted at the limit as without sessions."""
    h = Harness(
        command(max_restarts=0),
        probe=ScriptedProbe([True], default=False),
        activity=lambda: h.clock.now() - 6.5,
    )
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert (S.DEGRADED, O.BUSY) not in h.states
    assert h.states[-2] == (S.RESTARTING, O.UNHEALTHY)


@pytest.mark.parametrize("limit", [1, 2, 4])
async def test_health_failures_setting_is_the_limit(limit: int) -> None:
    h = Harness(
        command(max_restarts=0, health_failures=limit),
        probe=ScriptedProbe([True], default=False),
    )
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert h.probe.calls == 1 + limit
    assert h.states[-2] == (S.RESTARTING, O.UNHEALTHY)


async def test_probe_timeout_never_exceeds_the_interval() -> None:
    """So that ``failures × interval + timeout`` bounds detection (module docstring)."""
    for interval, expected in ((2.0, 2.0), (0.1, 0.1), (30.0, 5.0)):
        config = command(health_interval=interval)
        assert probe_timeout(config) == expected
        child = default_probe(config, PORT)
        assert isinstance(child, HealthProbe)
        assert (child.host, child.port, child.path, child.timeout) == (
            "127.0.0.1",
            PORT,
            "/health",
            expected,
        )
        external = default_probe(
            EngineConfig(
                kind="external", upstream="ws://10.0.0.7:9000/v1/realtime", health_interval=interval
            ),
            None,
        )
        assert isinstance(external, UpstreamProbe)
        assert external.health_url == "http://10.0.0.7:9000/health"
        assert external.timeout == expected
    override = default_probe(
        EngineConfig(
            kind="external",
            upstream="wss://e.example/v1/realtime",
            health_url="http://e.example:8081/ready",
        ),
        None,
    )
    assert isinstance(override, HealthProbe)
    assert (override.host, override.port, override.path) == ("e.example", 8081, "/ready")


# -- exit, stop --------------------------------------------------------------------------------


async def test_exit_during_a_hung_probe_is_reported_at_once() -> None:
    """The exit is awaited, not polled: a probe that never answers does not delay it."""
    h = Harness(command(max_restarts=0), probe=ScriptedProbe([True], default=HANG))
    task = h.start()
    await wait_until(lambda: h.probe.calls == 2, timeout=DEADLINE, what="second probe in flight")
    sleeps_before = list(h.clock.sleeps)
    h.spawner.children[0].exit(137)
    # A handful of loop turns, no clock involved.
    for _ in range(20):
        if (S.RESTARTING, O.EXITED) in h.states:
            break
        await asyncio.sleep(0)
    assert (S.RESTARTING, O.EXITED) in h.states
    assert h.probe.cancelled == 1
    with pytest.raises(RestartBudgetExhausted):
        await finish(task)
    assert h.clock.sleeps == sleeps_before


async def test_exit_during_the_interval_sleep_is_reported_before_it_ends() -> None:
    clock = FakeClock(hold=True)
    h = Harness(command(max_restarts=0), clock=clock, probe=ScriptedProbe([True]))
    task = h.start()
    await wait_until(lambda: clock.parked == 1, timeout=DEADLINE, what="monitor sleeping")
    h.spawner.children[0].exit(1)
    with pytest.raises(RestartBudgetExhausted):
        await finish(task)
    assert h.states[:2] == [(S.READY, O.READY), (S.RESTARTING, O.EXITED)]
    assert clock.time == 1000.0  # no sleep completed
    assert clock.parked == 0  # and none was left behind


async def test_request_stop_ends_a_ready_engine_promptly() -> None:
    clock = FakeClock(hold=True)
    h = Harness(command(), clock=clock, probe=ScriptedProbe([True]))
    task = h.start()
    await wait_until(lambda: clock.parked == 1, timeout=DEADLINE, what="monitor sleeping")
    h.supervisor.request_stop()
    await finish(task)
    assert h.states == [(S.READY, O.READY), (S.STOPPING, O.STOP), (S.STOPPED, O.STOPPED)]
    assert h.serving == [True, False, False]
    assert h.spawner.children[0].stops == [7.0]
    assert clock.time == 1000.0 and clock.parked == 0
    assert h.probe.closed == 1


async def test_request_stop_during_the_backoff_starts_nothing_more() -> None:
    clock = FakeClock(hold=True)
    h = Harness(
        command(), clock=clock, spawner=Spawner(exit_on_start=1), probe=ScriptedProbe(default=HANG)
    )
    task = h.start()
    await wait_until(lambda: clock.parked == 1, timeout=DEADLINE, what="backoff sleeping")
    assert clock.sleeps == expected_delays(1)
    h.supervisor.request_stop()
    await finish(task)
    assert len(h.spawner.children) == 1
    assert h.states == [(S.RESTARTING, O.EXITED), (S.STOPPING, O.STOP), (S.STOPPED, O.STOPPED)]


async def test_request_stop_while_starting() -> None:
    h = Harness(command(), probe=ScriptedProbe(default=HANG))
    task = h.start()
    await wait_until(lambda: h.probe.calls == 1, timeout=DEADLINE, what="first probe")
    h.supervisor.request_stop()
    await finish(task)
    assert h.states == [(S.STOPPING, O.STOP), (S.STOPPED, O.STOPPED)]
    assert h.probe.cancelled == 1


async def test_startup_timeout_is_measured_on_the_injected_clock() -> None:
    h = Harness(command(max_restarts=0, startup_timeout=1.0), probe=ScriptedProbe(default=False))
    with pytest.raises(RestartBudgetExhausted):
        await finish(h.start())
    assert h.states == [(S.RESTARTING, O.START_FAILED), (S.FAILED, O.GIVE_UP)]
    assert h.clock.sleeps == [0.25] * 4  # probes at 0, .25, .5, .75, 1.0 s
    assert h.spawner.children[0].stops == [7.0]


# -- the real launch path, as the fakes see it ------------------------------------------------


async def test_vllm_omni_gets_its_documented_argv_env_and_port() -> None:
    config = EngineConfig(
        kind="vllm-omni",
        model="openbmb/MiniCPM-o-4_5",
        deploy_config="minicpmo_4_5.yaml",
        extra_args=("--trust-remote-code",),
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    clock = FakeClock(hold=True)
    h = Harness(config, clock=clock, probe=ScriptedProbe([True]))
    task = h.start()
    await wait_until(lambda: clock.parked == 1, timeout=DEADLINE, what="ready")
    child = h.spawner.children[0]
    assert child.argv == build_argv(config, 8091)
    assert child.argv[1:6] == [
        "-m",
        "vllm_omni.entrypoints.cli.main",
        "serve",
        "openbmb/MiniCPM-o-4_5",
        "--omni",
    ]
    assert child.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert [port for _, port in h.probe.made] == [8091]
    assert h.supervisor.target == "ws://127.0.0.1:8091"
    assert h.supervisor.pid == child.pid
    h.supervisor.request_stop()
    await finish(task)
    assert child.stops == [config.stop_grace]


# -- external endpoints ------------------------------------------------------------------------


async def test_external_is_served_only_while_its_probe_says_so() -> None:
    config = EngineConfig(
        kind="external",
        upstream="ws://127.0.0.1:9/v1/realtime",
        health_interval=2.0,
        health_failures=2,
    )
    script = [False, False, True, False, False, True]
    clock = FakeClock()
    h = Harness(config, clock=clock, probe=ScriptedProbe(script, default=HANG))
    task = h.start()
    await wait_until(lambda: h.probe.calls == len(script) + 1, timeout=DEADLINE, what="probes")
    assert h.states == [
        (S.STARTING, O.HEALTH_FAILED),
        (S.STARTING, O.HEALTH_FAILED),
        (S.READY, O.READY),
        # one failure below the limit: nothing to report
        (S.UNHEALTHY, O.UNHEALTHY),
        (S.READY, O.HEALTH_OK),
    ]
    assert h.serving == [False, False, True, False, True]
    assert h.clock.sleeps == [2.0] * len(script)
    assert [port for _, port in h.probe.made] == [None]
    h.supervisor.request_stop()
    await finish(task)
    assert h.states[-2:] == [(S.STOPPING, O.STOP), (S.STOPPED, O.STOPPED)]
    assert h.spawner.children == []
