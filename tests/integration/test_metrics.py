"""Metrics after real sessions: exact numbers, reconciled against both ends.

An in-process sidecar relays to a real simulator child. Each test reconciles
the sidecar's counters with what the client saw and with the simulator's own
``/metrics`` (what the engine sent): every engine frame the sidecar read is
either written to the client or counted as dropped, by reason.

Scenarios: a response cancelled after its 2nd audio delta (late audio dropped,
cancel-to-silence and first-audio observed once); a client that stops reading
(the buffer fills to the limit, one overflow closes the session); an engine
crash (the session fails with engine_unavailable, the engine restarts).
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as parse_text_format

from metrics import DROP_REASONS
from proxy.settings import EngineConfig
from tests.children import SimulatorChild
from tests.conftest import (
    DEADLINE,
    MS,
    TIMEOUT_FACTOR,
    RunningSidecar,
    wait_until,
)
from tests.fakes.scripted_engine import EngineConnection, ScriptedEngine

CHUNK_MS = 100
#: Audio deltas the simulator still sends after a cancel (its flaw, docs/design.md, Simulator).
LATE_CHUNKS = 3
#: Real-time pace (one delta per 100 ms), slowed with the timing factor: the
#: cancel after the 2nd delta must reach the engine before it makes the 3rd.
PACE = f"{1.0 * TIMEOUT_FACTOR:g}"
SIMULATOR_ARGS = (
    "--chunk-ms",
    str(CHUNK_MS),
    "--realtime-factor",
    PACE,
    "--late-audio-chunks",
    str(LATE_CHUNKS),
    "--deterministic",
)
AUDIO_TYPES = frozenset({"response.output_audio.delta", "response.audio.delta"})
#: What the client sends to get one response.
OPENING = (
    {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
    {"type": "input_audio_buffer.append", "audio": "AAAAAAAAAAAAAAAA"},
    {"type": "input_audio_buffer.commit"},
    {"type": "response.create"},
)
U2C = {"direction": "upstream_to_client"}
C2U = {"direction": "client_to_upstream"}
KINDS = ("audio", "control", "error", "invalid")


# -- helpers ----------------------------------------------------------------------------------


def engine_size(text: str) -> int:
    """A received frame's size as the engine wrote it: the client's resume token in
    ``session.created`` is the engine's plus the sidecar's binding (docs/design.md,
    Resume), which u2c_bytes (what came from the engine) does not count."""
    size = len(text.encode())
    token = orjson.loads(text).get("resume_token")
    if isinstance(token, str) and "~" in token:
        size -= len(token) - len(token.rpartition("~")[0])
    return size


@dataclass
class SessionRecord:
    """What one client sent and saw."""

    sent: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    response_id: str | None = None
    done: dict[str, Any] | None = None
    close_code: int | None = None

    @property
    def sent_bytes(self) -> int:
        return sum(len(text.encode()) for text in self.sent)

    @property
    def received_bytes(self) -> int:
        """What the engine wrote of what the client received (sizes as the engine sent them)."""
        return sum(map(engine_size, self.received))

    def types(self) -> list[str]:
        return [orjson.loads(text)["type"] for text in self.received]

    def audio_deltas(self) -> int:
        return sum(1 for t in self.types() if t in AUDIO_TYPES)

    def engine_frames(self) -> list[str]:
        """Frames the engine wrote (stamped ``server_event_seq``; ``session.created`` is not)."""
        out = []
        for text in self.received:
            body = orjson.loads(text)
            if "server_event_seq" in body or body["type"] == "session.created":
                out.append(text)
        return out


async def cancelled_session(url: str) -> SessionRecord:
    """One response, cancelled by name after its 2nd audio delta; then ``session.close``."""
    record = SessionRecord()
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:

        async def send(event: dict[str, Any]) -> None:
            text = orjson.dumps(event).decode()
            record.sent.append(text)
            await ws.send_str(text)

        for event in OPENING:
            await send(event)
        audio = 0
        while True:
            msg = await ws.receive(timeout=DEADLINE)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            record.received.append(msg.data)
            body = orjson.loads(msg.data)
            kind = body["type"]
            if kind == "response.created":
                record.response_id = body["response_id"]
            elif kind in AUDIO_TYPES:
                audio += 1
                if audio == 2:
                    await send({"type": "response.cancel", "response_id": record.response_id})
            elif kind == "response.done":
                record.done = body
            elif kind == "rate_limits.updated" and record.done is not None:
                break
        await send({"type": "session.close"})
        while True:
            msg = await ws.receive(timeout=DEADLINE)
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break
            record.received.append(msg.data)
        record.close_code = ws.close_code
    return record


def engine_audio_deltas(done: dict[str, Any]) -> int:
    """Audio deltas the engine produced for a cancelled response (its own account)."""
    generated_ms = done["response"]["metadata"]["playback"]["generated_ms"]
    assert generated_ms % CHUNK_MS == 0
    return int(generated_ms // CHUNK_MS)


async def simulator_counters(sim: SimulatorChild) -> dict[str, float]:
    """The simulator's own ``/metrics`` (unlabelled samples, by name)."""
    async with aiohttp.ClientSession() as http, http.get(f"{sim.http_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def total(
    proxy: RunningSidecar, name: str, label: str, values: tuple[str, ...], **fixed: str
) -> float:
    return sum(proxy.metric(name, {**fixed, label: v}) for v in values)


def snapshot(proxy: RunningSidecar) -> dict[str, float]:
    """The reconciled counters, to compare before and after a session."""
    return {
        "u2c_events": total(proxy, "omni_sidecar_events_total", "kind", KINDS, **U2C),
        "c2u_events": total(proxy, "omni_sidecar_events_total", "kind", KINDS, **C2U),
        "u2c_bytes": proxy.metric("omni_sidecar_bytes_total", U2C),
        "c2u_bytes": proxy.metric("omni_sidecar_bytes_total", C2U),
        "dropped_events": total(proxy, "omni_sidecar_dropped_events_total", "reason", DROP_REASONS),
        "dropped_bytes": total(proxy, "omni_sidecar_dropped_bytes_total", "reason", DROP_REASONS),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


async def wait_metric(
    proxy: RunningSidecar,
    name: str,
    labels: dict[str, str],
    value: float,
    *,
    timeout: float = DEADLINE,
) -> None:
    await wait_until(
        lambda: proxy.metric(name, labels) == value,
        timeout=timeout,
        what=f"{name}{labels} == {value} (now {proxy.metric(name, labels)})",
    )


async def get_metrics(proxy: RunningSidecar, accept: str | None = None) -> tuple[str, str]:
    headers = {"Accept": accept} if accept else {}
    url = f"{proxy.admin_url}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], await resp.text()


class RawClient:
    """A WebSocket client on a bare socket that reads only when told to.

    aiohttp's client keeps reading into its own queue; this one has a 4 KiB
    receive buffer and a small stream buffer, so a client that stops reading
    stalls the sidecar's writes at once.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.sent: list[str] = []

    @classmethod
    async def connect(cls, host: str, port: int, path: str = "/v1/realtime") -> RawClient:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        async with asyncio.timeout(DEADLINE):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer)

    async def _send_frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.writer.write(header + mask + masked)
        async with asyncio.timeout(DEADLINE):
            await self.writer.drain()

    async def send(self, event: dict[str, Any]) -> None:
        text = orjson.dumps(event).decode()
        self.sent.append(text)
        await self._send_frame(0x1, text.encode())

    async def receive(self) -> tuple[int, bytes]:
        """The next (opcode, payload); the sidecar never fragments or masks."""
        async with asyncio.timeout(DEADLINE):
            first, second = await self.reader.readexactly(2)
            n = second & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
            return first & 0x0F, await self.reader.readexactly(n)

    async def close(self, code: int) -> None:
        """Answer the sidecar's close frame and hang up."""
        try:
            await self._send_frame(0x8, struct.pack("!H", code))
        except (ConnectionError, TimeoutError):
            pass
        self.writer.close()


# -- a cancelled response ---------------------------------------------------------------------


async def test_cancelled_response_counts(simulator: Any, sidecar: Any) -> None:
    sim = await simulator(*SIMULATOR_ARGS)
    # playback_ack off: the answers to the sidecar's own playback.ack are, by
    # design, neither forwarded nor dropped (docs/design.md, Playback); without
    # them every engine frame is either written to the client or counted dropped.
    proxy = await sidecar(upstream=sim.ws_url, playback_ack="off")
    sim_before = await simulator_counters(sim)

    record = await cancelled_session(proxy.url)

    assert record.close_code == 1000
    assert record.done is not None and record.done["response"]["status"] == "cancelled"
    await wait_metric(proxy, "omni_sidecar_sessions_total", {"outcome": "client_closed"}, 1)
    sim_after = await simulator_counters(sim)
    m = proxy.metric
    engine_audio = engine_audio_deltas(record.done)
    sim_late = sim_after["vllm_omni_sim_late_audio_events_total"] - sim_before.get(
        "vllm_omni_sim_late_audio_events_total", 0.0
    )
    late = m("omni_sidecar_dropped_events_total", {"reason": "late_audio"})
    purged = m("omni_sidecar_dropped_events_total", {"reason": "cancelled_audio"})

    # Audio: the engine's own count, split into written and dropped.
    assert sim_late == LATE_CHUNKS
    assert late + purged == sim_late
    assert m("omni_sidecar_events_total", {**U2C, "kind": "audio"}) == engine_audio
    assert record.audio_deltas() + late + purged == engine_audio
    assert record.audio_deltas() == 2  # nothing of the response after the cancel
    for reason in set(DROP_REASONS) - {"late_audio", "cancelled_audio"}:
        assert m("omni_sidecar_dropped_events_total", {"reason": reason}) == 0, reason

    # Every engine frame is either written to the client or dropped; bytes likewise.
    counts = snapshot(proxy)
    assert record.engine_frames() == record.received  # the proxy added nothing of its own
    assert counts["u2c_events"] == sim_after["vllm_omni_sim_events_sent_total"]
    assert counts["u2c_events"] == len(record.received) + counts["dropped_events"]
    assert counts["u2c_bytes"] == sim_after["vllm_omni_sim_sent_bytes_total"]
    assert counts["u2c_bytes"] == record.received_bytes + counts["dropped_bytes"] > 0
    assert m("omni_sidecar_dropped_bytes_total", {"reason": "late_audio"}) > 0
    assert counts["c2u_events"] == len(record.sent) == len(OPENING) + 2
    assert counts["c2u_bytes"] == record.sent_bytes > 0
    # Each written event waited in the buffer once.
    assert m("omni_sidecar_output_queue_delay_seconds_count") == len(record.received)

    # Timings: one cancelled response, one response that made audio.
    assert m("omni_sidecar_cancel_to_silence_seconds_count") == 1
    assert m("omni_sidecar_first_audio_seconds_count") == 1
    assert 0 < m("omni_sidecar_first_audio_seconds_sum") < DEADLINE
    assert m("omni_sidecar_cancel_to_silence_seconds_sum") < CHUNK_MS * MS * 10

    # Lifecycle.
    assert m("omni_sidecar_sessions_started_total") == 1
    assert m("omni_sidecar_upstream_connects_total") == 1
    assert m("omni_sidecar_upstream_connect_seconds_count") == 1
    assert m("omni_sidecar_upstream_connect_failures_total") == 0
    for outcome in ("upstream_closed", "overflow", "engine_unavailable", "shutdown", "error"):
        assert m("omni_sidecar_sessions_total", {"outcome": outcome}) == 0, outcome
    assert (
        sum(
            m("omni_sidecar_overflows_total", {"policy": p})
            for p in ("close_session", "fail_response", "process_total")
        )
        == 0
    )
    assert m("omni_sidecar_sessions_active") == 0
    assert m("omni_sidecar_output_pending_bytes") == 0
    assert m("omni_sidecar_output_pending_events") == 0
    assert m("omni_sidecar_late_audio_after_eviction_total") == 0

    # Exposition: OpenMetrics on request, the classic text format otherwise.
    content_type, body = await get_metrics(
        proxy, "application/openmetrics-text; version=1.0.0; charset=utf-8"
    )
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    parsed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert parsed[("omni_sidecar_sessions_total", (("outcome", "client_closed"),))] == 1
    assert parsed[("omni_sidecar_dropped_events_total", (("reason", "late_audio"),))] == late
    content_type, body = await get_metrics(proxy)
    assert content_type.startswith("text/plain")
    assert "# EOF" not in body
    assert 'omni_sidecar_sessions_total{outcome="client_closed"} 1.0' in body


# -- a client that stops reading -----------------------------------------------------------------

OVERFLOW_LIMIT = 64 * 1024
#: One 100 ms delta of 24 kHz PCM16 in base64 plus its JSON: about 6.6 KB.
MAX_AUDIO_FRAME = 8 * 1024


async def test_overflow_of_a_stalled_client_after_a_cancelled_session(
    simulator: Any, sidecar: Any
) -> None:
    sim = await simulator(
        "--chunk-ms",
        str(CHUNK_MS),
        "--realtime-factor",
        f"{0.5 * TIMEOUT_FACTOR:g}",
        "--response-seconds",
        "30",
        "--late-audio-chunks",
        str(LATE_CHUNKS),
        "--deterministic",
    )
    proxy = await sidecar(
        upstream=sim.ws_url,
        playback_ack="off",  # see test_cancelled_response_counts
        max_pending_output_bytes=OVERFLOW_LIMIT,
        client_write_buffer_bytes=16 * 1024,
    )
    m = proxy.metric
    # A well-behaved session first: an overflow must not disturb what it counted.
    await cancelled_session(proxy.url)
    await wait_metric(proxy, "omni_sidecar_sessions_total", {"outcome": "client_closed"}, 1)
    before = snapshot(proxy)
    sim_before = await simulator_counters(sim)

    host, port = proxy.sidecar.bound["listen"]
    client = await RawClient.connect(host, port)
    for event in OPENING:
        await client.send(event)

    # The client reads nothing: /debug/sessions shows the buffer filling, then the overflow.
    samples: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http:

        async def overflowed() -> bool:
            async with http.get(f"{proxy.admin_url}/debug/sessions") as resp:
                data = await resp.json()
            if not data["sessions"]:
                return False
            (session,) = data["sessions"]
            assert data["total_pending_bytes"] == session["pending_bytes"]
            samples.append(session)
            return bool(session["overflowed"])

        await wait_until(overflowed, timeout=DEADLINE * 2, what="/debug/sessions: overflowed")
    filling = [s["pending_bytes"] for s in samples if not s["overflowed"]]
    assert len(set(filling)) >= 3, f"expected the buffer to grow while polled: {filling}"
    assert max(filling) > OVERFLOW_LIMIT // 2, filling
    assert max(filling) <= OVERFLOW_LIMIT
    last = samples[-1]
    assert OVERFLOW_LIMIT - MAX_AUDIO_FRAME < last["peak_pending_bytes"] <= OVERFLOW_LIMIT
    assert last["overflows"] == 1
    assert last["state"] == "closing"
    assert last["dropped"]["overflow"]["events"] >= 1

    # The client reads again: what was written, then the backpressure notices and 1008.
    received: list[str] = []
    while True:
        opcode, payload = await client.receive()
        if opcode == 0x8:
            close_code = struct.unpack("!H", payload[:2])[0]
            break
        assert opcode == 0x1
        received.append(payload.decode())
    await client.close(close_code)
    assert close_code == 1008
    bodies = [orjson.loads(text) for text in received]
    assert bodies[-1]["type"] == "session.closed"
    assert bodies[-1]["reason"] == "output_backpressure"
    errors = [b for b in bodies if b["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["output_backpressure"]
    failed = [b for b in bodies if b["type"] == "response.done"]
    assert [f["response"]["status"] for f in failed] == ["failed"]

    await wait_metric(proxy, "omni_sidecar_sessions_total", {"outcome": "overflow"}, 1)
    sim_after = await simulator_counters(sim)
    assert m("omni_sidecar_overflows_total", {"policy": "close_session"}) == 1
    assert m("omni_sidecar_overflows_total", {"policy": "fail_response"}) == 0
    assert m("omni_sidecar_overflows_total", {"policy": "process_total"}) == 0
    assert m("omni_sidecar_sessions_total", {"outcome": "client_closed"}) == 1
    assert m("omni_sidecar_dropped_events_total", {"reason": "overflow"}) >= 1
    assert m("omni_sidecar_dropped_bytes_total", {"reason": "overflow"}) > 0
    assert m("omni_sidecar_sessions_active") == 0
    assert m("omni_sidecar_output_pending_bytes") == 0
    assert m("omni_sidecar_output_pending_events") == 0

    # Every engine frame of this session: written to the client, or dropped.
    record = SessionRecord(sent=client.sent, received=received)
    engine = record.engine_frames()
    assert len(received) - len(engine) == 3  # ours: error, failed response.done, session.closed
    counts = delta(snapshot(proxy), before)
    sim_sent = (
        sim_after["vllm_omni_sim_events_sent_total"] - sim_before["vllm_omni_sim_events_sent_total"]
    )
    sim_bytes = (
        sim_after["vllm_omni_sim_sent_bytes_total"] - sim_before["vllm_omni_sim_sent_bytes_total"]
    )
    assert counts["u2c_events"] == sim_sent
    assert counts["u2c_events"] == len(engine) + counts["dropped_events"]
    assert counts["u2c_bytes"] == sim_bytes
    assert counts["u2c_bytes"] == sum(map(engine_size, engine)) + counts["dropped_bytes"]
    assert counts["c2u_events"] == len(client.sent)
    assert counts["c2u_bytes"] == record.sent_bytes

    dump = os.environ.get("OMNI_SIDECAR_METRICS_DUMP")
    if dump:
        _, body = await get_metrics(proxy)
        Path(dump).write_text(body)


# -- the engine crashes -------------------------------------------------------------------------


async def test_engine_crash_counts(sidecar: Any) -> None:
    crash_after = 2000 * MS
    engine = EngineConfig(
        kind="simulator",
        simulator_args=("--crash-after", f"{crash_after:.3f}", "--realtime-factor", "0"),
    )
    proxy = await sidecar(engine=engine)
    m = proxy.metric
    assert m("omni_sidecar_engine_up") == 1
    assert m("omni_sidecar_engine_state", {"state": "ready"}) == 1
    assert m("omni_sidecar_engine_start_seconds") > 0

    types: list[str] = []
    last: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http, http.ws_connect(proxy.url) as ws:
        await ws.send_str(orjson.dumps(OPENING[0]).decode())
        while True:
            msg = await ws.receive(timeout=DEADLINE)
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break
            body = orjson.loads(msg.data)
            types.append(body["type"])
            last = body
        close_code = ws.close_code
    assert types[0] == "session.created", "the engine crashed before the session opened"
    assert close_code == 1011
    assert "error" in types
    assert last["type"] == "session.closed" and last["reason"] == "engine_unavailable"

    await wait_metric(proxy, "omni_sidecar_sessions_total", {"outcome": "engine_unavailable"}, 1)
    await wait_metric(proxy, "omni_sidecar_engine_restarts_total", {"reason": "exited"}, 1)
    await wait_metric(proxy, "omni_sidecar_engine_up", {}, 1, timeout=DEADLINE * 2)
    assert m("omni_sidecar_engine_restarts_total", {"reason": "exited"}) == 1
    assert m("omni_sidecar_engine_restarts_total", {"reason": "unhealthy"}) == 0
    assert m("omni_sidecar_engine_restarts_total", {"reason": "start_failed"}) == 0
    assert m("omni_sidecar_engine_state", {"state": "ready"}) == 1
    assert m("omni_sidecar_engine_state", {"state": "restarting"}) == 0
    assert m("omni_sidecar_sessions_total", {"outcome": "client_closed"}) == 0
    assert m("omni_sidecar_sessions_total", {"outcome": "error"}) == 0
    assert m("omni_sidecar_sessions_active") == 0
    # The console's view of the same facts.
    summary = await admin_json(proxy, "/debug/summary")
    (engine_view,) = summary["engines"]
    assert engine_view["kind"] == "simulator"
    assert engine_view["state"] == "ready"
    assert engine_view["restarts"] == 1
    assert engine_view["last_failure"].startswith("exited")
    assert engine_view["uptime_seconds"] is not None and engine_view["uptime_seconds"] >= 0


# -- the admin listener: process metrics, /healthz, the console's JSON, admin_token ---------------


async def admin_get(
    proxy: RunningSidecar,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    base: str | None = None,
) -> tuple[int, Any, str]:
    """(status, headers, body text) of one GET on the admin listener (or ``base``)."""
    url = (base or proxy.admin_url) + path
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers or {}) as resp:
        return resp.status, resp.headers, await resp.text()


async def admin_json(proxy: RunningSidecar, path: str) -> Any:
    status, _headers, body = await admin_get(proxy, path)
    assert status == 200, (path, status, body)
    return orjson.loads(body)


async def test_process_metrics_and_healthz_over_a_real_scrape(simulator: Any, sidecar: Any) -> None:
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url)
    _content_type, body = await get_metrics(proxy)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parse_text_format(body)
        for s in family.samples
    }

    def one(name: str) -> float:
        return values[(name, ())]

    assert one("process_resident_memory_bytes") > 1024 * 1024
    assert one("process_virtual_memory_bytes") >= one("process_resident_memory_bytes")
    assert one("process_open_fds") > 3  # stdio and the two listening sockets at least
    assert one("process_max_fds") >= one("process_open_fds")
    assert one("process_cpu_seconds_total") > 0
    assert 0 < time.time() - one("process_start_time_seconds") < 24 * 3600
    generations = {
        dict(k[1])["generation"] for k in values if k[0] == "python_gc_collections_total"
    }
    assert generations == {"0", "1", "2"}
    assert [k for k in values if k[0] == "python_info"]
    # Our own families are still there, next to the standard ones.
    assert one("omni_sidecar_sessions_active") == 0

    status, headers, text = await admin_get(proxy, "/healthz")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert orjson.loads(text) == {"status": "ok"}


async def _open_session(
    url: str, engine: ScriptedEngine, engine_session_id: str
) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse, EngineConnection]:
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(url)
    conn = await engine.next_connection()
    await conn.send({"type": "session.created", "session": {"id": engine_session_id}})
    msg = await ws.receive(timeout=DEADLINE)
    assert orjson.loads(msg.data)["type"] == "session.created"
    return http, ws, conn


async def test_console_json_endpoints_page_and_detail(sidecar: Any) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url)
        opened = [await _open_session(proxy.url, engine, f"engine-{i}") for i in range(3)]

        summary = await admin_json(proxy, "/debug/summary")
        assert summary["version"] == 1
        assert summary["sessions"]["live"] == 3
        assert summary["sessions"]["limit"] == proxy.sidecar.settings.max_sessions
        assert summary["sessions"]["started"] == 3
        assert (
            summary["pending"]["cap_bytes"] == proxy.sidecar.settings.max_total_pending_output_bytes
        )
        assert summary["budget"]["pending_bytes"] == proxy.sidecar.settings.max_pending_output_bytes
        assert summary["totals"]["events"]["upstream_to_client"] == 3
        assert summary["totals"]["cancels"] == 0
        assert summary["ready"] is True
        (engine_view,) = summary["engines"]
        assert engine_view["kind"] == "external" and engine_view["state"] == "ready"
        assert engine_view["restarts"] == 0 and engine_view["last_failure"] is None

        page = await admin_json(proxy, "/debug/sessions")
        assert page["version"] == 1
        assert (page["live"], page["total"], page["offset"], page["limit"]) == (3, 3, 0, 500)
        assert [s["upstream_session_id"] for s in page["sessions"]] == [
            "engine-0",
            "engine-1",
            "engine-2",
        ]
        assert all(s["client_address"] == "127.0.0.1" for s in page["sessions"])
        ids = [s["id"] for s in page["sessions"]]
        first = await admin_json(proxy, "/debug/sessions?limit=2")
        rest = await admin_json(proxy, "/debug/sessions?offset=2&limit=2")
        assert [s["id"] for s in first["sessions"] + rest["sessions"]] == ids
        assert first["total"] == rest["total"] == 3
        found = await admin_json(proxy, "/debug/sessions?q=engine-1")
        assert [s["id"] for s in found["sessions"]] == [ids[1]] and found["total"] == 1
        for bad in ("limit=501", "limit=-1", "offset=x"):
            status, _h, body = await admin_get(proxy, f"/debug/sessions?{bad}")
            assert status == 400, bad
            assert orjson.loads(body)["error"]["code"] == "bad_request"

        # A cancel and a close show up in the session's lifecycle, with timestamps.
        http, ws, conn = opened[0]
        await conn.send({"type": "response.created", "response": {"id": "resp_1"}})
        await ws.send_str(
            orjson.dumps({"type": "response.cancel", "response_id": "resp_1"}).decode()
        )
        assert (await conn.receive_event())["type"] == "response.cancel"

        async def cancelled() -> bool:
            detail = await admin_json(proxy, f"/debug/sessions/{ids[0]}")
            return any(e["kind"] == "cancel" for e in detail["session"]["events"])

        await wait_until(cancelled, what="a cancel in the session's lifecycle")
        detail = await admin_json(proxy, f"/debug/sessions/{ids[0]}")
        assert detail["live"] is True
        kinds = [e["kind"] for e in detail["session"]["events"]]
        assert kinds == ["created", "engine_session", "cancel"]
        assert detail["session"]["events"][2]["detail"] == "response resp_1"
        now = time.time()
        assert all(now - 60 < e["at"] <= now for e in detail["session"]["events"])
        assert (await admin_json(proxy, "/debug/summary"))["totals"]["cancels"] == 1

        await ws.close()
        await http.close()
        await wait_until(lambda: len(proxy.sidecar.sessions.relays) == 2, what="session 0 ended")
        ended = await admin_json(proxy, f"/debug/sessions/{ids[0]}")
        assert ended["live"] is False
        assert ended["session"]["events"][-1]["kind"] == "close"
        assert "outcome client_closed" in ended["session"]["events"][-1]["detail"]
        status, _h, _b = await admin_get(proxy, "/debug/sessions/no-such-session")
        assert status == 404
        for http, ws, _conn in opened[1:]:
            await ws.close()
            await http.close()
    finally:
        await engine.aclose()


async def test_console_page_is_served_with_a_strict_policy(sidecar: Any) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url)
        status, headers, page = await admin_get(proxy, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        policy = headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert headers["X-Content-Type-Options"] == "nosniff"
        # Self-contained: nothing from another origin, no inline script or style.
        assert (
            "http://" not in page
            and "https://" not in page
            and "//" not in page.replace("<!doctype", "")
        )
        assert "<script>" not in page and "<style" not in page and " style=" not in page
        for path, kind in (
            ("/console/console.js", "text/javascript"),
            ("/console/console.css", "text/css"),
        ):
            status, headers, body = await admin_get(proxy, path)
            assert status == 200 and headers["Content-Type"].startswith(kind), path
            assert "innerHTML" not in body and "http" not in body.replace("HTTP ", "")
        status, _h, _b = await admin_get(proxy, "/console/index.html")
        assert status == 404
        status, _h, _b = await admin_get(proxy, "/console/../admin.py")
        assert status == 404
    finally:
        await engine.aclose()


ADMIN_PATHS = (
    "/",
    "/console/console.js",
    "/metrics",
    "/healthz",
    "/debug/summary",
    "/debug/sessions",
    "/debug/sessions/x",
)


async def test_console_and_debug_endpoints_are_never_on_the_client_listener(sidecar: Any) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url)
        for path in ADMIN_PATHS:
            if path == "/healthz":
                continue  # the client listener has its own liveness answer
            status, headers, body = await admin_get(proxy, path, base=proxy.http_url)
            # Reverse-proxied to the engine like any other path: the engine answered.
            assert headers.get("X-Scripted-Engine") == "1", (path, status, body[:200])
            assert "Content-Security-Policy" not in headers
            assert "omni_sidecar_" not in body and "omni-sidecar console" not in body
    finally:
        await engine.aclose()


async def test_admin_token_protects_the_whole_admin_listener(sidecar: Any) -> None:
    engine = await ScriptedEngine().start()
    token = "t0ken-for-the-test"
    try:
        proxy = await sidecar(upstream=engine.ws_url, admin_token=token)
        basic = base64.b64encode(f"operator:{token}".encode()).decode()
        wrong_basic = base64.b64encode(b"operator:nope").decode()
        for path in ADMIN_PATHS:
            for headers in (
                {},
                {"Authorization": "Bearer nope"},
                {"Authorization": f"Basic {wrong_basic}"},
                {"Authorization": token},
            ):
                status, got, body = await admin_get(proxy, path, headers)
                assert status == 401, (path, headers)
                assert "Bearer" in got["WWW-Authenticate"] and "Basic" in got["WWW-Authenticate"]
                assert token not in body
            for headers in (
                {"Authorization": f"Bearer {token}"},
                {"Authorization": f"Basic {basic}"},
            ):
                status, _got, _body = await admin_get(proxy, path, headers)
                assert status == (404 if path == "/debug/sessions/x" else 200), (path, headers)
        # The client listener is not affected by the admin token.
        async with aiohttp.ClientSession() as http, http.ws_connect(proxy.url) as ws:
            conn = await engine.next_connection()
            await conn.send({"type": "session.created", "session": {"id": "s1"}})
            message = await ws.receive(timeout=DEADLINE)
            assert orjson.loads(message.data)["type"] == "session.created"
    finally:
        await engine.aclose()


async def test_playback_lead_is_shown_when_pacing_is_on(sidecar: Any) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url, playback_pacing=True)
        off = await sidecar(upstream=engine.ws_url)
        http, ws, conn = await _open_session(proxy.url, engine, "paced")
        one_second = base64.b64encode(bytes(48_000)).decode()  # pcm16 at 24 kHz
        await conn.send({"type": "response.created", "response": {"id": "resp_1"}})
        for _ in range(2):
            await conn.send(
                {
                    "type": "response.output_audio.delta",
                    "response_id": "resp_1",
                    "item_id": "item_1",
                    "delta": one_second,
                }
            )

        async def leading() -> bool:
            page = await admin_json(proxy, "/debug/sessions")
            lead = page["sessions"][0]["playback_lead_ms"]
            return lead is not None and lead > 0

        await wait_until(leading, what="a playback lead above 0 with pacing on")
        (session,) = (await admin_json(proxy, "/debug/sessions"))["sessions"]
        assert 0 < session["playback_lead_ms"] <= 2000
        assert session["playback"]["pacing"] is True

        http2, ws2, _conn2 = await _open_session(off.url, engine, "unpaced")
        (unpaced,) = (await admin_json(off, "/debug/sessions"))["sessions"]
        assert unpaced["playback_lead_ms"] is None
        for client, socket_ in ((http, ws), (http2, ws2)):
            await socket_.close()
            await client.close()
    finally:
        await engine.aclose()


# -- bounds of the console's JSON, socket-free ----------------------------------------------------


def _fake_registry(sessions: int) -> Any:
    """A registry holding ``sessions`` idle sessions (real cores, fake relays)."""
    import types

    from prometheus_client import CollectorRegistry

    from metrics import SidecarMetrics
    from proxy.core.session_core import SessionCore, SessionSettings
    from proxy.session.registry import SessionRegistry

    registry = SessionRegistry(
        SidecarMetrics(CollectorRegistry(), process_metrics=False),
        max_total_pending_output_bytes=0,
    )
    for i in range(sessions):
        key = f"s{i:04d}"
        relay = types.SimpleNamespace(
            key=key,
            view=SessionCore(SessionSettings(), new_event_id=lambda: "e"),
            started_at=time.monotonic(),
        )
        registry.add(relay)
        registry.observer(key, client_address=f"10.0.{i // 256}.{i % 256}")
    return registry


async def test_sessions_are_paged_above_500_and_lifecycles_are_bounded() -> None:
    import types

    from proxy.admin.console import MAX_PAGE_SESSIONS, sessions_page
    from proxy.session.observer import LIFECYCLE_EVENTS
    from proxy.settings import Settings

    registry = _fake_registry(MAX_PAGE_SESSIONS + 1)
    state: Any = types.SimpleNamespace(registry=registry, settings=Settings())
    first = await sessions_page(state, offset=0, limit=MAX_PAGE_SESSIONS, query="")
    rest = await sessions_page(state, offset=MAX_PAGE_SESSIONS, limit=MAX_PAGE_SESSIONS, query="")
    assert (first["live"], first["total"], len(first["sessions"])) == (501, 501, 500)
    assert [s["id"] for s in rest["sessions"]] == ["s0500"]
    assert len(orjson.dumps(first)) < 1024 * 1024  # one page stays well under a MiB
    found = await sessions_page(state, offset=0, limit=10, query="10.0.1.244")
    assert [s["id"] for s in found["sessions"]] == ["s0500"] and found["total"] == 1

    observer = registry._observers["s0000"]
    for i in range(LIFECYCLE_EVENTS + 10):
        observer.note("cancel", f"response r{i}")
    events = registry.detail("s0000")["events"]
    assert len(events) == LIFECYCLE_EVENTS == 50
    assert events[-1]["detail"] == f"response r{LIFECYCLE_EVENTS + 9}"  # the newest are kept
