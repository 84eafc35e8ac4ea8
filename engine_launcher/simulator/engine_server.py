"""aiohttp application and process lifecycle of the engine simulator.

Routes: WebSocket ``/v1/realtime`` and ``/v1/duplex`` (one handler), ``GET /health``,
``/v1/models``, ``/metrics`` and the simulator's own ``/debug/history``
(docs/engine-protocol.md, Routes). The process's steps from start to exit,
signals and shutdown included: docs/design.md, Simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web

from engine_launcher.simulator.audio import AudioBank, load_wav, make_audio_bank
from engine_launcher.simulator.connection import SocketRunner
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.handlers import HANDLERS
from engine_launcher.simulator.session_host import SessionHost, SimulatorState
from engine_launcher.simulator.session_update import truthy
from engine_launcher.simulator.wire import dumps, flat_error, is_false_flag

__all__ = [
    "SHUTDOWN_DRAIN_TIMEOUT",
    "STATE_KEY",
    "build_app",
    "build_audio_bank",
    "render_metrics",
    "run",
    "serve",
]

logger = logging.getLogger(__name__)

STATE_KEY: Final = web.AppKey("omni_simulator_state", SimulatorState)

# How long live sessions get to flush session.closed on shutdown.
SHUTDOWN_DRAIN_TIMEOUT: Final = 5.0
# aiohttp's own frame limit: above it aiohttp closes with 1009 by itself. The
# engine's 15 MiB limit (error event_too_large, socket kept) is checked in the
# session shell, so this one only guards the process against absurd frames.
TRANSPORT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
_JSON: Final = "application/json"


# ------------------------------------------------------------------ HTTP


def _json(payload: dict[str, object], status: int = 200) -> web.Response:
    return web.Response(text=dumps(payload), status=status, content_type=_JSON)


def _past(state: SimulatorState, after: float | None) -> bool:
    """``after`` seconds have passed since the simulator listens (None: never)."""
    if after is None or state.listening_since is None:
        return False
    return asyncio.get_running_loop().time() - state.listening_since >= after


#: How long a hung ``GET /health`` waits (seconds): longer than any probe's patience;
#: the server's shutdown cancels it.
HEALTH_HANG_SECONDS: Final = 3600.0


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 healthy; 503 once ``--health-fail-after`` passed; no answer
    at all once ``--health-hang-after`` passed."""
    state = request.app[STATE_KEY]
    if _past(state, state.config.health_hang_after):
        await asyncio.sleep(HEALTH_HANG_SECONDS)
    if _past(state, state.config.health_fail_after):
        return _json({"status": "unhealthy"}, status=503)
    return _json({"status": "healthy"})


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: OpenAI model list with the one served model."""
    state = request.app[STATE_KEY]
    model = state.config.model
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "vllm-omni",
                    "root": model,
                    "parent": None,
                    "permission": [],
                }
            ],
        }
    )


def render_metrics(state: SimulatorState) -> str:
    """Prometheus text exposition of the simulator's counters, written by hand.

    A private format on purpose: no ``prometheus_client`` global registry, so
    importing the simulator into a test process never pollutes it.
    """
    s = state.stats
    families: list[tuple[str, str, str, list[tuple[str, int | float]]]] = [
        ("sessions_active", "gauge", "Open WebSocket sessions.", [("", s.sessions_active)]),
        (
            "sessions_detached",
            "gauge",
            "Sessions whose socket dropped, within their disconnect grace.",
            [("", state.detached)],
        ),
        ("resumes_total", "counter", "Sessions resumed by a new socket.", [("", s.resumes)]),
        (
            "sessions_expired_total",
            "counter",
            "Detached sessions whose disconnect grace ran out.",
            [("", s.sessions_expired)],
        ),
        (
            "journal_overflows_total",
            "counter",
            "Sessions whose replay journal overflowed (journal_overflow).",
            [("", s.journal_overflows)],
        ),
        ("sessions_total", "counter", "WebSocket sessions accepted.", [("", s.sessions_total)]),
        (
            "sessions_opened_total",
            "counter",
            "Duplex sessions opened (session.created sent), however opened.",
            [("", s.sessions_opened)],
        ),
        ("events_sent_total", "counter", "Server events written.", [("", s.events_sent)]),
        ("sent_bytes_total", "counter", "Bytes of server events written.", [("", s.bytes_sent)]),
        (
            "responses_total",
            "counter",
            "Responses ended, by status.",
            [
                ('{status="completed"}', s.responses_completed),
                ('{status="cancelled"}', s.responses_cancelled),
            ],
        ),
        (
            "late_audio_events_total",
            "counter",
            "Audio deltas sent after their response was cancelled.",
            [("", s.late_audio_events)],
        ),
        (
            "removed_audio_events_total",
            "counter",
            "Queued audio deltas removed by a cancel or clear (0.31+).",
            [("", s.removed_audio_events)],
        ),
        (
            "output_overflows_total",
            "counter",
            "Sessions closed for output_backpressure (0.31+).",
            [("", s.output_overflows)],
        ),
        (
            "capacity_rejections_total",
            "counter",
            "Session opens refused with resource_exhausted (--max-sessions).",
            [("", s.capacity_rejections)],
        ),
        ("errors_total", "counter", "Error events sent.", [("", s.errors_sent)]),
        (
            "outbox_events",
            "gauge",
            "Events queued in the sessions' output queues.",
            [("", s.outbox_events)],
        ),
        (
            "outbox_bytes",
            "gauge",
            "Bytes queued in the sessions' output queues.",
            [("", s.outbox_bytes)],
        ),
        (
            "stalled",
            "gauge",
            "Whether --stall-after has fired (0 or 1).",
            [("", int(state.stalled.is_set()))],
        ),
    ]
    lines: list[str] = []
    for suffix, kind, help_text, samples in families:
        name = "vllm_omni_sim_" + suffix
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)
    return "\n".join(lines) + "\n"


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: see :func:`render_metrics`."""
    body = render_metrics(request.app[STATE_KEY]).encode()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def handle_debug_history(request: web.Request) -> web.Response:
    """``GET /debug/history``: each open session's conversation history, as the model sees it.

    ``{"sessions": {session_id: {"playback_commit_policy", "epoch", "items",
    "pending"}}}``. ``items`` is the history in order: users with their
    placeholder transcript, assistant replies with the text history holds
    (after acks, truncation, cancels), ``audio_ms`` (the audio position that
    text ends at), ``full_text`` (everything generated) and the ledger
    ``playback``. ``pending`` lists replies not (or no longer) in history, e.g.
    ``ack_only`` replies awaiting their ack. For tests and the bench to compare
    what the model believes it said with what the user heard; it is not part
    of the engine's API, and a session that has not opened yet is left out
    (a detached one is in).
    """
    state = request.app[STATE_KEY]
    sessions = {sid: host.session.history_view() for sid, host in list(state.by_id.items())}
    return _json({"sessions": sessions})


# ------------------------------------------------------------- WebSocket


async def handle_realtime(request: web.Request) -> web.StreamResponse:
    """WebSocket ``/v1/realtime`` and ``/v1/duplex``: one duplex session per socket."""
    state = request.app[STATE_KEY]
    query = dict(request.query.items())  # a repeated name: its last value, as vLLM-Omni reads it
    if state.config.session_mode == "realtime":
        return await _plain_realtime(request, state)
    if request.path == "/v1/realtime" and is_false_flag(query.get("duplex")):
        # docs/engine-protocol.md, Routes: a duplex server does not mount the turn-based handler.
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(flat_error("Realtime API is not available", "unsupported"))
        await ws.close()
        return ws
    ws = web.WebSocketResponse(max_msg_size=TRANSPORT_MAX_MESSAGE_BYTES, autoping=True)
    await ws.prepare(request)
    model = query.get("model") or None
    session = DuplexSession(
        state.config, state.bank, state.stats, handlers=HANDLERS, model=model, slots=state.slots
    )
    # docs/engine-protocol.md, Opening a session: with model= and autostart not disabled, the
    # session opens
    # before any client message (the pitfall the proxy avoids with autostart=0).
    if (
        model is not None
        and not is_false_flag(query.get("autostart"))
        and not truthy(query.get("resume"))
    ):
        session.open()
    await SocketRunner(ws, SessionHost(session, state), state).run()
    return ws


async def _plain_realtime(request: web.Request, state: SimulatorState) -> web.StreamResponse:
    """``--session-mode realtime``: no duplex handler is mounted (0.31 and later).

    ``/v1/realtime`` opens a session at once (``session.created``, no
    ``server_event_seq`` on anything) and answers duplex-only client events
    with ``invalid_event``; asking for duplex (``?duplex=1``, ``/v1/duplex``)
    is refused with the engine's flat ``unsupported`` error.
    """
    ws = web.WebSocketResponse(max_msg_size=TRANSPORT_MAX_MESSAGE_BYTES, autoping=True)
    await ws.prepare(request)
    if request.path == "/v1/duplex":
        await ws.send_str(flat_error("Duplex API is not available", "unsupported"))
        await ws.close()
        return ws
    if truthy(request.query.get("duplex")):
        await ws.send_str(flat_error("VAD realtime is not enabled", "unsupported"))
        await ws.close(code=1008)
        return ws
    session = DuplexSession(
        state.config, state.bank, state.stats, handlers=HANDLERS, model=request.query.get("model")
    )
    session.open()
    await SocketRunner(ws, SessionHost(session, state), state).run()
    return ws


def build_audio_bank(config: SimulatorConfig) -> AudioBank:
    """The output voice: ``--audio`` WAV, else the generated one.

    Raises:
        ValueError: the WAV file is unusable.
        OSError: the WAV file cannot be read.
    """
    samples = load_wav(config.audio_path, config.sample_rate) if config.audio_path else None
    return make_audio_bank(config.chunk_ms, config.sample_rate, samples)


def build_app(config: SimulatorConfig, bank: AudioBank) -> web.Application:
    """Return the simulator's aiohttp application (state under :data:`STATE_KEY`)."""
    app = web.Application()
    app[STATE_KEY] = SimulatorState(config=config, bank=bank, created=int(time.time()))
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/debug/history", handle_debug_history)
    app.router.add_get("/v1/realtime", handle_realtime)
    app.router.add_get("/v1/duplex", handle_realtime)
    return app


# ----------------------------------------------------------- lifecycle


def _crash() -> None:
    # --crash-after: die like an engine process that lost its GPU worker,
    # without closing sockets or running cleanup.
    logger.error("--crash-after reached: exiting abruptly")
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(1)


class _Reaper:
    """Expires detached sessions past their grace, every ``--reaper-interval`` (a timer)."""

    def __init__(self, state: SimulatorState) -> None:
        self._state = state
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(state.config.reaper_interval, self._tick)

    def _tick(self) -> None:
        self._state.reap(self._loop.time())
        self._handle = self._loop.call_later(self._state.config.reaper_interval, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


def _install_signal_handlers(config: SimulatorConfig, stop: asyncio.Event) -> None:
    """Signal handlers only set ``stop`` (uvicorn style)."""
    loop = asyncio.get_running_loop()
    if config.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)


async def _shutdown(runner: web.AppRunner, state: SimulatorState) -> None:
    for site in list(runner.sites):
        await site.stop()  # stop accepting first
    for host in list(state.hosts):
        host.request_close("shutdown", 1001)  # 1001 going away, not 1000
    # A stalled server sends nothing, so waiting for sessions to drain is moot.
    if not state.stalled.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_DRAIN_TIMEOUT):
                await state.no_sessions.wait()
    await runner.cleanup()


async def serve(
    config: SimulatorConfig,
    *,
    bank: AudioBank | None = None,
    shutdown_trigger: asyncio.Event | None = None,
    install_signal_handlers: bool = True,
    on_listening: Callable[[int], None] | None = None,
) -> int:
    """Run the simulator until ``shutdown_trigger`` (SIGTERM/SIGINT by default) fires.

    Args:
        config: simulator configuration.
        bank: output audio; built from ``config`` when omitted.
        shutdown_trigger: Event that starts the graceful stop.
        install_signal_handlers: set ``shutdown_trigger`` on SIGTERM/SIGINT.
        on_listening: called with the bound port once listening.

    Returns:
        The process exit code (0).
    """
    stop = shutdown_trigger if shutdown_trigger is not None else asyncio.Event()
    if install_signal_handlers:
        _install_signal_handlers(config, stop)
    if config.startup_delay > 0:
        logger.info("simulating model load for %.1f s", config.startup_delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.startup_delay):
                await stop.wait()
    if bank is None and not stop.is_set():
        bank = await asyncio.to_thread(build_audio_bank, config)
    if stop.is_set() or bank is None:
        logger.info("stopped before listening")
        return 0

    app = build_app(config, bank)
    state = app[STATE_KEY]
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    timers: list[asyncio.TimerHandle] = []
    reaper: _Reaper | None = None
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        state.listening_since = loop.time()
        port = runner.addresses[0][1] if runner.addresses else config.port
        logger.info(
            "omni engine simulator listening on http://%s:%d (model=%s, chunk_ms=%d, "
            "realtime_factor=%g, generation_speed=%g, event_names=%s, "
            "playback_commit_policy=%s, supports_audio_truncate=%s, engine_version=%s, "
            "session_mode=%s, session_resume=%s, disconnect_grace=%g)",
            config.host,
            port,
            config.model,
            config.chunk_ms,
            config.realtime_factor,
            config.generation_speed,
            config.event_names,
            config.playback_commit_policy,
            config.supports_audio_truncate,
            config.engine_version,
            config.session_mode,
            config.resumable,
            config.disconnect_grace,
        )
        if on_listening is not None:
            on_listening(port)
        if config.crash_after is not None:
            timers.append(loop.call_later(config.crash_after, _crash))
        if config.stall_after is not None:

            def _stall() -> None:
                logger.warning("--stall-after reached: all sockets stop reading and sending")
                state.stalled.set()

            timers.append(loop.call_later(config.stall_after, _stall))
        if config.resumable:
            reaper = _Reaper(state)
        await stop.wait()
        logger.info("shutting down: closing %d session(s) with 1001", len(state.hosts))
    finally:
        for timer in timers:
            timer.cancel()
        if reaper is not None:
            reaper.cancel()
        await _shutdown(runner, state)
    logger.info("stopped")
    return 0


def run(config: SimulatorConfig) -> int:
    """Run the simulator in a fresh event loop (uvloop when importable).

    Returns:
        The process exit code: 0 after a graceful stop, 1 when the port could
        not be bound or the voice could not be loaded.
    """
    if config.ignore_sigterm:
        # As early as possible, so a SIGTERM during start-up is ignored too.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if sys.platform != "win32":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop_factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(serve(config))
    except (OSError, ValueError) as exc:
        logger.error("simulator failed to start: %s", exc)
        return 1
