"""Bare aiohttp + uvloop WebSocket relay: the cost floor that bench/README.md compares against.

Forwards text and binary frames both ways, unchanged, and nothing else: no
classification, no buffer, no metrics. The upstream connector has
``limit=0`` (aiohttp's default of 100 connections would throttle session 101
onward) and compression is off on both ends.

Run: ``python -m bench.bare_relay --port 18081 --upstream ws://127.0.0.1:18080``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import aiohttp
import uvloop
from aiohttp import web

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


async def _serve(port: int, upstream: str, lifetime: float) -> None:
    runner = web.AppRunner(build_app(upstream.rstrip("/")), access_log=None)
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
    ns = parser.parse_args(argv)
    uvloop.run(_serve(ns.port, ns.upstream, ns.lifetime))


if __name__ == "__main__":
    main()
