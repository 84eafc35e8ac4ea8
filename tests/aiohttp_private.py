"""Every reach of the tests and the benchmarks into aiohttp's private parts, in one place.

aiohttp's public API lacks a few things a test needs: making a client vanish
without a close frame, the port a site bound to port 0 got, the private
module whose hook the startup check watches. Each one is here, with why it is
needed; no other module under ``tests/`` or ``bench/`` reaches into aiohttp
privates (``tests/test_lint.py`` fails when one does). Where the product
already reaches for the same thing in ``proxy/compat/`` (its one door into
aiohttp, checked against the installed aiohttp when ``serve`` starts), this
module goes through that helper rather than reaching a second time, so an
aiohttp that moves the internal breaks the startup check and these tests
together.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

# The module behind ``compat.websocket_mask``. test_compat deletes its
# ``websocket_mask`` to see the startup check name the missing hook; nothing
# public exposes the module.
from aiohttp._websocket import helpers as websocket_helpers

from proxy import compat

__all__ = ["abort", "bound_port", "transport_of", "websocket_helpers"]


def transport_of(ws: aiohttp.ClientWebSocketResponse) -> asyncio.Transport | None:
    """The transport under a client WebSocket; None once the connection is gone.

    Why: ``ClientWebSocketResponse`` has no public transport (the connection
    hangs off its private ``_response``). It is the one its writer holds,
    which ``compat.upstream_transport`` reads for the engine link.
    """
    return compat.upstream_transport(ws)


def abort(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Drop the connection under ``ws`` at once: no close frame, no FIN handshake.

    Why: a client that vanishes (a killed process, a lost network) is what
    the test or the soak benchmark plays, and ``ws.close()`` would send a
    close frame first. Fails when there is no connection left to drop.
    """
    transport = transport_of(ws)
    assert transport is not None, "the client WebSocket has no connection left"
    transport.abort()


def bound_port(site: web.TCPSite) -> int:
    """The port a started site listens on (it was given port 0).

    Why: ``TCPSite`` keeps its server private (``_server``); its ``name``
    repeats the port it was given, 0. ``compat.bound_sockets`` reads it for
    the sidecar's own listeners.
    """
    sockets: list[socket.socket] = compat.bound_sockets(site)
    assert sockets, "the site is not started"
    return int(sockets[0].getsockname()[1])
