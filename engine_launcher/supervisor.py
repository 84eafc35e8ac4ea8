"""The supervisor shell: runs the engine child through the pure state machine.

It starts the child, waits for readiness (logging progress every 15 s and
telling systemd with ``STATUS=`` and ``EXTEND_TIMEOUT_USEC=``), polls health
while ready, and on exit or repeated failed polls restarts it with
exponential backoff. More than ``max_restarts`` within ``restart_window``
ends in FAILED: ``run`` raises ``RestartBudgetExhausted`` and the process
exits non-zero so that systemd restarts the unit.

The proxy learns about every state change through ``on_state``; it never
imports this package's internals beyond that callback and ``target``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from engine_launcher.config import EngineConfig
from engine_launcher.errors import EngineStartError, RestartBudgetExhausted
from engine_launcher.policy import (
    Backoff,
    EngineState,
    EngineStateMachine,
    Observation,
    RestartBudget,
)
from engine_launcher.process import EngineProcess, HealthProbe, ProbeResult, build_argv, free_port
from engine_launcher.systemd import Notifier

__all__ = ["StateCallback", "Supervisor"]

log = logging.getLogger("engine_launcher")

StateCallback = Callable[[EngineState, Observation, str], None]

PROGRESS_INTERVAL: Final = 15.0
#: How often readiness is probed while the engine starts.
STARTUP_PROBE_INTERVAL: Final = 0.25


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
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_state: StateCallback | None = None,
        notifier: Notifier | None = None,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self._on_state = on_state or (lambda state, cause, detail: None)
        self._notifier = notifier or Notifier({})
        self._backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._budget = RestartBudget(config.max_restarts, config.restart_window)
        self.machine = EngineStateMachine()
        self._stop = asyncio.Event()
        self._process: EngineProcess | None = None
        self.target: str | None = None  # ws base URL while serving
        self.last_start_seconds: float | None = None
        self.restarts = 0

    @property
    def state(self) -> EngineState:
        return self.machine.state

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
        if not self.machine.serving:
            self.target = None
        self._on_state(state, observation, detail)
        return state

    # -- external endpoint -------------------------------------------------------------

    async def _run_external(self) -> None:
        """No child: serve while the endpoint's health (if configured) is good."""
        upstream = self.config.upstream
        assert upstream is not None
        parts = urlsplit(upstream)
        self.target = upstream
        if self.config.health_url is None:
            self._move(Observation.READY, f"attached to {upstream}")
            await self._stop.wait()
        else:
            health = urlsplit(self.config.health_url)
            probe = HealthProbe(
                health.hostname or parts.hostname or "127.0.0.1",
                health.port or parts.port or 80,
                path=health.path or "/health",
            )
            try:
                result = await probe()
                while not result.ok and not self._stop.is_set():
                    await self._sleep(self.config.health_interval)
                    result = await probe()
                if not self._stop.is_set():
                    self.target = upstream
                    self._move(Observation.READY, f"attached to {upstream}")
                failures = 0
                while not self._stop.is_set():
                    await self._sleep(self.config.health_interval)
                    if self._stop.is_set():
                        break
                    result = await probe()
                    self.target = upstream
                    failures = self._observe_health(result, failures)
            finally:
                await probe.aclose()
        self._move(Observation.STOP)
        self._move(Observation.STOPPED)

    def _observe_health(self, result: ProbeResult, failures: int) -> int:
        """External endpoints cannot be restarted: they only flip readiness."""
        state = self.machine.state
        if result.ok:
            if state is not EngineState.READY:
                self.target = self.config.upstream
                self.machine.state = EngineState.READY
                self._on_state(EngineState.READY, Observation.HEALTH_OK, "endpoint healthy again")
            return 0
        failures += 1
        if failures >= self.config.health_failures and state is not EngineState.UNHEALTHY:
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
                if not self._budget.allows(time.monotonic()):
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
                now = time.monotonic()
                delay = self._backoff.delay(self._budget.recent(now), self._rng)
                self._budget.record(now)
                self.restarts += 1
                log.warning("restarting engine in %.1f s (%s)", delay, detail)
                self._notifier.status(f"engine restarting in {delay:.1f} s: {detail}")
                if await self._sleep(delay):
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
        process = EngineProcess(build_argv(config, port), env=config.env_dict())
        self._process = process
        probe = HealthProbe(config.host, port, path=self._health_path())
        try:
            try:
                await process.start()
                elapsed = await self._wait_ready(process, probe)
            except EngineStartError as exc:
                if self._stop.is_set():
                    self._move(Observation.STOP)
                    return Observation.STOP, "stop requested"
                await self._stop_process()
                cause = (
                    Observation.EXITED
                    if process.returncode is not None
                    else Observation.START_FAILED
                )
                self._move(cause, str(exc))
                return cause, str(exc)
            if elapsed is None:
                self._move(Observation.STOP)
                return Observation.STOP, "stop requested"
            self.last_start_seconds = elapsed
            self.target = f"ws://{_url_host(config.host)}:{port}"
            self._move(Observation.READY, f"ready after {elapsed:.1f} s on port {port}")
            self._notifier.status(f"engine ready after {elapsed:.1f} s")
            return await self._monitor(process, probe)
        finally:
            await probe.aclose()

    def _health_path(self) -> str:
        if self.config.health_url:
            return urlsplit(self.config.health_url).path or "/health"
        return "/health"

    async def _wait_ready(self, process: EngineProcess, probe: HealthProbe) -> float | None:
        """Seconds until ready, or None when a stop came first."""
        timeout = self.config.startup_timeout

        def progress(elapsed: float, last: ProbeResult | None) -> None:
            detail = last.detail if last is not None else "no probe yet"
            log.info("engine starting: %.0f s elapsed, last probe: %s", elapsed, detail)
            usec = int((PROGRESS_INTERVAL * 2 + 5) * 1_000_000)
            self._notifier.notify(
                f"STATUS=engine starting ({elapsed:.0f} s): {detail}",
                f"EXTEND_TIMEOUT_USEC={usec}",
            )

        ready = asyncio.ensure_future(
            process.wait_ready(
                probe,
                timeout=timeout,
                interval=STARTUP_PROBE_INTERVAL,
                progress_interval=PROGRESS_INTERVAL,
                on_progress=progress,
            )
        )
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((ready, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not ready.done():
                ready.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ready
        # Not a `return` inside `finally`: that would swallow our own cancellation.
        if ready.cancelled():
            return None
        return ready.result()

    async def _monitor(self, process: EngineProcess, probe: HealthProbe) -> tuple[Observation, str]:
        failures = 0
        exit_task = asyncio.ensure_future(process.wait())
        try:
            while True:
                if await self._sleep(self.config.health_interval, also=exit_task):
                    self._move(Observation.STOP)
                    return Observation.STOP, "stop requested"
                if exit_task.done():
                    detail = f"engine exited with status {exit_task.result()}"
                    self._move(Observation.EXITED, detail)
                    return Observation.EXITED, detail
                result = await probe()
                if result.ok:
                    failures = 0
                    self._move(Observation.HEALTH_OK)
                    continue
                failures += 1
                if failures >= self.config.health_failures:
                    detail = f"{failures} failed health checks: {result.detail}"
                    self._move(Observation.UNHEALTHY, detail)
                    return Observation.UNHEALTHY, detail
                self._move(Observation.HEALTH_FAILED, result.detail)
        finally:
            exit_task.cancel()

    async def _sleep(self, seconds: float, *, also: asyncio.Future[int] | None = None) -> bool:
        """Sleep unless a stop (True) or ``also`` completes first."""
        stop = asyncio.ensure_future(self._stop.wait())
        waiters: list[asyncio.Future[object]] = [stop]  # type: ignore[list-item]
        if also is not None:
            waiters.append(also)  # type: ignore[arg-type]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        return self._stop.is_set()

    async def _stop_process(self) -> None:
        process = self._process
        if process is not None and process.pid is not None:
            status = await process.stop(self.config.stop_grace)
            log.info("engine stopped (status %s)", status)
        self._process = None
