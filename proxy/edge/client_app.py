"""The client listener's aiohttp application and its routes.

WS ``/v1/realtime`` and ``/v1/duplex``, the phone front door WS ``/v1/twilio``
(proxy/edge/twilio_door.py), ``GET /healthz``, ``GET /readyz``; every
other path is reverse-proxied to the engine (docs/design.md, Routes and
listeners). The handshake's checks run in the order of docs/design.md,
Admission and lifecycle, before a session is opened (proxy/edge/session_open.py).
What the routes share is proxy/edge/state.py, the session slots
proxy/edge/session_slots.py, how they refuse proxy/edge/refusals.py.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from proxy import compat
from proxy.edge.guard import client_address
from proxy.edge.handshake import wants_websocket
from proxy.edge.refusals import check_auth, check_upgrade, json_error, log_refused, retry_after
from proxy.edge.reverse_proxy import ProxyRequest, reverse_proxy
from proxy.edge.session_open import open_session
from proxy.edge.state import STATE, WS_PATHS, ProxyState, upstream_headers
from proxy.edge.twilio_door import TWILIO_PATH, twilio_stream
from proxy.session.frames import FrameHeaders

__all__ = ["build_client_app"]


# -- client listener ---------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    refusal = state.refusal()
    body: dict[str, Any] = {
        "sessions": state.admission.active,
        "max_sessions": state.admission.max_sessions,
        # Redis down is degraded, not down: the limits are then per process.
        "quota": state.quota.readiness(),
    }
    router = state.router
    if router is not None:
        # Every replica's state; 200 while at least one admits (docs/design.md, Engine pool).
        now = time.monotonic()
        body["engines"] = router.views(now)
        placed = router.refusal(now)
        if refusal is None and placed is not None:
            return web.json_response(
                {"status": "not_ready", "reason": placed[0], "detail": placed[1], **body},
                status=503,
                headers={"Retry-After": retry_after(state, placed[0])},
            )
    if refusal is not None:
        return web.json_response(
            {"status": "not_ready", "reason": refusal[0], "detail": refusal[1], **body}, status=503
        )
    if not state.admission.has_slot():
        return web.json_response(
            {
                "status": "not_ready",
                "reason": "capacity",
                "detail": "all session slots are in use",
                **body,
            },
            status=503,
        )
    return web.json_response({"status": "ready", **body})


async def _realtime(request: web.Request) -> web.StreamResponse:
    """The handshake: validity, auth, readiness, then the session's slots, in that order.

    A request that does not ask for a WebSocket is plain HTTP and is
    reverse-proxied; one that does must be a complete, valid handshake
    (proxy/edge/handshake.py) before anything else is spent on it.
    """
    if not wants_websocket(request.headers):
        return await _reverse_proxy(request)
    state = request.app[STATE]
    metrics = state.metrics
    address = client_address(request)
    invalid = check_upgrade(request, state)
    if invalid is not None:
        return invalid
    auth = check_auth(request, state)
    if isinstance(auth, web.Response):
        return auth
    refusal = state.refusal()
    if refusal is not None:
        metrics.sessions_rejected.labels(refusal[0]).inc()
        log_refused(address, 503, refusal[0])
        return json_error(503, refusal[0], refusal[1], **{"Retry-After": "5"})
    return await open_session(request, state, auth.key_name, auth.key_id)


async def _reverse_proxy(request: web.Request) -> web.StreamResponse:
    """Any other HTTP request: auth, then streamed to the engine (proxy/edge/reverse_proxy.py)."""
    state = request.app[STATE]
    denied = check_auth(request, state)
    if isinstance(denied, web.Response):
        return denied
    target = state.target()
    if target is None:
        return json_error(503, "not_ready", "engine is not ready")
    address = client_address(request)
    return await reverse_proxy(
        request,
        ProxyRequest(
            base_url=target.http_base,
            session=state.client_session(),
            # Same rule as for WebSockets: upstream_authorization decides what the engine sees.
            extra_headers=upstream_headers(state, request),
            drop_headers=frozenset({"authorization"}),
            max_body_bytes=state.edge.limits.max_http_body_bytes,
            connect_timeout=state.settings.upstream_connect_timeout,
            address=address,
            reject=lambda reason: state.metrics.rejected_connections.labels(reason).inc(),
        ),
    )


def build_client_app(state: ProxyState) -> web.Application:
    """The client-facing application."""
    # Client text frames can then be handed to their relay as they are parsed.
    compat.install_text_push()
    # An unmasked client frame fails its connection with 1002 (RFC 6455 §5.1).
    compat.install_mask_check(FrameHeaders)
    app = web.Application(client_max_size=state.settings.max_client_message_bytes)
    app[STATE] = state
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    for path in WS_PATHS:
        app.router.add_route("*", path, _realtime)
    app.router.add_route("*", TWILIO_PATH, twilio_stream)
    app.router.add_route("*", "/{tail:.*}", _reverse_proxy)

    async def _close_http(_app: web.Application) -> None:
        if state.http is not None:
            await state.http.close()

    app.on_cleanup.append(_close_http)
    return app
