"""Barge-in client: N sessions, each interrupts its reply at a random point (picows + uvloop).

Each session appends 200 ms of input audio, commits and asks for one
response. It plays what it receives through the probe's
:class:`proxy.probe.PlayoutBuffer`: a 1x client buffer that starts at the first
audio delta and is never cleared, like a telephony bridge. At a uniformly random
playout time between ``--cancel-min`` and ``--cancel-max`` seconds after the
first delta (seeded) it sends ``response.cancel`` naming the response, whether
or not the engine has finished generating it. Measured per session:

* **heard after barge-in**: audio of the interrupted response played after the
  cancel (buffered and unplayed then, plus what still arrives);
* **heard at the cancel**: the listener's position in the reply at the cancel;
* **history**: once every session has seen its ``response.done`` (or cancelled
  after it) and ``--settle`` seconds have passed, one ``GET --history-url``
  (the simulator's ``/debug/history``) while the sockets are still open; the
  reply's ``audio_ms`` when history holds it, 0 when it does not. The error is
  ``|history audio_ms - heard at the cancel|``; also the share of the generated
  text history keeps vs. the share of the generated audio heard.

Prints one JSON object: percentiles and every session's raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from typing import Any

import uvloop
from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

from bench.cancelclient import AUDIO_PREFIXES, field, start_turn, text_payload
from bench.common import percentile
from proxy.probe import PlayoutBuffer

__all__ = ["BargeInSession", "main"]

_DELTA = b'"delta":"'
_RATE = b'"sample_rate_hz":'


def _delta_seconds(payload: bytes) -> float:
    """Audio length of a PCM16 delta from its base64 length, without decoding or parsing it."""
    i = payload.find(_DELTA)
    if i < 0:
        return 0.0
    start = i + len(_DELTA)
    end = payload.find(b'"', start)
    size = (end - start) * 3 // 4 - payload[end - 2 : end].count(b"=")
    rate = 24_000
    r = payload.find(_RATE)
    if r >= 0:
        digits = payload[r + len(_RATE) : r + len(_RATE) + 8].lstrip()
        n = 0
        while n < len(digits) and digits[n : n + 1].isdigit():
            n += 1
        rate = int(digits[:n] or b"24000") or 24_000
    return max(0, size) / 2 / rate


class BargeInSession(WSListener):
    def __init__(self, ns: argparse.Namespace, rng: random.Random) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: WSTransport | None = None
        self.finished = self.loop.create_future()
        self.delay = rng.uniform(ns.cancel_min, ns.cancel_max)
        self.playout = PlayoutBuffer()
        self.session_id: str | None = None
        self.rid: bytes | None = None
        self.first_audio: float | None = None
        self.cancel_at: float | None = None
        self.done_at: float | None = None
        self.done_status: str | None = None
        self.received_s = 0.0
        self.late_s = 0.0
        self.errors: list[str] = []

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        start_turn(transport)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.transport = None
        if not self.finished.done():
            self.finished.set_result(False)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        payload = text_payload(transport, frame)
        if payload is None:
            return
        now = time.monotonic()
        if payload.startswith(AUDIO_PREFIXES):
            rid = field(payload[:400], b"response_id")
            if self.rid is None:
                self.rid = rid
            if rid != self.rid:
                return
            seconds = _delta_seconds(payload)
            self.playout.add(rid.decode() if rid else "", seconds, now)
            self.received_s += seconds
            if self.cancel_at is not None:
                self.late_s += seconds
            if self.first_audio is None:
                self.first_audio = now
                self.loop.call_later(self.delay, self._cancel)
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        kind = event.get("type")
        if kind == "session.created":
            sid = (event.get("session") or {}).get("id")
            self.session_id = sid if isinstance(sid, str) else None
        elif kind == "response.created" and self.rid is None:
            rid = event.get("response_id") or (event.get("response") or {}).get("id")
            self.rid = rid.encode() if isinstance(rid, str) else None
        elif kind == "response.done" and self.done_at is None:
            self.done_at = now
            self.done_status = (event.get("response") or {}).get("status")
            if self.cancel_at is not None and not self.finished.done():
                self.finished.set_result(True)
        elif kind == "error":
            error = event.get("error")
            code = error.get("code") if isinstance(error, dict) else event.get("code")
            self.errors.append(str(code))

    def _cancel(self) -> None:
        if self.transport is None or self.rid is None:
            return
        self.cancel_at = time.monotonic()
        self.playout.cancel(self.rid.decode(), self.cancel_at)
        self.transport.send(
            WSMsgType.TEXT,
            json.dumps({"type": "response.cancel", "response_id": self.rid.decode()}).encode(),
        )
        if self.done_at is not None and not self.finished.done():
            self.finished.set_result(True)  # the reply was complete: the cancel changes nothing

    def figures(self, history: dict[str, Any]) -> dict[str, Any]:
        """This session's raw figures (ms), its history entry looked up in ``history``."""
        rid = self.rid.decode() if self.rid else ""
        heard_after = self.playout.heard_after_cancel(rid)
        heard_at = self.playout.played_at_cancel(rid)
        view = (history.get("sessions") or {}).get(self.session_id or "", {})
        in_history = next((i for i in view.get("items", []) if i.get("response_id") == rid), None)
        pending = next((i for i in view.get("pending", []) if i.get("response_id") == rid), None)
        entry = in_history or pending
        history_ms = float(in_history.get("audio_ms") or 0) if in_history is not None else 0.0
        out: dict[str, Any] = {
            "cancel_s": round(self.delay, 4),
            "heard_after_ms": None if heard_after is None else heard_after * 1000.0,
            "heard_at_cancel_ms": None if heard_at is None else heard_at * 1000.0,
            "received_ms": self.received_s * 1000.0,
            "late_ms": self.late_s * 1000.0,
            "done_before_cancel": self.done_at is not None
            and self.cancel_at is not None
            and self.done_at < self.cancel_at,
            "done_status": self.done_status,
            "first_audio_to_done_s": (self.done_at - self.first_audio)
            if self.done_at is not None and self.first_audio is not None
            else None,
            "history_found": entry is not None,
            "in_history": in_history is not None,
            "history_ms": history_ms if entry is not None else None,
            "history_chars": len(in_history.get("text") or "") if in_history is not None else 0,
            "full_chars": len(entry.get("full_text") or "") if entry is not None else None,
            "generated_ms": entry.get("generated_ms") if entry is not None else None,
            "errors": self.errors,
        }
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 3)
        if entry is not None and heard_at is not None:
            out["history_error_ms"] = round(abs(history_ms - heard_at * 1000.0), 3)
            # The other view: share of the generated text history keeps
            # vs. share of the generated audio heard (percentage points).
            generated, full = entry.get("generated_ms"), out["full_chars"]
            if isinstance(generated, (int, float)) and generated > 0 and full:
                heard_share = min(1.0, heard_at * 1000.0 / generated)
                text_share = out["history_chars"] / full
                out["text_share_error_pct"] = round(abs(text_share - heard_share) * 100.0, 3)
        return out


def _stats(values: list[float], prefix: str) -> dict[str, Any]:
    return {
        f"{prefix}_p50_ms": percentile(values, 50) if values else None,
        f"{prefix}_p99_ms": percentile(values, 99) if values else None,
        f"{prefix}_max_ms": max(values) if values else None,
        f"{prefix}_mean_ms": sum(values) / len(values) if values else None,
    }


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(ns.seed)
    sem = asyncio.Semaphore(64)

    async def one() -> BargeInSession | None:
        session_rng = random.Random(rng.random())  # drawn in order: paired across paths
        async with sem:
            try:
                _, s = await ws_connect(
                    lambda: BargeInSession(ns, session_rng),
                    ns.url,
                    websocket_handshake_timeout=30,
                    max_frame_size=64 * 1024 * 1024,
                )
            except Exception:  # noqa: BLE001 - counted as failed
                return None
            return s if isinstance(s, BargeInSession) else None

    sessions = [s for s in await asyncio.gather(*(one() for _ in range(ns.sessions))) if s]
    await asyncio.wait([s.finished for s in sessions], timeout=ns.cancel_max + ns.done_timeout)
    # The sidecar's last ack/truncation for a cancel goes out at once and its
    # periodic acks every 250 ms; let them reach the engine before reading.
    await asyncio.sleep(ns.settle)
    history = await asyncio.to_thread(_get_json, ns.history_url) if ns.history_url else {}
    figures = [s.figures(history) for s in sessions if s.cancel_at is not None]
    for s in sessions:
        if s.transport is not None:
            s.transport.send_close()
    await asyncio.sleep(0.2)
    for s in sessions:
        if s.transport is not None:
            s.transport.disconnect(graceful=False)
    heard = [f["heard_after_ms"] for f in figures if f["heard_after_ms"] is not None]
    error = [f["history_error_ms"] for f in figures if "history_error_ms" in f]
    share = [f["text_share_error_pct"] for f in figures if "text_share_error_pct" in f]
    gen = [f["first_audio_to_done_s"] for f in figures if f["first_audio_to_done_s"]]
    return {
        "sessions": len(sessions),
        "failed": ns.sessions - len(sessions),
        "cancelled": len(figures),
        "finished": sum(1 for s in sessions if s.finished.done() and s.finished.result()),
        "done_before_cancel": sum(1 for f in figures if f["done_before_cancel"]),
        "history_found": sum(1 for f in figures if f["history_found"]),
        "in_history": sum(1 for f in figures if f["in_history"]),
        "late_ms_total": sum(f["late_ms"] for f in figures),
        "errors": sorted({e for f in figures for e in f["errors"]}),
        **_stats(heard, "heard_after"),
        **_stats(error, "history_error"),
        "text_share_error_p50_pct": percentile(share, 50) if share else None,
        "sessions_raw": figures,
        "first_audio_to_done_s_p50": percentile(gen, 50) if gen else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--history-url", default="", help="the simulator's /debug/history")
    p.add_argument("--sessions", "-c", type=int, default=100)
    p.add_argument("--cancel-min", type=float, default=0.2, help="s of playout after first audio")
    p.add_argument("--cancel-max", type=float, default=3.8)
    p.add_argument("--done-timeout", type=float, default=8.0)
    p.add_argument("--settle", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=1)
    ns = p.parse_args()
    budget = ns.cancel_max + ns.done_timeout + ns.settle + 40
    result = uvloop.run(asyncio.wait_for(main_async(ns), budget))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
