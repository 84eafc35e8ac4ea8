"""Bench engine: a minimal Realtime audio source that stamps every event (picows + uvloop).

It speaks just enough of the vLLM-Omni realtime protocol for the sidecar to
treat its traffic like an engine's: ``session.created`` on connect,
``response.created`` / ``response.output_audio.delta`` / ``response.done``
with a top-level ``response_id``, ``session.closed`` after ``session.close``.

Every audio delta carries its send time, ``time.monotonic_ns()``, inside
``event_id`` (``"event_id":"b<ns>"``), written just before the frame is handed
to the socket: a client on the same host subtracts it from its receive time to
get the one-way latency of the path (direct, nginx or sidecar). Client events
(appends, acks) carry ``"event_id":"c<ns>"`` the same way, and the engine
records their one-way latency, which gives the up direction.

Per-session behaviour comes from the query string, so one engine serves every
scenario and the same URL works direct, through nginx and through the sidecar:

* ``mode``: ``paced`` (one delta per ``chunk_ms``, absolute schedule with a
  random phase per session) or ``burst`` (as fast as back-pressure allows).
* ``window`` (burst only): at most this many deltas not yet acknowledged by a
  ``session.event_ack`` naming their ``server_event_seq`` (credit flow control:
  the sidecar reads the engine at full speed by design, so without it a
  burst engine would overflow the sidecar's per-session buffer whenever the
  client reads slower than the engine writes; every path gets the same credits).
* ``chunk_ms`` (audio per delta at 24 kHz PCM16; 40 ms ≈ 2.8 KB, 500 ms ≈ 32 KB),
  ``late`` (deltas still sent after a cancel, like the released engines),
  ``resp_s`` (response length; 0 = until cancelled or closed).

A control WebSocket on ``/stats`` answers ``reset`` (start counting up-direction
events now) and ``get`` (JSON with counts and latency percentiles).

Its outbox is the socket's write buffer, unbounded on purpose (the engine flaw
a slow client exposes). Run: ``python -m bench.engine --port 18080``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import signal
import time
from typing import Any
from urllib.parse import parse_qs

import uvloop
from picows import (
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
    WSUpgradeRequest,
    WSUpgradeResponse,
    WSUpgradeResponseWithListener,
    ws_create_server,
)

__all__ = ["main"]

OUT_RATE = 24_000
_AUDIO_PREFIX = b'{"type":"response.output_audio.delta","event_id":"b'
_APPEND_PREFIX = b'{"type":"input_audio_buffer.append"'
_ACK_PREFIX = b'{"type":"session.event_ack"'
_MAX_SAMPLES = 2_000_000
_B64: dict[int, bytes] = {}


def _b64_for(chunk_ms: int) -> bytes:
    """Base64 of ``chunk_ms`` of 24 kHz PCM16 (a fixed pseudo-random pattern)."""
    cached = _B64.get(chunk_ms)
    if cached is None:
        rng = random.Random(chunk_ms)
        n = OUT_RATE * chunk_ms // 1000 * 2
        raw = bytes(rng.getrandbits(8) for _ in range(min(n, 4096)))
        raw = (raw * (n // len(raw) + 1))[:n]
        cached = _B64[chunk_ms] = base64.b64encode(raw)
    return cached


class Stats:
    """Up-direction counters (client → engine), reset by the control socket."""

    def __init__(self) -> None:
        self.recording = False
        self.events = 0
        self.bytes = 0
        self.lat_ns: list[int] = []
        self.sessions = 0
        self.down_events = 0

    def reset(self) -> None:
        self.recording = True
        self.events = 0
        self.bytes = 0
        self.down_events = 0
        self.lat_ns = []

    def snapshot(self) -> dict[str, Any]:
        lat = sorted(self.lat_ns)

        def pct(q: float) -> float | None:
            if not lat:
                return None
            k = max(0, min(len(lat) - 1, round(q / 100 * len(lat) + 0.5) - 1))
            return lat[k] / 1e6

        return {
            "up_events": self.events,
            "up_bytes": self.bytes,
            "up_lat_samples": len(lat),
            "up_p50_ms": pct(50),
            "up_p99_ms": pct(99),
            "down_events_sent": self.down_events,
            "sessions": self.sessions,
        }


STATS = Stats()


def _stamp(payload: bytes) -> int:
    i = payload.find(b'"event_id":"c', 0, 200)
    if i < 0:
        return 0
    j = payload.find(b'"', i + 13, i + 40)
    try:
        return int(payload[i + 13 : j])
    except ValueError:
        return 0


class EngineSession(WSListener):  # type: ignore[misc]
    """One client connection."""

    _counter = 0

    def __init__(self, query: dict[str, str]) -> None:
        EngineSession._counter += 1
        self.sid = EngineSession._counter
        self.mode = query.get("mode", "paced")
        self.chunk_ms = int(query.get("chunk_ms", "80"))
        self.late = int(query.get("late", "0"))
        self.resp_s = float(query.get("resp_s", "0"))
        self.window = int(query.get("window", "0"))
        self.acked = 0
        self.interval = self.chunk_ms / 1000.0
        self.b64 = _b64_for(self.chunk_ms)
        self.transport: WSTransport | None = None
        self.loop = asyncio.get_running_loop()
        self.rid = b""
        self.nresp = 0
        self.seq = 0
        self.sent_chunks = 0
        self.total_chunks = 0
        self.timer: asyncio.TimerHandle | None = None
        self.t0 = 0.0
        self.paused = False
        self.pump_scheduled = False
        self.active = False
        self.tail = b""

    # -- picows callbacks ------------------------------------------------------------

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        STATS.sessions += 1
        self._send_json(
            {
                "type": "session.created",
                "event_id": "b0",
                "session": {"id": f"bench-{self.sid}", "object": "realtime.session"},
            }
        )

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        STATS.sessions -= 1
        self._stop_stream()
        self.transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.active and self.mode == "burst" and not self.pump_scheduled:
            self.pump_scheduled = True
            self.loop.call_soon(self._pump)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type is not WSMsgType.TEXT:
            if frame.msg_type is WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()
            return
        payload = frame.get_payload_as_bytes()
        if payload.startswith((_APPEND_PREFIX, _ACK_PREFIX)):
            if self.window and payload.startswith(_ACK_PREFIX):
                i = payload.find(b'"server_event_seq":')
                if i >= 0:
                    j = payload.find(b"}", i)
                    acked = int(payload[i + 19 : j])
                    if acked > self.acked:
                        self.acked = acked
                        if self.active and not self.pump_scheduled and not self.paused:
                            self.pump_scheduled = True
                            self.loop.call_soon(self._pump)
            if STATS.recording:
                STATS.events += 1
                STATS.bytes += len(payload)
                stamp = _stamp(payload)
                if stamp and len(STATS.lat_ns) < _MAX_SAMPLES:
                    STATS.lat_ns.append(time.monotonic_ns() - stamp)
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            self._start_response()
        elif kind == "response.cancel":
            self._cancel()
        elif kind == "session.close":
            self._stop_stream()
            self._send_json({"type": "session.closed", "event_id": "b0", "reason": "client"})
            transport.send_close()
            transport.disconnect()

    # -- responses ----------------------------------------------------------------------

    def _send_json(self, body: dict[str, Any]) -> None:
        if self.transport is not None:
            self.transport.send(WSMsgType.TEXT, json.dumps(body, separators=(",", ":")).encode())

    def _start_response(self) -> None:
        if self.active:
            return
        self.nresp += 1
        self.rid = f"resp_{self.sid}_{self.nresp}".encode()
        self.tail = (
            b'","response_id":"'
            + self.rid
            + b'","item_id":"item_'
            + self.rid
            + b'","output_index":0,"content_index":0,"server_event_seq":'
        )
        self.sent_chunks = 0
        self.total_chunks = int(self.resp_s * 1000 / self.chunk_ms) if self.resp_s > 0 else 0
        self.active = True
        self._send_json(
            {
                "type": "response.created",
                "event_id": "b0",
                "response_id": self.rid.decode(),
                "response": {
                    "id": self.rid.decode(),
                    "object": "realtime.response",
                    "status": "in_progress",
                },
            }
        )
        if self.mode == "burst":
            self.pump_scheduled = True
            self.loop.call_soon(self._pump)
        elif self.mode == "paced":
            # Random phase so that sessions do not all tick at the same instant.
            self.t0 = self.loop.time() + random.random() * self.interval
            self.timer = self.loop.call_at(self.t0, self._tick)

    def _chunk(self) -> None:
        transport = self.transport
        if transport is None:
            return
        self.seq += 1
        self.sent_chunks += 1
        STATS.down_events += 1
        transport.send(
            WSMsgType.TEXT,
            b"".join(
                (
                    _AUDIO_PREFIX,
                    str(time.monotonic_ns()).encode(),
                    self.tail,
                    str(self.seq).encode(),
                    b',"delta":"',
                    self.b64,
                    b'"}',
                )
            ),
        )

    def _finished(self) -> bool:
        return self.total_chunks > 0 and self.sent_chunks >= self.total_chunks

    def _tick(self) -> None:
        self.timer = None
        if not self.active or self.transport is None:
            return
        self._chunk()
        if self._finished():
            self._done("completed")
            return
        self.timer = self.loop.call_at(self.t0 + self.sent_chunks * self.interval, self._tick)

    def _pump(self) -> None:
        self.pump_scheduled = False
        for _ in range(8):
            if self.paused or not self.active or self.transport is None:
                return
            if self.window and self.seq - self.acked >= self.window:
                return  # out of credits: the next ack schedules us again
            self._chunk()
            if self._finished():
                self._done("completed")
                return
        self.pump_scheduled = True
        self.loop.call_soon(self._pump)

    def _stop_stream(self) -> None:
        self.active = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _cancel(self) -> None:
        if not self.active:
            return
        self._stop_stream()
        for _ in range(self.late):  # audio already produced goes out anyway
            self._chunk()
        self._done("cancelled")

    def _done(self, status: str) -> None:
        self._stop_stream()
        self._send_json(
            {
                "type": "response.done",
                "event_id": "b0",
                "response_id": self.rid.decode(),
                "response": {
                    "id": self.rid.decode(),
                    "object": "realtime.response",
                    "status": status,
                },
            }
        )


class StatsListener(WSListener):  # type: ignore[misc]
    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type is not WSMsgType.TEXT:
            return
        command = frame.get_payload_as_ascii_text()
        if command == "reset":
            STATS.reset()
            transport.send(WSMsgType.TEXT, b'{"ok":true}')
        elif command == "get":
            transport.send(WSMsgType.TEXT, json.dumps(STATS.snapshot()).encode())


def _route(request: WSUpgradeRequest) -> Any:
    path, _, query = request.path.decode().partition("?")
    if path == "/stats":
        return StatsListener()
    if path == "/health":
        return WSUpgradeResponseWithListener(WSUpgradeResponse.create_ok_response(b"ok"), None)
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    return EngineSession(params)


async def _serve(port: int, lifetime: float) -> None:
    server = await ws_create_server(
        _route,
        "127.0.0.1",
        port,
        max_frame_size=64 * 1024 * 1024,
        websocket_handshake_timeout=30,
        backlog=4096,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"bench engine listening on 127.0.0.1:{port}", flush=True)
    try:
        await asyncio.wait_for(stop.wait(), lifetime)
    except TimeoutError:
        pass
    server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--lifetime", type=float, default=1800.0, help="exit after this many s")
    ns = parser.parse_args(argv)
    uvloop.run(_serve(ns.port, ns.lifetime))


if __name__ == "__main__":
    main()
