"""The supervisor shell: runs the engine child through the pure state machine.

It starts the child, waits for readiness, probes health while ready and
restarts the child with backoff; a spent restart budget ends in FAILED and
``run`` raises ``RestartBudgetExhausted``. Everything that waits or spawns is
injected (a :class:`Clock`, ``spawn`` returning an :class:`EngineChild`, a
probe factory returning a :class:`Probe`; by default :class:`MonotonicClock`,
:class:`~engine_launcher.process.EngineProcess` and :func:`default_probe`), so
tests drive it without sockets, children or sleeping. How failures are
detected, and how fast: docs/design.md, Engine supervision.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol, TypeVar
from urllib.parse import urlsplit

from engine_launcher.engine_config import EngineConfig
from engine_launcher.launcher_errors import EngineStartError, RestartBudgetExhausted
from engine_launcher.policy import (
    Backoff,
    EngineState,
    EngineStateMachine,
    Observation,
    RestartBudget,
)
from engine_launcher.process import (
    MAX_PROBE_TIMEOUT,
    REALTIME_PATH,
    EngineProcess,
    HealthCheck,
    HealthProbe,
    UpstreamProbe,
    build_argv,
    free_port,
)
from engine_launcher.systemd import Notifier

__all__ = [
    "Activity",
    "Clock",
    "EngineChild",
    "MonotonicClock",
    "Probe",
    "ProbeFactory",
    "SpawnFactory",
    "StateCallback",
    "Supervisor",
    "default_probe",
    "probe_timeout",
]

log = logging.getLogger("engine_launcher")

StateCallback = Callable[[EngineState, Observation, str], None]
#: ``activity()``: monotonic seconds the engine's last frame reached one of its
#: sessions (None: no live session has had one).
Activity = Callable[[], float | None]

PROGRESS_INTERVAL: Final = 15.0
#: How often readiness is probed while the engine starts (seconds).
STARTUP_PROBE_INTERVAL: Final = 0.25

_T = TypeVar("_T")


class Clock(Protocol):
    """Where the supervisor's time comes from: seconds on a monotonic scale."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class EngineChild(Protocol):
    """One run of the engine as the supervisor uses it (EngineProcess, or a fake)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait(self) -> int:
        """Return once the child has exited, with its status."""
        ...

    async def stop(self, grace: float) -> int | None: ...


class Probe(Protocol):
    """One health check per call; ``aclose`` releases its connections."""

    async def __call__(self) -> HealthCheck: ...

    async def aclose(self) -> None: ...


#: ``spawn(argv, env)``: a child that is not started yet.
SpawnFactory = Callable[[Sequence[str], dict[str, str]], EngineChild]
#: ``probe_factory(config, port)``: the probe of one run (``port`` is None for external).
ProbeFactory = Callable[[EngineConfig, int | None], Probe]


def probe_timeout(config: EngineConfig) -> float:
    """Seconds one probe may take: never more than the interval, so probes cannot pile up."""
    return min(config.health_interval, MAX_PROBE_TIMEOUT)


def _spawn(argv: Sequence[str], env: dict[str, str]) -> EngineChild:
    return EngineProcess(argv, env=env)


def default_probe(config: EngineConfig, port: int | None) -> Probe:
    """The real probe of one run, as ``engine.probe`` picks it.

    ``health`` and ``auto`` ask ``health_url`` when it is set, else
    ``/health`` of the child or the upstream; for an ``external`` upstream
    without ``health_url``, ``auto`` hands over to a handshake when ``/health``
    is missing (:class:`~engine_launcher.process.UpstreamProbe`).
    ``websocket`` and ``tcp`` ask the upstream URL, or the child's port (its
    ``/v1/realtime``).
    """
    timeout = probe_timeout(config)
    kind = config.probe
    if config.kind == "external":
        assert config.upstream is not None
        if config.health_url is None or kind in ("websocket", "tcp"):
            return UpstreamProbe(config.upstream, kind=kind, timeout=timeout)
        health, upstream = urlsplit(config.health_url), urlsplit(config.upstream)
        return HealthProbe(
            health.hostname or upstream.hostname or "127.0.0.1",
            health.port or (443 if health.scheme == "https" else 80),
            path=health.path or "/health",
            timeout=timeout,
        )
    assert port is not None
    if kind in ("websocket", "tcp"):
        url = f"ws://{_url_host(config.host)}:{port}{REALTIME_PATH}"
        return UpstreamProbe(url, kind=kind, timeout=timeout)
    path = (urlsplit(config.health_url).path or "/health") if config.health_url else "/health"
    return HealthProbe(config.host, port, path=path, timeout=timeout)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class Supervisor:
    """Owns the engine child for the life of the sidecar.

    Args:
        config: the engine settings.
        on_state: called after every transition with (new state, cause, detail).
        notifier: sd_notify sender (STATUS / EXTEND_TIMEOUT_USEC while starting).
        backoff: restart delays.
        rng: jitter source (seeded in tests).
        clock: time and sleeping (a fake one in tests).
        spawn: makes the child of one run from (argv, env).
        probe_factory: makes the health probe of one run from (config, port).
        activity: when the engine's last frame reached a session (see the module
            docstring, "Busy is not dead"); None: never asked.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_state: StateCallback | None = None,
        notifier: Notifier | None = None,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        clock: Clock | None = None,
        spawn: SpawnFactory | None = None,
        probe_factory: ProbeFactory | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.config = config
        self._activity = activity
        self._on_state = on_state or (lambda state, cause, detail: None)
        self._notifier = notifier or Notifier({})
        self._backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._clock: Clock = clock or MonotonicClock()
        self._spawn: SpawnFactory = spawn or _spawn
        self._probe_factory: ProbeFactory = probe_factory or default_probe
        self._budget = RestartBudget(config.max_restarts, config.restart_window)
        self.machine = EngineStateMachine()
        self._stop = asyncio.Event()
        self._process: EngineChild | None = None
        self.target: str | None = None  # ws base URL while serving
        self.last_start_seconds: float | None = None
        self.restarts = 0

    @property
    def state(self) -> EngineState:
        return self.machine.state

    @property
    def serving(self) -> bool:
        """Sessions may be admitted: a serving state and a known target."""
        return self.machine.serving and self.target is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def request_stop(self) -> None:
        self._stop.set()

    def _move(self, observation: Observation, detail: str = "") -> EngineState:
        before = self.machine.state
        state = self.machine.apply(observation)
        if state is not before or observation in (Observation.READY,):
            log.info(
                "engine %s -> %s (%s) %s", before.value, state.value, observation.value, detail
            )
        if not self.machine.running:
            self.target = None
        self._on_state(state, observation, detail)
        return state

    # -- waiting --------------------------------------------------------------------------

    async def _race(
        self, work: Awaitable[_T], exited: asyncio.Future[int] | None = None
    ) -> _T | None:
        """``work``'s result, or None when a stop or the child's exit came first.

        ``work`` is cancelled when it loses, so a probe of a dead or stopped
        engine never delays what the exit or the stop has to say.
        """
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        waiters: list[asyncio.Future[object]] = [task, stop]  # type: ignore[list-item]
        if exited is not None:
            waiters.append(exited)  # type: ignore[arg-type]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._stop.is_set() or (exited is not None and exited.done()) or task.cancelled():
            return None
        return task.result()

    async def _pause(self, seconds: float, exited: asyncio.Future[int] | None = None) -> None:
        """Sleep on the injected clock unless a stop or the child's exit comes first."""
        if seconds > 0:
            await self._race(self._clock.sleep(seconds), exited)

    # -- external endpoint -------------------------------------------------------------------

    async def _run_external(self) -> None:
        """No child: serve while the endpoint answers its probe.

        Not served before the first good probe, nor after ``health_failures``
        consecutive failures until the next good one. The endpoint cannot be
        restarted, so a declared failure only flips readiness (state UNHEALTHY
        without a target).
        """
        upstream = self.config.upstream
        assert upstream is not None
        interval = self.config.health_interval
        probe = self._probe_factory(self.config, None)
        try:
            failures = 0
            first = True
            while not self._stop.is_set():
                started = self._clock.now()
                result = await self._race(probe())
                if result is None:
                    break
                if first:
                    if result.ok:
                        first = False
                        self.target = upstream
                        self._move(
                            Observation.READY,
                            f"attached to {upstream} (probe {result.stage}: {result.detail})",
                        )
                    else:
                        # Still STARTING; the detail reaches /readyz ("connect ...: refused").
                        self._move(Observation.HEALTH_FAILED, result.detail)
                else:
                    failures = self._observe_health(result, failures)
                await self._pause(started + interval - self._clock.now())
        finally:
            await probe.aclose()
        self._move(Observation.STOP)
        self._move(Observation.STOPPED)

    def _observe_health(self, result: HealthCheck, failures: int) -> int:
        """External endpoints cannot be restarted: they only flip readiness."""
        state = self.machine.state
        if result.ok:
            if state is not EngineState.READY or self.target is None:
                log.info("engine endpoint %s healthy again", self.config.upstream)
                self.target = self.config.upstream
                self.machine.state = EngineState.READY
                self._on_state(
                    EngineState.READY,
                    Observation.HEALTH_OK,
                    f"endpoint healthy again (probe {result.stage}: {result.detail})",
                )
            return 0
        failures += 1
        if failures >= self.config.health_failures and self.target is not None:
            log.warning(
                "engine endpoint %s failed %d health checks: %s",
                self.config.upstream,
                failures,
                result.detail,
            )
            self.machine.state = EngineState.UNHEALTHY
            self.target = None
            self._on_state(EngineState.UNHEALTHY, Observation.UNHEALTHY, result.detail)
        return failures

    # -- child engine -------------------------------------------------------------------------

    async def run(self) -> None:
        """Supervise until ``request_stop``.

        Raises:
            RestartBudgetExhausted: too many restarts in the window (state FAILED).
        """
        if self.config.kind == "external":
            await self._run_external()
            return
        try:
            while True:
                cause, detail = await self._one_run()
                if cause is Observation.STOP:
                    break
                await self._stop_process()  # sweep the old process group first
                now = self._clock.now()
                if not self._budget.allows(now):
                    self._move(
                        Observation.GIVE_UP,
                        f"{self.config.max_restarts} restarts "
                        f"within {self.config.restart_window:.0f} s",
                    )
                    raise RestartBudgetExhausted(
                        f"engine restarted {self.config.max_restarts} times within "
                        f"{self.config.restart_window:.0f} s; last failure: {detail}",
                        restarts=self.config.max_restarts,
                        window=self.config.restart_window,
                    )
                delay = self._backoff.delay(self._budget.recent(now), self._rng)
                self._budget.record(now)
                self.restarts += 1
                log.warning("restarting engine in %.1f s (%s)", delay, detail)
                self._notifier.status(f"engine restarting in {delay:.1f} s: {detail}")
                await self._pause(delay)
                if self._stop.is_set():
                    self._move(Observation.STOP)
                    break
                self._move(Observation.RESTART)
        finally:
            await self._stop_process()
            if self.machine.state is EngineState.STOPPING:
                self._move(Observation.STOPPED)

    async def _one_run(self) -> tuple[Observation, str]:
        """Start one child and follow it until it fails or a stop is requested."""
        config = self.config
        port = config.effective_port() or free_port(config.host)
        process = self._spawn(build_argv(config, port), config.env_dict())
        self._process = process
        probe = self._probe_factory(config, port)
        exited: asyncio.Future[int] | None = None
        try:
            try:
                await process.start()
                exited = asyncio.ensure_future(process.wait())
                ready = await self._wait_ready(probe, exited)
            except EngineStartError as exc:
                if self._stop.is_set():
                    self._move(Observation.STOP)
                    return Observation.STOP, "stop requested"
                # Decided before the stop below, which makes every child "exited".
                gone = exited is not None and exited.done() and not exited.cancelled()
                cause = Observation.EXITED if gone else Observation.START_FAILED
                await self._stop_process()
                self._move(cause, str(exc))
                return cause, str(exc)
            if ready is None:
                self._move(Observation.STOP)
                return Observation.STOP, "stop requested"
            elapsed, first = ready
            self.last_start_seconds = elapsed
            self.target = f"ws://{_url_host(config.host)}:{port}"
            self._move(
                Observation.READY,
                f"ready after {elapsed:.1f} s on port {port} (probe {first.stage}: {first.detail})",
            )
            self._notifier.status(f"engine ready after {elapsed:.1f} s")
            return await self._monitor(probe, exited)
        finally:
            if exited is not None and not exited.done():
                exited.cancel()
                await asyncio.gather(exited, return_exceptions=True)
            await probe.aclose()

    async def _wait_ready(
        self, probe: Probe, exited: asyncio.Future[int]
    ) -> tuple[float, HealthCheck] | None:
        """Seconds until ready and the good probe, or None when a stop came first.

        Raises:
            EngineStartError: the child exited, or ``startup_timeout`` passed first.
        """
        timeout = self.config.startup_timeout
        started = self._clock.now()
        next_progress = started + PROGRESS_INTERVAL
        while True:
            if exited.done():
                status = exited.result()
                raise EngineStartError(
                    f"engine exited with status {status} before it was ready", returncode=status
                )
            result = await self._race(probe(), exited)
            if self._stop.is_set():
                return None
            if result is None:
                continue  # exited: reported at the top
            now = self._clock.now()
            if result.ok:
                return now - started, result
            if now - started >= timeout:
                raise EngineStartError(
                    f"engine not ready after {timeout:.0f} s (last probe: {result.detail})"
                )
            if now >= next_progress:
                next_progress = now + PROGRESS_INTERVAL
                self._progress(now - started, result)
            await self._pause(STARTUP_PROBE_INTERVAL, exited)
            if self._stop.is_set():
                return None

    def _progress(self, elapsed: float, last: HealthCheck) -> None:
        log.info("engine starting: %.0f s elapsed, last probe: %s", elapsed, last.detail)
        usec = int((PROGRESS_INTERVAL * 2 + 5) * 1_000_000)
        self._notifier.notify(
            f"STATUS=engine starting ({elapsed:.0f} s): {last.detail}",
            f"EXTEND_TIMEOUT_USEC={usec}",
        )

    async def _monitor(self, probe: Probe, exited: asyncio.Future[int]) -> tuple[Observation, str]:
        """Probe every ``health_interval`` until the child exits, fails or a stop comes."""
        interval = self.config.health_interval
        failures = 0
        next_probe = self._clock.now() + interval
        while True:
            await self._pause(next_probe - self._clock.now(), exited)
            if self._stop.is_set():
                self._move(Observation.STOP)
                return Observation.STOP, "stop requested"
            if exited.done():
                return self._exited(exited)
            next_probe = self._clock.now() + interval
            result = await self._race(probe(), exited)
            if self._stop.is_set():
                self._move(Observation.STOP)
                return Observation.STOP, "stop requested"
            if result is None:
                return self._exited(exited)
            if result.ok:
                failures = 0
                if self.machine.state is EngineState.DEGRADED:
                    log.warning("engine health answers again: ready, admitting sessions")
                self._move(Observation.HEALTH_OK)
                continue
            failures += 1
            if failures >= self.config.health_failures:
                detail = f"{failures} failed health checks: {result.detail}"
                busy = self._busy_for()
                if busy is not None:
                    if self.machine.state is not EngineState.DEGRADED:
                        log.warning(
                            "engine health failing (%s) but its frames reached a session "
                            "%.1f s ago: degraded, not restarted; admitting no new sessions",
                            detail,
                            busy,
                        )
                    self._move(Observation.BUSY, f"{detail}; frames {busy:.1f} s ago")
                    continue
                self._move(Observation.UNHEALTHY, detail)
                return Observation.UNHEALTHY, detail
            self._move(Observation.HEALTH_FAILED, result.detail)

    def _busy_for(self) -> float | None:
        """Seconds since the engine's last frame reached a session, when that is within
        the failure window (``health_failures × health_interval``); None otherwise."""
        if self._activity is None:
            return None
        last = self._activity()
        if last is None:
            return None
        ago = max(0.0, self._clock.now() - last)
        window = self.config.health_failures * self.config.health_interval
        return ago if ago <= window else None

    def _exited(self, exited: asyncio.Future[int]) -> tuple[Observation, str]:
        detail = f"engine exited with status {exited.result()}"
        self._move(Observation.EXITED, detail)
        return Observation.EXITED, detail

    async def _stop_process(self) -> None:
        process = self._process
        if process is not None and process.pid is not None:
            status = await process.stop(self.config.stop_grace)
            log.info("engine stopped (status %s)", status)
        self._process = None
