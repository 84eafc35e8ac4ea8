"""Cancel client: N sessions, each cancels its response at a random point (picows + uvloop).

Talks to the project's simulator (directly, through nginx or through the
sidecar). Each session appends 200 ms of input audio, commits, asks for a
response, and sends ``response.cancel`` naming it at a uniformly random time
between ``--cancel-min`` and ``--cancel-max`` seconds after the response's
first audio delta. It then counts the audio deltas of that response that
arrive after the cancel was sent (frames, and seconds of audio from the
decoded base64 length and the delta's ``sample_rate_hz``), and
``cancel_to_silence``: from sending the cancel to the last such delta (0 when
none came). A session ends at its ``response.done`` (or after
``--done-timeout``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import time
from typing import Any

import uvloop
from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

from bench.common import percentile

#: How an audio delta frame starts (GA and beta event names).
AUDIO_PREFIXES = (b'{"type":"response.output_audio.delta"', b'{"type":"response.audio.delta"')


def field(head: bytes, key: bytes) -> bytes | None:
    """A top-level string field's value, found in the frame's first bytes without parsing."""
    marker = b'"' + key + b'":"'
    i = head.find(marker)
    if i < 0:
        return None
    j = head.find(b'"', i + len(marker))
    return head[i + len(marker) : j]


def start_turn(transport: WSTransport) -> None:
    """What each bench session sends first: 200 ms of audio, a commit, a response.create."""
    audio = base64.b64encode(bytes(6400)).decode()  # 200 ms of 16 kHz PCM16
    for event in (
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit"},
        {"type": "response.create"},
    ):
        transport.send(WSMsgType.TEXT, json.dumps(event).encode())


def text_payload(transport: WSTransport, frame: WSFrame) -> bytes | None:
    """A text frame's payload; a close is answered and disconnects, other frames are None."""
    if frame.msg_type is WSMsgType.CLOSE:
        transport.send_close(frame.get_close_code())
        transport.disconnect()
        return None
    if frame.msg_type is not WSMsgType.TEXT:
        return None
    return frame.get_payload_as_bytes()


class CancelSession(WSListener):  # type: ignore[misc]
    def __init__(self, ns: argparse.Namespace, rng: random.Random) -> None:
        self.ns = ns
        self.rng = rng
        self.loop = asyncio.get_running_loop()
        self.transport: WSTransport | None = None
        self.done = self.loop.create_future()
        self.rid: bytes | None = None
        self.first_audio: float | None = None
        self.cancel_at: float | None = None
        self.frames_before = 0
        self.late_frames = 0
        self.late_seconds = 0.0
        self.last_late: float | None = None
        self.done_status: str | None = None
        self.other_after = 0

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        start_turn(transport)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.transport = None
        if not self.done.done():
            self.done.set_result(False)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        payload = text_payload(transport, frame)
        if payload is None:
            return
        now = time.monotonic()
        head = payload[:400]
        if head.startswith(AUDIO_PREFIXES):
            rid = field(head, b"response_id")
            if self.rid is None:
                self.rid = rid
            if rid != self.rid:
                return
            if self.cancel_at is None:
                self.frames_before += 1
                if self.first_audio is None:
                    self.first_audio = now
                    delay = self.rng.uniform(self.ns.cancel_min, self.ns.cancel_max)
                    self.loop.call_later(delay, self._cancel)
            else:
                self.late_frames += 1
                self.last_late = now
                event = json.loads(payload)
                delta = event.get("delta", "")
                raw = len(delta) * 3 // 4 - delta[-2:].count("=")
                rate = int(event.get("sample_rate_hz") or 24000)
                self.late_seconds += raw / 2 / rate
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        kind = event.get("type")
        if kind == "response.created" and self.rid is None:
            rid = event.get("response_id") or (event.get("response") or {}).get("id")
            self.rid = rid.encode() if isinstance(rid, str) else None
        elif kind == "response.done" and self.cancel_at is not None:
            self.done_status = (event.get("response") or {}).get("status")
            if not self.done.done():
                self.done.set_result(True)
        elif self.cancel_at is not None:
            self.other_after += 1

    def _cancel(self) -> None:
        if self.transport is None or self.rid is None:
            return
        self.cancel_at = time.monotonic()
        self.transport.send(
            WSMsgType.TEXT,
            json.dumps({"type": "response.cancel", "response_id": self.rid.decode()}).encode(),
        )


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(ns.seed)
    sem = asyncio.Semaphore(64)

    async def one() -> CancelSession | None:
        async with sem:
            try:
                _, s = await ws_connect(
                    lambda: CancelSession(ns, random.Random(rng.random())),
                    ns.url,
                    websocket_handshake_timeout=30,
                    max_frame_size=64 * 1024 * 1024,
                )
            except Exception:  # noqa: BLE001 - counted as failed
                return None
            return s  # type: ignore[no-any-return]

    sessions = [s for s in await asyncio.gather(*(one() for _ in range(ns.sessions))) if s]
    timeout = ns.cancel_max + ns.done_timeout + 5
    await asyncio.wait([s.done for s in sessions], timeout=timeout)
    for s in sessions:
        if s.transport is not None:
            s.transport.send_close()
    await asyncio.sleep(0.2)
    for s in sessions:
        if s.transport is not None:
            s.transport.disconnect(graceful=False)
    cancelled = [s for s in sessions if s.cancel_at is not None]
    silence = [
        (s.last_late - s.cancel_at) * 1000 if s.last_late is not None and s.cancel_at else 0.0
        for s in cancelled
    ]
    late = [s.late_frames for s in cancelled]
    return {
        "sessions": len(sessions),
        "failed": ns.sessions - len(sessions),
        "cancelled": len(cancelled),
        "done_cancelled": sum(1 for s in cancelled if s.done_status == "cancelled"),
        "late_frames_total": sum(late),
        "late_frames_max": max(late, default=0),
        "late_frames_mean": sum(late) / len(late) if late else 0.0,
        "sessions_with_late": sum(1 for n in late if n > 0),
        "late_seconds_total": sum(s.late_seconds for s in cancelled),
        "late_seconds_mean": (sum(s.late_seconds for s in cancelled) / len(cancelled))
        if cancelled
        else 0.0,
        "cancel_to_silence_p50_ms": percentile(silence, 50) if silence else None,
        "cancel_to_silence_p99_ms": percentile(silence, 99) if silence else None,
        "frames_before_cancel_mean": sum(s.frames_before for s in cancelled)
        / max(1, len(cancelled)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--sessions", "-c", type=int, default=50)
    p.add_argument("--cancel-min", type=float, default=0.3)
    p.add_argument("--cancel-max", type=float, default=4.0)
    p.add_argument("--done-timeout", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    ns = p.parse_args()
    result = uvloop.run(asyncio.wait_for(main_async(ns), ns.cancel_max + ns.done_timeout + 40))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
