"""Opening one session: placement, quota, the upstream connect, the upgrade, the relay.

Called by the ``/v1/realtime`` and ``/v1/duplex`` handler
(proxy/edge/client_app.py) once the handshake was found valid, authorised and
given a session slot (docs/design.md, Admission and lifecycle). The session
is placed on a replica by the engines layer's
:class:`~engine_launcher.admission.EngineAdmission` (docs/design.md,
Engine pool), counted against its key's quota, connected upstream before the
client's upgrade completes (so a client never gets a socket that leads
nowhere), and refused 503 ``engine_capacity`` when a full engine says so as
its first frame. Then the relay runs it, and one access line records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
import uuid
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

from aiohttp import web

from proxy import compat
from proxy.core.capabilities import (
    opens_at_connect,
    opens_with_first_message,
    session_is_duplex,
)
from proxy.core.events import classify_upstream, is_engine_full
from proxy.edge.guard import client_address
from proxy.edge.refusals import json_error as _json_error
from proxy.edge.refusals import log_refused as _log_refused
from proxy.edge.refusals import quota_refused as _quota_refused
from proxy.edge.refusals import retry_after as _retry_after

# The short names the session-opening functions below were written with.
from proxy.edge.resume import first_message, parse_resume, resume_held
from proxy.edge.state import ProxyState, UpstreamTarget
from proxy.edge.state import upstream_headers as _upstream_headers
from proxy.edge.state import upstream_url as _upstream_url
from proxy.session.client_side import ClientSide
from proxy.session.limits import RelayLimits
from proxy.session.observer import SessionObserver, SessionTracer
from proxy.session.relay import Relay
from proxy.session.upstream_link import UpstreamConnectError, connect_upstream
from proxy.session.usage_log import UsageBook
from proxy.session.writer import AiohttpWriterAdapter

__all__ = ["MAX_UPSTREAM_MESSAGE_BYTES", "run_session"]

#: The name these lines have always been logged under (before the edge was split).
log = logging.getLogger("omni_sidecar.edge.app")
#: One line per ended session (and, from the edge, per refused handshake).
access_log = logging.getLogger("omni_sidecar.access")

#: Largest frame accepted from the engine (DuplexClient allows 64 MiB too).
MAX_UPSTREAM_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Subprotocols a browser Realtime client may offer; we accept, the engine never sees them.
_CLIENT_SUBPROTOCOLS: Final = ("realtime", "openai-beta.realtime-v1")


async def run_session(
    request: web.Request, state: ProxyState, key_name: str, key_id: str = ""
) -> web.StreamResponse:
    """Place an admitted handshake on a replica (when there is a pool) and run its session.

    The caller holds the session slot (proxy/edge/session_slots.py); the
    replica's slot is held here, from placement to the session's end.
    """
    router = state.router
    if router is None:
        return await _run_placed(request, state, None, key_name, key_id)
    now = time.monotonic()
    engine = router.choose(state.registry.pending_by_engine(router.count), now)
    if engine is None:
        reason, message = router.refusal(now) or ("capacity", "every engine replica is full")
        state.metrics.sessions_rejected.labels(reason).inc()
        _log_refused(client_address(request), 503, reason)
        return _json_error(503, reason, message, **{"Retry-After": _retry_after(state, reason)})
    # The slot is held from here, across the upstream connect, until the session ends.
    router.take(engine)
    try:
        return await _run_placed(request, state, engine, key_name, key_id)
    finally:
        router.release(engine)


async def _run_placed(
    request: web.Request, state: ProxyState, engine: int | None, key_name: str, key_id: str
) -> web.StreamResponse:
    """Trace (when on) and run one placed session; its span ends on every path."""
    key = uuid.uuid4().hex[:12]
    refused = await state.quota.admit(key_name, key)
    if refused is not None:
        state.metrics.sessions_rejected.labels("quota_exceeded").inc()
        _log_refused(client_address(request), 429, f"quota_exceeded ({refused.kind.value})")
        return _quota_refused(refused)
    try:
        tracing = state.tracing
        if tracing is None:
            return await _open_session(request, state, engine, key, (key_name, key_id), None)
        tracer = tracing.session(key, request.headers, model=request.query.get("model"))
        try:
            return await _open_session(request, state, engine, key, (key_name, key_id), tracer)
        finally:
            tracer.refused("handshake_failed")  # no-op when the session span already ended
    finally:
        with contextlib.suppress(Exception):
            await state.quota.release(key)


async def _open_session(
    request: web.Request,
    state: ProxyState,
    engine: int | None,
    key: str,
    identity: tuple[str, str],
    tracer: SessionTracer | None,
) -> web.StreamResponse:
    key_name, key_id = identity
    settings = state.settings
    metrics = state.metrics
    target = state.target() if engine is None or state.router is None else _replica(state, engine)
    if target is None:
        metrics.sessions_rejected.labels("not_ready").inc()
        if tracer is not None:
            tracer.refused("not_ready")
        return _json_error(503, "not_ready", "engine is not ready", **{"Retry-After": "5"})
    url = _upstream_url(state, target, request)
    metrics.upstream_connects.inc()
    started = time.monotonic()
    headers = _upstream_headers(state, request)
    if tracer is not None:
        tracer.upstream_headers(headers)
    try:
        async with asyncio.timeout(
            min(settings.upstream_connect_timeout, settings.handshake_timeout)
        ):
            upstream = await connect_upstream(
                settings.upstream_client,
                url,
                headers=headers,
                max_message_bytes=MAX_UPSTREAM_MESSAGE_BYTES,
                write_limit=settings.max_pending_input_bytes,
                close_timeout=settings.close_timeout,
                session=state.client_session() if settings.upstream_client == "aiohttp" else None,
            )
    except (UpstreamConnectError, TimeoutError) as exc:
        metrics.upstream_connect_failures.inc()
        metrics.sessions_rejected.labels("upstream_unavailable").inc()
        log.warning("upstream connect to %s failed: %s", url, exc or type(exc).__name__)
        if tracer is not None:
            tracer.refused("upstream_unavailable")
        return _json_error(502, "upstream_unavailable", f"cannot reach the engine: {exc}")
    metrics.upstream_connect.observe(time.monotonic() - started)
    upstream_query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    if settings.engine_open_wait > 0 and opens_at_connect(upstream_query):
        # The engine opens the session now: a full one says so as its first frame.
        left = settings.handshake_timeout - (time.monotonic() - started)
        first = await upstream.first_text(max(0.0, min(settings.engine_open_wait, left)))
        if first is not None and is_engine_full(classify_upstream(first)):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(settings.close_timeout):
                    await upstream.close()
            metrics.engine_full.labels("handshake").inc()
            metrics.sessions_rejected.labels("engine_capacity").inc()
            state.engine_full(engine)
            _log_refused(client_address(request), 503, "engine_capacity")
            if tracer is not None:
                tracer.refused("engine_capacity")
            return _json_error(
                503,
                "engine_capacity",
                "the engine has no room for another session",
                **{"Retry-After": _retry_after(state, "engine_capacity")},
            )
    duplex = session_is_duplex(urlsplit(url).path, upstream_query)
    capabilities = state.registry.capabilities.current.for_session(duplex=duplex)

    client = web.WebSocketResponse(
        protocols=_CLIENT_SUBPROTOCOLS,
        max_msg_size=settings.max_client_message_bytes,
        compress=False,
        autoping=False,
    )
    try:
        async with asyncio.timeout(settings.handshake_timeout):
            await client.prepare(request)
    except BaseException:
        await upstream.close()
        raise
    protocol = _tune_client_socket(request, settings.client_write_buffer_bytes)
    address = client_address(request)
    side = ClientSide(
        client,
        protocol,
        upstream,
        functools.partial(compat.push_text, client),
        write_buffer_bytes=settings.client_write_buffer_bytes,
        address=address,
    )
    # From here on every frame to this client, aiohttp's own close frames
    # included, goes through the connection's frame writer.
    compat.install_client_writer(client, AiohttpWriterAdapter(side.writer))
    resumable = state.session_settings.client_resume_grace > 0
    if resumable and opens_with_first_message(dict(request.query)):
        # The engine sends nothing before the client's first message, which may
        # be a session.resume (docs/design.md, Resume).
        opening = await first_message(client, settings.handshake_timeout)
        side.reader.first = opening
        resume = parse_resume(opening)
        if resume is not None:
            if await resume_held(state.registry, metrics, side, resume, key_id):
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(settings.close_timeout):
                        await upstream.close()
                return client
            metrics.resumes.labels("passed_upstream").inc()
    observer = state.registry.observer(
        key, client_address=address, engine=engine, key_name=key_name, tracer=tracer
    )
    relay = Relay(
        session_key=key,
        side=side,
        upstream=upstream,
        settings=state.session_settings,
        capabilities=capabilities,
        observer=observer,
        limits=RelayLimits.from_settings(settings),
    )
    state.quota.attach(key, relay.view, relay.end_for_quota)
    metrics.sessions_started.inc()
    state.registry.add(relay, key_id=key_id)
    if state.registry.closing_all:
        relay.shutdown()  # its handshake raced the shutdown: close it with 1001 now
    relay.log.info("session open: %s -> %s", address, url)
    try:
        await relay.run()
    finally:
        state.registry.remove(relay)
        _log_session_end(relay, observer, state.usage)
    return client


def _replica(state: ProxyState, engine: int) -> UpstreamTarget | None:
    assert state.router is not None
    url = state.router.targets[engine]
    return None if url is None else UpstreamTarget.from_url(url)


def _log_session_end(relay: Relay, observer: SessionObserver, usage: UsageBook) -> None:
    """One access line per session (logger ``omni_sidecar.access``), with its usage.

    The usage record (docs/design.md, Usage) is counted per key name and, with
    ``usage_file``, written as one JSON line.
    """
    view = relay.view
    now = relay.timers.now()
    duration = now - relay.started_at
    record = usage.add(
        view.usage_record(observer.key_name, duration, now),
        {
            "ts": round(observer.started_at + duration, 3),
            "session": relay.key,
            "engine_session": view.session_id or "-",
            "started_at": round(observer.started_at, 3),
        },
    )
    outcome = view.outcome.value if view.outcome is not None else "error"
    sent = relay.side.writer.close_code_sent
    drops = {r.value: e for r, (e, _b) in view.drop_totals().items() if e}
    fields = {
        "session": relay.key,
        "engine_session": view.session_id or "-",
        "client": observer.client_address or "-",
        "duration_s": round(duration, 3),
        "events_in": observer.events_client_to_upstream,
        "bytes_in": observer.c2u_bytes,
        "events_out": relay.side.writer.frames_written,
        "bytes_out": relay.side.writer.bytes_written,
        "drops": ",".join(f"{k}:{v}" for k, v in sorted(drops.items())) or "none",
        "outcome": outcome,
        # The code the client actually got; "not_sent" when no close frame reached it.
        "close_code": sent if sent is not None else "not_sent",
    }
    for name in _USAGE_FIELDS:
        fields[name] = record[name]
    # The fields ride as extras: text logs append them as key=value, JSON logs
    # give each a key of its own.
    access_log.info("session end", extra=fields)


#: The usage record's fields the access line carries (the record's identity fields it has already).
_USAGE_FIELDS: Final = (
    "key",
    "audio_in_seconds",
    "audio_out_seconds",
    "audio_delivered_seconds",
    "audio_heard_seconds",
    "responses_started",
    "responses_completed",
    "responses_cancelled",
    "responses_failed",
    "responses_incomplete",
    "responses_unfinished",
    "input_tokens",
    "output_tokens",
    "total_tokens",
)


def _tune_client_socket(request: web.Request, write_buffer_bytes: int) -> Any:
    """Bound what the transport and kernel hold for this client; return its protocol."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.set_write_buffer_limits(high=write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
    return request.protocol
