"""Bare aiohttp + uvloop WebSocket relay: the cost floor that bench/README.md compares against.

Forwards text and binary frames both ways, unchanged, and nothing else: no
classification, no buffer, no metrics. The upstream connector has
``limit=0`` (aiohttp's default of 100 connections would throttle session 101
onward) and compression is off on both ends.

``--upstream-client picows`` is the ceiling for the sidecar's own design: the
same aiohttp server toward clients, but the engine link is picows (frames by
callback, masking in C) and engine frames are written to the client
transport with a header of our own, as the sidecar's frame writer does.

Run: ``python -m bench.bare_relay --port 18081 --upstream ws://127.0.0.1:18080``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import aiohttp
import picows
import uvloop
from aiohttp import web

from proxy.session.frames import OP_BINARY, OP_TEXT, frame_header

__all__ = ["main"]


async def _pump_client(
    client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse
) -> None:
    async for msg in client:
        if msg.type is aiohttp.WSMsgType.TEXT:
            await upstream.send_str(msg.data)
        elif msg.type is aiohttp.WSMsgType.BINARY:
            await upstream.send_bytes(msg.data)
        else:
            break


async def _pump_upstream(
    client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse
) -> None:
    async for msg in upstream:
        if msg.type is aiohttp.WSMsgType.TEXT:
            await client.send_str(msg.data)
        elif msg.type is aiohttp.WSMsgType.BINARY:
            await client.send_bytes(msg.data)
        else:
            break


class _PicowsUpstream(picows.WSListener):
    """Engine frames straight onto the client transport, no task per frame."""

    def __init__(self, client_transport: asyncio.Transport) -> None:
        super().__init__()
        self.client_transport = client_transport
        self.transport: picows.WSTransport | None = None

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.transport = transport

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        kind = frame.msg_type
        if kind == picows.WSMsgType.TEXT or kind == picows.WSMsgType.BINARY:
            payload = frame.get_payload_as_bytes()
            opcode = OP_TEXT if kind == picows.WSMsgType.TEXT else OP_BINARY
            if not self.client_transport.is_closing():
                self.client_transport.writelines((frame_header(opcode, len(payload)), payload))
        elif kind == picows.WSMsgType.CLOSE:
            transport.send_close(frame.get_close_code())
            transport.disconnect()


async def _picows_handler(request: web.Request, upstream_base: str) -> web.StreamResponse:
    client = web.WebSocketResponse(compress=False, max_msg_size=0)
    await client.prepare(request)
    client_transport = request.transport
    assert client_transport is not None
    upstream_transport, _ = await picows.ws_connect(
        lambda: _PicowsUpstream(client_transport),
        upstream_base + request.path_qs,
        max_frame_size=64 * 1024 * 1024,
    )
    try:
        async for msg in client:
            if msg.type is aiohttp.WSMsgType.TEXT:
                upstream_transport.send(picows.WSMsgType.TEXT, msg.data.encode())
            elif msg.type is aiohttp.WSMsgType.BINARY:
                upstream_transport.send(picows.WSMsgType.BINARY, msg.data)
            else:
                break
    finally:
        upstream_transport.disconnect()
        with contextlib.suppress(Exception):
            await client.close()
    return client


def build_picows_app(upstream_base: str) -> web.Application:
    app = web.Application()

    async def handler(request: web.Request) -> web.StreamResponse:
        return await _picows_handler(request, upstream_base)

    app.router.add_get("/{tail:.*}", handler)
    return app


def build_app(upstream_base: str) -> web.Application:
    app = web.Application()
    holder: dict[str, aiohttp.ClientSession] = {}

    async def startup(_: web.Application) -> None:
        holder["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def cleanup(_: web.Application) -> None:
        await holder["s"].close()

    async def handler(request: web.Request) -> web.StreamResponse:
        upstream = await holder["s"].ws_connect(
            upstream_base + request.path_qs, compress=0, max_msg_size=0, autoping=True
        )
        client = web.WebSocketResponse(compress=False, max_msg_size=0)
        await client.prepare(request)
        tasks = [
            asyncio.ensure_future(_pump_client(client, upstream)),
            asyncio.ensure_future(_pump_upstream(client, upstream)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            with contextlib.suppress(Exception):
                await upstream.close()
            with contextlib.suppress(Exception):
                await client.close()
        return client

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_get("/{tail:.*}", handler)
    return app


async def _serve(port: int, upstream: str, lifetime: float, client: str) -> None:
    build = build_picows_app if client == "picows" else build_app
    runner = web.AppRunner(build(upstream.rstrip("/")), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), lifetime)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18081)
    parser.add_argument("--upstream", required=True, help="ws://host:port of the engine")
    parser.add_argument("--lifetime", type=float, default=1800.0)
    parser.add_argument("--upstream-client", choices=("aiohttp", "picows"), default="aiohttp")
    ns = parser.parse_args(argv)
    uvloop.run(_serve(ns.port, ns.upstream, ns.lifetime, ns.upstream_client))


if __name__ == "__main__":
    main()
