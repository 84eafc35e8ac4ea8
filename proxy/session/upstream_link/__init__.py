"""The session's WebSocket to the engine, as the relay sees it (docs/design.md, Relay shell).

The upstream link pushes frames into the relay: ``run(handler)`` hands every
engine text frame to :meth:`UpstreamHandler.upstream_text` as it arrives, sends
what the handler answers, and returns when the connection ends. Sending never
waits. One module per implementation behind :mod:`.interface`, chosen by
``upstream_client``: :mod:`.picows_link` (default: frames parsed in C, one
callback per frame) and :mod:`.aiohttp_link`; both write through
:mod:`.frame_outbox` (masked, one write per loop tick).
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from proxy import compat
from proxy.session.upstream_link.aiohttp_link import AiohttpUpstreamLink, read_messages
from proxy.session.upstream_link.interface import (
    CLEAN_CLOSES,
    NO_COMMANDS,
    UpstreamConnectError,
    UpstreamHandler,
    UpstreamLink,
)
from proxy.session.upstream_link.picows_link import PicowsUpstreamLink
from proxy.settings import UpstreamClient

__all__ = [
    "CLEAN_CLOSES",
    "NO_COMMANDS",
    "AiohttpUpstreamLink",
    "PicowsUpstreamLink",
    "UpstreamConnectError",
    "UpstreamHandler",
    "UpstreamLink",
    "connect_upstream",
    "read_messages",
]


async def connect_upstream(
    client: UpstreamClient,
    url: str,
    *,
    headers: Mapping[str, str],
    max_message_bytes: int,
    write_limit: int,
    close_timeout: float,
    session: aiohttp.ClientSession | None = None,
) -> UpstreamLink:
    """Open the engine WebSocket for one session.

    The caller bounds the time (``upstream_connect_timeout``).

    Args:
        client: ``"picows"`` or ``"aiohttp"`` (the ``upstream_client`` setting).
        url: the engine's ``ws://``/``wss://`` URL with path and query.
        headers: extra request headers (Authorization).
        max_message_bytes: larger engine messages end the connection.
        write_limit: unsent input (bytes) at which sending waits for a drain;
            0 waits whenever the transport is above its mark.
        close_timeout: aiohttp's wait for the engine's close reply.
        session: the aiohttp client session (``"aiohttp"`` only).

    Raises:
        UpstreamConnectError: the engine did not accept the WebSocket.
    """
    if client == "picows":
        return await PicowsUpstreamLink.connect(
            url, headers=headers, max_message_bytes=max_message_bytes, write_limit=write_limit
        )
    assert session is not None, "the aiohttp link needs a client session"
    try:
        upstream = await session.ws_connect(
            url,
            headers=dict(headers),
            # Keepalive is the relay's own (SessionTimers): aiohttp's re-arms a
            # timer on every received message.
            max_msg_size=max_message_bytes,
            compress=0,
            autoping=False,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=close_timeout),
        )
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
    compat.set_upstream_write_limit(upstream, write_limit)
    return AiohttpUpstreamLink(upstream)
