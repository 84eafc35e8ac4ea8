"""Plain HTTP on the client listener, streamed to the engine and back.

Every path that is not one of ours, and a request on a WebSocket path that
does not ask for a WebSocket, goes to the engine (docs/design.md, Routes and
listeners): without hop-by-hop headers or those named in ``Connection``, in
either direction, and with the body bounded by ``max_http_body_bytes``
(docs/security.md, 3a). One access line per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.edge.handshake import tokens

__all__ = [
    "DEFAULT_MAX_HTTP_BODY_BYTES",
    "HOP_BY_HOP",
    "ProxyRequest",
    "end_to_end_headers",
    "reverse_proxy",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_HTTP_BODY_BYTES: Final = 16 * 1024 * 1024
#: Headers that describe one hop (RFC 9110 §7.6.1), plus those aiohttp recomputes.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_CHUNK_BYTES: Final = 64 * 1024


class _BodyTooLarge(Exception):
    """The streamed request body passed ``max_http_body_bytes``."""


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """What the app decided about one request before it is proxied.

    Attributes:
        base_url: the engine's ``http://host:port`` (with any path prefix).
        session: the shared client session to the engine.
        extra_headers: set on the engine request (``upstream_authorization``).
        drop_headers: request headers never forwarded (lower case), e.g. ``authorization``.
        max_body_bytes: the body cap; 0 = none.
        connect_timeout: seconds to connect to the engine.
        address: the client's address, for the access line.
        reject: counts a refusal by reason (the edge metric).
    """

    base_url: str
    session: aiohttp.ClientSession
    extra_headers: Mapping[str, str]
    drop_headers: frozenset[str]
    max_body_bytes: int
    connect_timeout: float
    address: str
    reject: Callable[[str], None]


def end_to_end_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """``headers`` without hop-by-hop ones, those named in ``Connection``, and ``drop``."""
    named: set[str] = set()
    for value in headers.getall("Connection", []):
        named |= tokens(value)
    return CIMultiDict(
        (name, value)
        for name, value in headers.items()
        if (low := name.lower()) not in HOP_BY_HOP and low not in named and low not in drop
    )


def _error(status: int, code: str, message: str) -> web.Response:
    response = web.json_response({"error": {"code": code, "message": message}}, status=status)
    return response


async def reverse_proxy(request: web.Request, how: ProxyRequest) -> web.StreamResponse:
    """Stream ``request`` to the engine and its answer back; logs one access line."""
    started = time.monotonic()
    sent = 0
    response: web.StreamResponse
    try:
        response, sent = await _forward(request, how)
    except BaseException:
        _access(request, how, 499, sent, started)
        raise
    _access(request, how, response.status, sent, started)
    return response


def _access(
    request: web.Request, how: ProxyRequest, status: int, sent: int, started: float
) -> None:
    log.info(
        "http %s %s %d %d bytes %.3f s client %s",
        request.method,
        request.path,
        status,
        sent,
        time.monotonic() - started,
        how.address,
    )


def _too_large(request: web.Request, how: ProxyRequest) -> web.Response:
    how.reject("body_too_large")
    log.warning(
        "refused http %s %s from %s: 413 body_too_large (over %d bytes)",
        request.method,
        request.path,
        how.address,
        how.max_body_bytes,
    )
    response = _error(413, "body_too_large", f"the request body exceeds {how.max_body_bytes} bytes")
    response.force_close()
    return response


async def _forward(request: web.Request, how: ProxyRequest) -> tuple[web.StreamResponse, int]:
    cap = how.max_body_bytes
    if cap > 0 and request.content_length is not None and request.content_length > cap:
        return _too_large(request, how), 0
    headers = end_to_end_headers(request.headers, how.drop_headers)
    headers.update(how.extra_headers)
    overflowed = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal overflowed
        received = 0
        while chunk := await request.content.readany():
            received += len(chunk)
            if cap > 0 and received > cap:
                overflowed = True
                raise _BodyTooLarge
            yield chunk

    data = body() if request.body_exists else None
    sent = 0
    response: web.StreamResponse | None = None
    try:
        async with how.session.request(
            request.method,
            how.base_url + request.path_qs,
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=how.connect_timeout),
        ) as upstream:
            if overflowed:
                return _too_large(request, how), 0
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            response.headers.extend(end_to_end_headers(upstream.headers))
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                if overflowed:  # the engine answered early; the body went on too long
                    response.force_close()
                    break
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
            return response, sent
    except (aiohttp.ClientError, OSError, TimeoutError, _BodyTooLarge) as exc:
        if response is not None and response.prepared:
            # Mid-answer: the status is sent; the client sees the connection end early.
            response.force_close()
            return response, sent
        if overflowed:
            return _too_large(request, how), 0
        return (
            _error(502, "upstream_unavailable", f"cannot reach the engine: {exc}"),
            0,
        )
