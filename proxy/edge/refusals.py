"""How the client listener says no: JSON error bodies, ``Retry-After``, one log line each.

Shared by the routes (proxy/edge/client_app.py) and the session opening
(proxy/edge/session_open.py), so a refusal looks the same whichever
step refused (docs/design.md, Admission and lifecycle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Final

from aiohttp import web

from proxy.core import notices
from proxy.core.quota_rules import QuotaRefusal
from proxy.edge.auth import AuthResult, offered_subprotocols
from proxy.edge.guard import client_address
from proxy.edge.handshake import validate_upgrade
from proxy.edge.state import ProxyState

__all__ = [
    "check_auth",
    "check_upgrade",
    "json_error",
    "log_refused",
    "quota_refused",
    "refuse_in_band",
    "retry_after",
]

#: The close code of a refusal after the upgrade, by the HTTP status it stands
#: for: 1013 try again later (capacity, quota), 1014 bad gateway (RFC 6455 §7.4.2
#: registry: the engine could not be reached).
_IN_BAND_CLOSE: Final = {502: 1014}
_TRY_AGAIN_LATER: Final = 1013

#: The name these lines have always been logged under (before the edge was split).
log = logging.getLogger("omni_sidecar.edge.app")


def json_error(status: int, reason: str, message: str, **headers: str) -> web.Response:
    """A refusal's body: ``{"error": {"code", "message"}}``, the reason being the metric's."""
    return web.json_response(
        {"error": {"code": reason, "message": message}}, status=status, headers=headers
    )


def quota_refused(refused: QuotaRefusal) -> web.Response:
    """429 ``quota_exceeded`` naming the quota, with ``Retry-After`` (docs/design.md, Quotas)."""
    kind = refused.kind.value
    message = f"this API key's {kind} quota ({refused.limit:g}) is used up"
    return web.json_response(
        {
            # json_error's shape, plus what a client needs to back off.
            "error": {"code": "quota_exceeded", "message": message},
            "status": "rejected",
            "reason": "quota_exceeded",
            "quota": kind,
            "limit": refused.limit,
            "retry_after": refused.retry_after,
        },
        status=429,
        headers={"Retry-After": str(refused.retry_after)},
    )


def log_refused(address: str, status: int, reason: str) -> None:
    """One line per refused handshake: who, what status, why (never a key)."""
    log.warning("refused handshake from %s: %d %s", address or "?", status, reason)


def check_upgrade(request: web.Request, state: ProxyState) -> web.Response | None:
    """The answer to a WebSocket upgrade request that is not a valid one (RFC 6455
    §4.2.1), counted and logged; None when it is valid. The connection is closed after."""
    version = (request.version.major, request.version.minor)
    invalid = validate_upgrade(request.method, version, request.headers)
    if invalid is None:
        return None
    state.metrics.rejected_connections.labels("bad_handshake").inc()
    log_refused(client_address(request), invalid.status, invalid.reason)
    response = json_error(invalid.status, invalid.reason, invalid.message, **invalid.headers)
    response.force_close()
    return response


def check_auth(request: web.Request, state: ProxyState) -> web.Response | AuthResult:
    """401/403 before anything else, else the accepted result (with its key's name).

    Keys are never logged.
    """
    result = state.auth.check(
        request.headers, offered_subprotocols(request.headers.get("Sec-WebSocket-Protocol"))
    )
    if result.ok:
        return result
    state.metrics.sessions_rejected.labels(result.reason).inc()
    log_refused(client_address(request), result.status, result.reason)
    headers = {"WWW-Authenticate": 'Bearer realm="omni-sidecar"'} if result.status == 401 else {}
    return json_error(result.status, result.reason, result.message, **headers)


def retry_after(state: ProxyState, reason: str) -> str:
    """``Retry-After`` for a 503 refusal of ``reason``."""
    if reason == "engine_capacity":
        return state.retry_after()
    return "1" if reason == "capacity" else "5"


async def refuse_in_band(
    client: Any, status: int, reason: str, message: str, timeout: float
) -> None:
    """A refusal after the upgrade: an ``error`` event {``reason``}, then a close
    (1013, or 1014 for an engine out of reach), within ``timeout``."""
    error = notices.error_event("event_" + uuid.uuid4().hex, reason, message)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await client.send_str(error.text)
            await client.close(
                code=_IN_BAND_CLOSE.get(status, _TRY_AGAIN_LATER), message=reason.encode()[:120]
            )
