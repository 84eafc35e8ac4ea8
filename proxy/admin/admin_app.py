"""The admin listener: metrics, health, the operator console and its JSON.

Its routes exist on the admin listener only (docs/design.md, Routes and
listeners): ``/metrics``, ``/healthz``, the console page and its same-origin
files, the ``/debug/*`` JSON (docs/console.md) and ``POST /engines/{k}/drain``
(docs/design.md, Engine pool). ``admin_token``, when set, guards every one.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Final

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from proxy.admin.console import (
    CONTENT_SECURITY_POLICY,
    MAX_PAGE_SESSIONS,
    Asset,
    load_assets,
    session_detail,
    sessions_page,
    summary,
)
from proxy.edge.state import STATE, ProxyState

__all__ = ["build_admin_app"]

_ASSETS: Final[web.AppKey[dict[str, Asset]]] = web.AppKey("omni_sidecar_console_assets")
_STARTED: Final[web.AppKey[float]] = web.AppKey("omni_sidecar_admin_started")
#: Sent with every admin answer: nothing here may be framed, sniffed or cached.
_SECURITY_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_CHALLENGE: Final = 'Basic realm="omni-sidecar admin", Bearer realm="omni-sidecar admin"'

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(
    data: object, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """JSON via orjson: several times faster than json.dumps on a 500-session page."""
    return web.Response(
        body=orjson.dumps(data), status=status, headers=headers, content_type="application/json"
    )


def _token_matches(header: str, token: str) -> bool:
    """Bearer <token>, or Basic with any user name and the token as password."""
    scheme, _, credentials = header.partition(" ")
    scheme = scheme.lower()
    credentials = credentials.strip()
    if scheme == "bearer":
        offered = credentials
    elif scheme == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return False
        offered = decoded.partition(":")[2]
    else:
        return False
    return hmac.compare_digest(offered.encode(), token.encode())


def _admin_token(state: ProxyState) -> str | None:
    return state.settings.admin_token or None


@web.middleware
async def _guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """The token check (when set) and the security headers, for every route."""
    token = _admin_token(request.app[STATE])
    if token is not None and not _token_matches(request.headers.get("Authorization", ""), token):
        response: web.StreamResponse = _json(
            {"error": {"code": "unauthorized", "message": "admin_token required"}},
            status=401,
            headers={"WWW-Authenticate": _CHALLENGE},
        )
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = _json(
                {"error": {"code": exc.reason.lower().replace(" ", "_"), "message": exc.text}},
                status=exc.status,
            )
    for name, value in _SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.registry.flush_metrics()
    accept = request.headers.get("Accept", "")
    if "application/openmetrics-text" in accept:
        body = generate_openmetrics(state.metrics.registry)  # type: ignore[no-untyped-call]
        content_type = OPENMETRICS_CONTENT_TYPE
    else:
        body = generate_latest(state.metrics.registry)
        content_type = CONTENT_TYPE_LATEST
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def _healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


def _asset_response(asset: Asset) -> web.Response:
    response = web.Response(body=asset.body)
    response.headers["Content-Type"] = asset.content_type
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return response


async def _page(request: web.Request) -> web.Response:
    return _asset_response(request.app[_ASSETS]["index.html"])


async def _console_file(request: web.Request) -> web.Response:
    asset = request.app[_ASSETS].get(request.match_info["name"])
    if asset is None or asset.content_type.startswith("text/html"):
        raise web.HTTPNotFound(text="no such console file")
    return _asset_response(asset)


async def _debug_summary(request: web.Request) -> web.Response:
    return _json(summary(request.app[STATE], started=request.app[_STARTED]))


def _int_query(request: web.Request, name: str, default: int, maximum: int) -> int:
    text = request.query.get(name, "")
    if not text:
        return default
    if not text.isdigit() or int(text) > maximum:
        raise web.HTTPBadRequest(text=f"{name} must be an integer from 0 to {maximum}")
    return int(text)


async def _debug_sessions(request: web.Request) -> web.Response:
    offset = _int_query(request, "offset", 0, 1 << 31)
    limit = _int_query(request, "limit", MAX_PAGE_SESSIONS, MAX_PAGE_SESSIONS)
    query = request.query.get("q", "")[:200]
    return _json(await sessions_page(request.app[STATE], offset=offset, limit=limit, query=query))


async def _debug_session(request: web.Request) -> web.Response:
    detail = session_detail(request.app[STATE], request.match_info["id"])
    if detail is None:
        raise web.HTTPNotFound(text="no live or recently ended session with this id")
    return _json(detail)


async def _drain_engine(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = request.match_info["k"]
    router = state.router
    if state.drain_engine is None or router is None or not text.isdigit():
        raise web.HTTPNotFound(text="no such engine replica")
    index = int(text)
    if index >= router.count:
        raise web.HTTPNotFound(text=f"no engine replica {index} (there are {router.count})")
    began = state.drain_engine(index)
    views = router.views(time.monotonic())
    return _json({"began": began, **views[index]}, status=202 if began else 409)


def build_admin_app(state: ProxyState) -> web.Application:
    """The operator-facing application; never expose it to clients."""
    app = web.Application(middlewares=[_guard])
    app[STATE] = state
    app[_ASSETS] = load_assets()
    app[_STARTED] = time.monotonic()
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/", _page)
    app.router.add_get("/console/{name}", _console_file)
    app.router.add_get("/debug/summary", _debug_summary)
    app.router.add_get("/debug/sessions", _debug_sessions)
    app.router.add_get("/debug/sessions/{id}", _debug_session)
    app.router.add_post("/engines/{k}/drain", _drain_engine)
    return app
