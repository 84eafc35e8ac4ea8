"""The session's WebSocket to the engine, as the relay sees it.

A thin wrapper over aiohttp's ``ClientWebSocketResponse``: it sends text and
control frames (never raising for a connection that went away), tells how
many bytes of input the engine has not taken yet (``max_pending_input_bytes``
is enforced by the relay with it), exposes the parsed-but-unread frame
backlog the client writer batches on, and can drop the connection when the
keepalive gives up. The internals it reads are in :mod:`proxy.compat`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sized
from typing import Any, Protocol

import aiohttp

from proxy import compat

__all__ = ["AiohttpUpstreamLink", "UpstreamLink"]

log = logging.getLogger(__name__)


class UpstreamLink(Protocol):
    """What the relay needs of its engine connection."""

    @property
    def backlog(self) -> Sized:
        """Engine frames parsed and not yet read (a live view)."""

    @property
    def closed(self) -> bool: ...

    @property
    def close_code(self) -> int | None: ...

    def input_backlog(self) -> int:
        """Bytes written toward the engine that it has not taken yet."""

    async def receive(self) -> aiohttp.WSMessage: ...

    async def send(self, text: str) -> None:
        """Send a text frame; a connection that went away is logged, not raised."""

    async def ping(self) -> None: ...

    async def pong(self, payload: bytes) -> None: ...

    def abort(self) -> None:
        """Drop the connection now."""

    async def close(self) -> None: ...


class AiohttpUpstreamLink:
    """:class:`UpstreamLink` over aiohttp's client WebSocket.

    Args:
        upstream: the connected engine WebSocket.
        log: the session's logger.
    """

    __slots__ = ("_log", "_upstream", "backlog")

    def __init__(self, upstream: aiohttp.ClientWebSocketResponse, log: Any = log) -> None:
        self._upstream = upstream
        self._log = log
        self.backlog: Sized = compat.upstream_backlog(upstream)

    @property
    def closed(self) -> bool:
        return self._upstream.closed

    @property
    def close_code(self) -> int | None:
        return self._upstream.close_code

    def input_backlog(self) -> int:
        transport = compat.upstream_transport(self._upstream)
        if transport is None:
            return 0
        try:
            return int(transport.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    async def receive(self) -> aiohttp.WSMessage:
        return await self._upstream.receive()

    async def send(self, text: str) -> None:
        if self._upstream.closed:
            return
        try:
            await self._upstream.send_str(text)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self._log.info("upstream send failed: %s", exc)

    async def ping(self) -> None:
        if not self._upstream.closed:
            with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                await self._upstream.ping()

    async def pong(self, payload: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
            await self._upstream.pong(payload)

    def abort(self) -> None:
        transport = compat.upstream_transport(self._upstream)
        if transport is not None:
            transport.abort()

    async def close(self) -> None:
        if not self._upstream.closed:
            await self._upstream.close()
