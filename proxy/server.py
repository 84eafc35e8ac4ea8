"""``omni-sidecar serve``: listeners, engine supervision, signals and drain.

The :class:`Sidecar` binds both listeners, then starts the engine pool; it
validates everything a session needs before anything listens, turns each
signal into one event (SIGTERM/SIGINT: drain and stop; SIGHUP: reload) and
ends with the exit status that names the cause. The order of start-up and
shutdown: docs/design.md, Start-up and shutdown; reload: docs/design.md,
Reload; the exit statuses: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from importlib import metadata
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics

from engine_launcher.admission import EngineAdmission
from engine_launcher.exit_statuses import EXIT_ENGINE_FAILED, EXIT_LISTEN, EXIT_OK
from engine_launcher.launcher_errors import LauncherError
from engine_launcher.policy import EngineState, Observation
from engine_launcher.pool import EnginePool
from engine_launcher.supervisor import Supervisor
from engine_launcher.systemd import Notifier, watchdog_interval
from metrics import SidecarMetrics
from proxy import compat
from proxy.admin.admin_app import build_admin_app
from proxy.core.capabilities import EngineCapabilities
from proxy.core.resume_state import HandOver
from proxy.edge.client_app import build_client_app
from proxy.edge.guard import EdgeAppRunner
from proxy.edge.listener import EdgeSite
from proxy.edge.session_slots import Admission
from proxy.edge.socket_activation import PassedSockets
from proxy.edge.state import ProxyState, UpstreamTarget, max_per_engine
from proxy.errors import ConfigError
from proxy.logs import configure as configure_logging
from proxy.native import CORE_BUILD, PURE_BUILD_HINT, PURE_BUILD_WHY
from proxy.session.registry import SessionRegistry
from proxy.settings import (
    LIVE_KEYS,
    SETTING_KEYS,
    LoadedSettings,
    Settings,
    parse_listen,
    setting_value,
)
from proxy.startup import start_tracing, tune_gc, validate_runtime

__all__ = [
    "Sidecar",
    "serve",
]

log = logging.getLogger("omni_sidecar")


class _BindError(Exception):
    """A listener could not be bound; the message is the one line to print."""


_FAILING_CAUSES: Final = frozenset(
    {Observation.EXITED, Observation.UNHEALTHY, Observation.START_FAILED}
)


def _version() -> str:
    try:
        return metadata.version("omni-sidecar")
    except metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0+unknown"


def _url(host: str, port: int, scheme: str = "http") -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


class Sidecar:
    """The whole process: one instance per ``serve``.

    Args:
        settings: the loaded settings.
        environ: for NOTIFY_SOCKET / WATCHDOG_USEC.
        engine_version: the vllm-omni version preflight found (docs/design.md,
            Engine capabilities); ``engine.version`` other than auto wins.
        passed: listening sockets systemd passed (docs/design.md, Socket
            activation); a listener with one does not bind its address.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        environ: dict[str, str] | None = None,
        engine_version: str | None = None,
        passed: PassedSockets | None = None,
    ) -> None:
        self.settings = settings
        self.passed = passed
        self.environ = dict(os.environ if environ is None else environ)
        # *_created samples would become look-alike series (e.g. sessions_created).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.notifier = Notifier(self.environ)
        # One supervised engine per replica (docs/design.md, Engine pool); one by default.
        self.pool = EnginePool(
            settings.engine,
            on_state=self._engine_state,
            max_per_engine=max_per_engine(settings),
            on_drain=self._engine_draining,
            on_drain_timeout=self._close_drained,
            drain_timeout=settings.drain_timeout,
            notifier=self.notifier,
            environ=self.environ,
            # A replica whose health fails while its frames still reach sessions is
            # degraded, not restarted (docs/design.md, Engine supervision).
            activity=lambda index: self.sessions.last_engine_frame(index),
        )
        self.registry = CollectorRegistry()
        self.metrics = SidecarMetrics(
            self.registry, version=_version(), core_build=CORE_BUILD, replicas=len(self.pool)
        )
        # The engine-state and per-replica gauges are set from the admission state.
        self.router.publish_to(self.metrics)
        self.admission = Admission(
            settings.max_sessions,
            settings.admission_timeout,
            max_sessions_per_ip=settings.max_sessions_per_ip,
            max_resume_waits=settings.max_resume_waits,
            max_resume_waits_per_key=settings.max_resume_waits_per_key,
        )
        capabilities = EngineCapabilities.resolve(settings.engine.version, engine_version)
        self.sessions = SessionRegistry(
            self.metrics,
            max_total_pending_output_bytes=settings.max_total_pending_output_bytes,
            capabilities=capabilities,
        )
        #: OpenTelemetry tracing; None when off (docs/design.md, Tracing).
        self.tracing = start_tracing(settings, os.environ)
        self.state = ProxyState(
            settings=settings,
            metrics=self.metrics,
            admission=self.admission,
            registry=self.sessions,
            target=self._target,
            router=self.router,
            drain_engine=self.drain_engine,
            tracing=self.tracing,
        )
        self.stop_requested = asyncio.Event()
        self.force_stop = asyncio.Event()
        self.reload_requested = asyncio.Event()
        #: Loads the settings again (file and env, original flags) on SIGHUP.
        self.reloader: Callable[[], LoadedSettings] | None = None
        self.ready = asyncio.Event()
        self.bound: dict[str, tuple[str, int]] = {}
        self._runners: list[web.AppRunner] = []
        #: The client listener's site, when it serves on a socket systemd holds.
        self._held_site: EdgeSite | None = None
        self._announced = False
        self._restart_reason = "exited"

    # -- engine state → proxy ------------------------------------------------------------

    @property
    def router(self) -> EngineAdmission:
        """Whether and where each replica admits: the pool builds and owns it
        (``pool.admission``), the edge places sessions with it (``state.router``),
        /readyz and the console read it."""
        return self.pool.admission

    @property
    def supervisor(self) -> Supervisor:
        """The first replica's supervisor (the only one unless ``engine.replicas`` > 1)."""
        return self.pool.replicas[0].supervisor

    def _target(self) -> UpstreamTarget | None:
        """Where plain HTTP requests go: the first replica that admits."""
        target = self.router.first_serving_target()
        return None if target is None else UpstreamTarget.from_url(target)

    def _engine_state(
        self, index: int, state: EngineState, cause: Observation, detail: str
    ) -> None:
        """One replica's supervisor moved; the pool's admission state already took it in
        (placement, readiness, gauges). What is left is the sidecar's: announcing
        readiness, the restart counters, failing that replica's sessions."""
        supervisor = self.pool.replicas[index].supervisor
        label = str(index)
        if state is EngineState.READY and cause is Observation.READY:
            if supervisor.last_start_seconds is not None:
                self.metrics.engine_start_seconds.set(supervisor.last_start_seconds)
            self._announce()
        if state is EngineState.RESTARTING and cause in _FAILING_CAUSES:
            # Counted when the restart really happens (the supervisor may give up).
            self._restart_reason = _restart_reason(cause)
            self._fail_sessions(index, detail)
        if state is EngineState.STARTING and cause is Observation.RESTART:
            self.metrics.engine_restarts.labels(self._restart_reason).inc()
            self.metrics.engine_replica_restarts.labels(label).inc()

    def _fail_sessions(self, index: int, detail: str) -> None:
        """A replica failed: only its own sessions end (engine_unavailable, 1011)."""
        relays = self.sessions.relays_on(index)
        if relays:
            name = "engine" if self.router.count == 1 else f"engine {index}"
            log.warning("%s unavailable (%s): failing %d live sessions", name, detail, len(relays))
        for relay in relays:
            relay.engine_unavailable()

    def _engine_draining(self, index: int, draining: bool) -> None:
        """A drain began or ended (the admission state has it); its end is a restart."""
        if not draining:
            self.metrics.engine_replica_restarts.labels(str(index)).inc()

    def _close_drained(self, index: int) -> None:
        """A drained replica's sessions outlived ``drain_timeout``: close them (1001)."""
        for relay in self.sessions.relays_on(index):
            relay.shutdown()

    def drain_engine(self, index: int) -> bool:
        """``omni-sidecar drain --engine K``: stop admitting to K, let it empty, restart it.

        Returns False when K is already draining or failed for good.

        Raises:
            IndexError: no replica K.
        """
        if not 0 <= index < len(self.pool):
            raise IndexError(index)
        return self.pool.request_drain(index)

    def _announce(self) -> None:
        self.ready.set()
        if self._announced:
            return
        self._announced = True
        if self._held_site is not None:
            # Connections made while this process started waited in systemd's
            # socket for an engine that serves them (docs/design.md, Socket activation).
            self._held_site.start_accepting()
        listen = self.bound.get("listen")
        admin = self.bound.get("admin")
        engine = ", ".join(t for t in self.router.targets if t is not None) or "?"
        kind = self.settings.engine.kind
        if listen is not None:
            behaviour = self.sessions.capabilities.current
            log.info(
                "omni-sidecar ready: clients %s/v1/realtime%s, admin %s/metrics, engine %s at %s "
                "(core: %s; engine behaviour: vLLM-Omni %s from %s)",
                _url(*listen, scheme="ws"),
                " (socket from systemd)" if self._held_site is not None else "",
                _url(*admin) if admin else "-",
                kind,
                engine,
                CORE_BUILD,
                behaviour.version.value,
                behaviour.source.value,
            )
        if CORE_BUILD == "python":
            log.warning(
                "omni-sidecar runs the pure-Python build (%s): more CPU per relayed event; %s",
                PURE_BUILD_WHY,
                PURE_BUILD_HINT,
            )
        self.notifier.notify("READY=1", f"STATUS=serving; engine {kind} ready")

    # -- lifecycle ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self.reload_requested.set)

    def _on_signal(self, signum: int) -> None:
        if self.stop_requested.is_set():
            self.force_stop.set()
        self.stop_requested.set()

    async def _bind(self) -> None:
        # Said only once both are bound, so a bind failure is the one line on stderr.
        bound_lines: list[str] = []
        for name, address, app in (
            ("listen", self.settings.listen, build_client_app(self.state)),
            ("admin", self.settings.admin_listen, build_admin_app(self.state)),
        ):
            host, port = parse_listen(address)
            runner_kwargs: dict[str, Any] = {
                "access_log": None,
                "handle_signals": False,
                "shutdown_timeout": 1.0,
            }
            runner = (
                # The client listener's edge: head size, head deadline, pending cap (edge.py).
                EdgeAppRunner(app, guard=self.state.edge, **runner_kwargs)
                if name == "listen"
                else web.AppRunner(app, **runner_kwargs)
            )
            await runner.setup()
            self._runners.append(runner)
            held = self.passed.sockets.get(name, ()) if self.passed is not None else ()
            if held:  # systemd's socket: the address setting is not bound
                host, port = held[0].getsockname()[:2]
            try:
                sockets = await self._start_sites(name, runner, host, port, held)
            except OSError as exc:  # in use, not permitted, not available
                key = "listen" if name == "listen" else "admin_listen"
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise _BindError(f"cannot listen on {address} ({key}): {reason}") from None
            bound_port = sockets[0].getsockname()[1] if sockets else port
            self.bound[name] = (host, int(bound_port))
            url = _url(host, int(bound_port))
            if self.passed is not None and held:
                self.state.listeners[name] = {"url": url, "source": "systemd"}
                bound_lines.append(f"{name} listener on {url}: {self.passed.describe(name)}")
            else:
                self.state.listeners[name] = {"url": url, "source": "bound"}
                bound_lines.append(f"{name} listener bound on {url}")
        for line in bound_lines:
            log.info("%s", line)

    async def _start_sites(
        self,
        name: str,
        runner: web.AppRunner,
        host: str,
        port: int,
        held: tuple[socket.socket, ...],
    ) -> list[socket.socket]:
        """Start the listener's site(s); its listening sockets.

        The client listener accepts by itself, so running out of file descriptors
        is counted and logged (proxy/edge/listener.py); on a socket systemd holds
        it accepts from the engine's first READY on (docs/design.md, Socket activation).
        """
        if name == "listen":
            edge = EdgeSite(
                runner,
                host,
                port,
                refused=self.state.refused_at_accept,
                passed=held,
                accepting=not held,
            )
            await edge.start()
            if held:
                self._held_site = edge
            return edge.sockets
        if not held:
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
            return list(compat.bound_sockets(site))
        for sock in held:
            await web.SockSite(runner, sock).start()
        return list(held)

    async def run(self) -> int:
        """Serve until stopped. Returns the process exit status."""
        try:
            await self._bind()
        except _BindError as err:
            print(f"omni-sidecar: {err}", file=sys.stderr)
            for runner in reversed(self._runners):
                with contextlib.suppress(Exception):
                    await runner.cleanup()
            self._runners.clear()
            return EXIT_LISTEN
        exit_code = EXIT_OK
        supervisor_task = asyncio.ensure_future(self.pool.run())
        watchdog = asyncio.ensure_future(self._watchdog())
        quota_checks = asyncio.ensure_future(
            self.state.quota.run(self.settings.quota_check_interval)
        )
        stop_wait = asyncio.ensure_future(self.stop_requested.wait())
        reload_wait: asyncio.Future[Any] | None = None
        try:
            while True:
                reload_wait = asyncio.ensure_future(self.reload_requested.wait())
                waits: tuple[asyncio.Future[Any], ...] = (
                    supervisor_task,
                    stop_wait,
                    reload_wait,
                )
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if supervisor_task.done() or stop_wait.done():
                    break
                self.reload_requested.clear()
                self.reload()
            if supervisor_task.done() and not self.stop_requested.is_set():
                exc = supervisor_task.exception()
                if isinstance(exc, LauncherError):
                    log.error("engine failed: %s", exc)
                elif exc is not None:
                    log.error("engine supervisor crashed", exc_info=exc)
                exit_code = EXIT_ENGINE_FAILED
        finally:
            stop_wait.cancel()
            if reload_wait is not None:
                reload_wait.cancel()
            if self._held_site is not None:
                # New connections wait in systemd's socket for the next process.
                self._held_site.stop_accepting()
            await self._shutdown(supervisor_task)
            watchdog.cancel()
            quota_checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            with contextlib.suppress(asyncio.CancelledError):
                await quota_checks
            with contextlib.suppress(Exception):
                await self.state.quota.close()
            with contextlib.suppress(Exception):
                await self.state.resume_spent.close()
        return exit_code

    def reload(self) -> bool:
        """Load the settings again and apply the live part; True when applied.

        Runs in the main task (SIGHUP only sets :attr:`reload_requested`).
        Logs exactly one line: what changed and what needs a restart, or why
        the new config was rejected (the old one stays).
        """
        if self.reloader is None:
            log.warning("config reload: not available (settings were not loaded from the CLI)")
            return False
        old = self.settings
        try:
            loaded = self.reloader()
            validate_runtime(loaded)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("rejected").inc()
            log.error("config reload rejected, keeping the running config: %s", exc)
            return False
        new = loaded.settings
        changed = [k for k in SETTING_KEYS if setting_value(old, k) != setting_value(new, k)]
        applied = [k for k in changed if k in LIVE_KEYS]
        ignored = [k for k in changed if k not in LIVE_KEYS]
        # Keep every setting that cannot change live; take the live ones.
        fixed = {k: getattr(old, k) for k in SETTING_KEYS if "." not in k and k not in LIVE_KEYS}
        merged = dataclasses.replace(new, **fixed, engine=old.engine)
        self.settings = merged
        self.state.apply_settings(merged)
        configure_logging(merged.log_level, merged.log_format)
        self.metrics.config_reloads.labels("applied").inc()
        log.info(
            "config reloaded: applied %s; needs a restart, left as it was: %s",
            ", ".join(applied) or "no changes",
            ", ".join(ignored) or "nothing",
        )
        return True

    async def _shutdown(self, supervisor_task: asyncio.Future[None]) -> None:
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        self.admission.draining = True
        # A resume would be refused from now on: no session is held for one here.
        self.sessions.draining = True
        started = time.monotonic()
        live = self._hand_over()
        await self._drain()
        if live:
            counts = self.sessions.drain_outcomes
            log.info(
                "drained in %.1f s: %d handed over, %d ended by themselves, %d to cut",
                time.monotonic() - started,
                counts["handed_over"],
                counts["drained"],
                len(self.sessions.relays),
            )
        self.sessions.closing_all = True
        for relay in list(self.sessions.relays.values()):
            relay.shutdown()
        with contextlib.suppress(TimeoutError):
            # Handshakes still in flight register, see closing_all and close too.
            async with asyncio.timeout(
                self.settings.close_timeout + self.settings.handshake_timeout + 1.0
            ):
                await self.sessions.wait_empty()
                await self.admission.wait_idle()
        for runner in reversed(self._runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        self._runners.clear()
        # Every session has ended: the usage file's writer flushes and stops.
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.state.usage.close, self.settings.close_timeout)
        self.pool.request_stop()
        with contextlib.suppress(Exception):
            await supervisor_task
        log.info("stopped")

    def _hand_over(self) -> int:
        """Hand every session that can be over to the fleet; say in one line what waits and
        why (docs/design.md, Start-up and shutdown). Returns how many sessions were live."""
        relays = list(self.sessions.relays.values())
        waits: Counter[HandOver] = Counter()
        # An engine this sidecar launched stops with it, and without a secret the fleet
        # shares no other sidecar can take the client's token: nothing can move.
        if self.settings.engine.kind != "external":
            stays: HandOver | None = HandOver.ENGINE_STOPS
        elif self.settings.resume_secret_file is None:
            stays = HandOver.NO_SHARED_SECRET
        else:
            stays = None
        self.sessions.handing_over = stays is None
        for relay in relays:
            wait = relay.hand_over() if stays is None else stays
            waits[wait] += 1
            if relay.view.held and wait is not HandOver.NOW:
                relay.shutdown()  # held, and it cannot move: it ends now
        staying = len(relays) - waits[HandOver.NOW]
        why = ", ".join(f"{n} {w.value}" for w, n in waits.items() if w is not HandOver.NOW)
        log.info(
            "shutting down: draining %d sessions: %d handed over, %s",
            len(relays),
            waits[HandOver.NOW],
            f"waiting up to {self.settings.drain_timeout:g} s for {staying} ({why})"
            if staying
            else "none to wait for",
        )
        return len(relays)

    async def _drain(self) -> None:
        if not self.sessions.relays or self.force_stop.is_set():
            return
        empty = asyncio.ensure_future(self.sessions.wait_empty())
        forced = asyncio.ensure_future(self.force_stop.wait())
        try:
            await asyncio.wait(
                (empty, forced),
                timeout=self.settings.drain_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            empty.cancel()
            forced.cancel()

    async def _watchdog(self) -> None:
        interval = watchdog_interval(self.environ)
        if interval is None:
            return
        while True:
            self.notifier.notify("WATCHDOG=1")
            await asyncio.sleep(interval)


def _restart_reason(cause: Observation) -> str:
    if cause is Observation.UNHEALTHY:
        return "unhealthy"
    if cause is Observation.START_FAILED:
        return "start_failed"
    return "exited"


async def serve(
    settings: Settings,
    *,
    reload: Callable[[], LoadedSettings] | None = None,
    engine_version: str | None = None,
    passed: PassedSockets | None = None,
) -> int:
    """Run the sidecar with signal handling; the CLI's entry point.

    Args:
        settings: The validated settings.
        reload: Loads them again for SIGHUP (the CLI's original file, env and
            flags); without it SIGHUP only logs that reload is unavailable.
        engine_version: the vllm-omni version preflight found in the engine's
            interpreter (None: not found or not looked for).
        passed: the listening sockets systemd passed (None: bind both addresses).
    """
    sidecar = Sidecar(settings, engine_version=engine_version, passed=passed)
    sidecar.reloader = reload
    sidecar.install_signal_handlers()
    tune_gc()
    try:
        return await sidecar.run()
    finally:
        if sidecar.tracing is not None:
            # Export what is queued, for at most EXPORT_AT_EXIT_SECONDS (session/tracing.py).
            sidecar.tracing.shutdown()
