"""``omni-sidecar serve``: listeners, engine supervision, signals and drain.

Start-up: bind both listeners first (``/healthz`` answers at once, ``/readyz``
says 503 until the engine is ready), then start the engine; ``READY=1`` goes
to systemd once the listener is bound and the engine answered its health
check.

Shutdown (SIGTERM or SIGINT; handlers only set an event): readiness 503 and
``STOPPING=1``; no new sessions; live sessions may finish for up to
``drain_timeout``; the rest get ``session.closed`` {reason shutdown} and close
1001; listeners close; the engine gets SIGTERM on its process group and
SIGKILL after ``stop_grace``. A second SIGINT or SIGTERM skips the drain.
Exit status: 0 after a requested stop, 1 when the engine failed for good
(restart budget exhausted or it never became ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from importlib import metadata
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics

from engine_launcher.errors import LauncherError
from engine_launcher.policy import EngineState, Observation
from engine_launcher.supervisor import Supervisor
from engine_launcher.systemd import Notifier, watchdog_interval
from metrics import SidecarMetrics
from proxy.admin import build_admin_app
from proxy.app import Admission, ProxyState, UpstreamTarget, build_client_app
from proxy.config import Settings, parse_listen
from proxy.console import EngineView
from proxy.observer import SessionRegistry

__all__ = ["Sidecar", "serve"]

log = logging.getLogger("omni_sidecar")

EXIT_OK: Final = 0
EXIT_ENGINE_FAILED: Final = 1

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
    """

    def __init__(self, settings: Settings, *, environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)
        # *_created samples would become look-alike series (e.g. sessions_created).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.metrics = SidecarMetrics(self.registry, version=_version())
        self.admission = Admission(
            settings.max_sessions,
            settings.admission_timeout,
            max_sessions_per_ip=settings.max_sessions_per_ip,
        )
        self.sessions = SessionRegistry(
            self.metrics, max_total_pending_output_bytes=settings.max_total_pending_output_bytes
        )
        self.notifier = Notifier(self.environ)
        self.supervisor = Supervisor(
            settings.engine, on_state=self._engine_state, notifier=self.notifier
        )
        self.engine_view = EngineView(
            settings.engine.kind,
            restarts=lambda: self.supervisor.restarts,
            target=lambda: self.supervisor.target,
        )
        self.state = ProxyState(
            settings=settings,
            metrics=self.metrics,
            admission=self.admission,
            registry=self.sessions,
            target=self._target,
            engines=self.engine_view.snapshot,
        )
        self.stop_requested = asyncio.Event()
        self.force_stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.bound: dict[str, tuple[str, int]] = {}
        self._runners: list[web.AppRunner] = []
        self._announced = False
        self._restart_reason = "exited"
        self.metrics.set_engine_state("starting")

    # -- engine state → proxy ------------------------------------------------------------

    def _target(self) -> UpstreamTarget | None:
        target = self.supervisor.target
        return None if target is None else UpstreamTarget.from_url(target)

    def _engine_state(self, state: EngineState, cause: Observation, detail: str) -> None:
        self.metrics.set_engine_state(state.value)
        self.engine_view.observe(state.value, cause.value, detail)
        serving = self.supervisor.serving
        if serving and not self.admission.draining:
            self.admission.set_ready(True)
        else:
            self.admission.set_ready(
                False, f"engine is {state.value}" + (f": {detail}" if detail else "")
            )
        if state is EngineState.READY and cause is Observation.READY:
            if self.supervisor.last_start_seconds is not None:
                self.metrics.engine_start_seconds.set(self.supervisor.last_start_seconds)
            self._announce()
        if state is EngineState.RESTARTING and cause in _FAILING_CAUSES:
            # Counted when the restart really happens (the supervisor may give up).
            self._restart_reason = _restart_reason(cause)
            self._fail_sessions(detail)
        if state is EngineState.STARTING and cause is Observation.RESTART:
            self.metrics.engine_restarts.labels(self._restart_reason).inc()

    def _fail_sessions(self, detail: str) -> None:
        relays = list(self.sessions.relays.values())
        if relays:
            log.warning("engine unavailable (%s): failing %d live sessions", detail, len(relays))
        for relay in relays:
            relay.engine_unavailable()

    def _announce(self) -> None:
        self.ready.set()
        if self._announced:
            return
        self._announced = True
        listen = self.bound.get("listen")
        admin = self.bound.get("admin")
        engine = self.supervisor.target or "?"
        kind = self.settings.engine.kind
        if listen is not None:
            log.info(
                "omni-sidecar ready: clients %s/v1/realtime, admin %s/metrics, engine %s at %s",
                _url(*listen, scheme="ws"),
                _url(*admin) if admin else "-",
                kind,
                engine,
            )
        self.notifier.notify("READY=1", f"STATUS=serving; engine {kind} ready")

    # -- lifecycle ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        if self.stop_requested.is_set():
            self.force_stop.set()
        self.stop_requested.set()

    async def _bind(self) -> None:
        for name, address, app in (
            ("listen", self.settings.listen, build_client_app(self.state)),
            ("admin", self.settings.admin_listen, build_admin_app(self.state)),
        ):
            host, port = parse_listen(address)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
            self._runners.append(runner)
            server = site._server
            sockets = list(getattr(server, "sockets", None) or [])
            bound_port = sockets[0].getsockname()[1] if sockets else port
            self.bound[name] = (host, int(bound_port))
            log.info("%s listener bound on %s", name, _url(host, int(bound_port)))

    async def run(self) -> int:
        """Serve until stopped. Returns the process exit status."""
        await self._bind()
        exit_code = EXIT_OK
        supervisor_task = asyncio.ensure_future(self.supervisor.run())
        watchdog = asyncio.ensure_future(self._watchdog())
        stop_wait = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait((supervisor_task, stop_wait), return_when=asyncio.FIRST_COMPLETED)
            if supervisor_task.done() and not self.stop_requested.is_set():
                exc = supervisor_task.exception()
                if isinstance(exc, LauncherError):
                    log.error("engine failed: %s", exc)
                elif exc is not None:
                    log.error("engine supervisor crashed", exc_info=exc)
                exit_code = EXIT_ENGINE_FAILED
        finally:
            stop_wait.cancel()
            await self._shutdown(supervisor_task)
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        return exit_code

    async def _shutdown(self, supervisor_task: asyncio.Future[None]) -> None:
        log.info("shutting down: draining %d sessions", len(self.sessions.relays))
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        self.admission.draining = True
        self.admission.set_ready(False, "draining")
        await self._drain()
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
        self.supervisor.request_stop()
        with contextlib.suppress(Exception):
            await supervisor_task
        log.info("stopped")

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


async def serve(settings: Settings) -> int:
    """Run the sidecar with signal handling; the CLI's entry point."""
    sidecar = Sidecar(settings)
    sidecar.install_signal_handlers()
    return await sidecar.run()
