"""The session's WebSocket to the engine, as the relay sees it.

The engine link pushes frames into the relay instead of being read by it:
``run(handler)`` hands every engine text frame to
:meth:`UpstreamHandler.upstream_text` as it arrives, sends what the handler
answers, and returns when the connection ends. Sending never waits and never
raises for a connection that went away; the link tells how many bytes of
input the engine has not taken yet (``max_pending_input_bytes`` is enforced
by the relay with it), whether it is above its write mark (the relay then
stops reading the client until it drains), whether more engine frames are
already parsed (the client writer batches on it), and can drop the
connection when the keepalive gives up.

One module per implementation, behind :mod:`.protocol`, chosen by the
``upstream_client`` setting:

- :mod:`.picows_link` (the default): picows parses frames in C and calls back
  per frame, so an engine event costs no task wake-up, no message object and
  no reader queue.
- :mod:`.aiohttp_link`: aiohttp's client WebSocket, read by a loop of
  ``await receive()``.

Both write their frames through :mod:`.outbox` (masked, one write per loop
tick) and answer the engine's pings themselves; the relay's own keepalive
pings go through :meth:`UpstreamLink.ping`.
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
