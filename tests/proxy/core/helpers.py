"""Frame builders and a ``SessionPair`` harness for the core's tests.

Builders return the frame *text* exactly as it would travel on the wire, in
the engine's own shapes (vLLM-Omni 0.30, docs/engine-protocol.md, Conventions). ``SessionPair``
plays
both shells around a ``SessionCore`` (like h11's ``ConnectionPair``): feed it
engine frames and client frames, drain what the proxy writes to the client and
what it sends upstream, and assert on those.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.core.buffer import BufferLimits, Entry
from proxy.core.capabilities import EngineCapabilities, EngineVersion
from proxy.core.drain import Drain
from proxy.core.events import UpstreamEvent, classify_upstream
from proxy.core.lifecycle import EndReason, Fact
from proxy.core.playback_state import AckErrorCode, AckMode, PlaybackSettings
from proxy.core.session_core import ClientDecision, OverflowPolicy, SessionCore, SessionSettings
from proxy.core.telemetry import DropReason

__all__ = [
    "Delivered",
    "SessionPair",
    "audio",
    "audio_of",
    "audio_payload",
    "b_audio_append",
    "b_barge_in",
    "b_input_cancel",
    "b_output_audio_buffer_clear",
    "b_response_cancel",
    "b_response_create",
    "b_session_close",
    "b_turn_signal",
    "dumps",
    "error",
    "event",
    "make_settings",
    "other",
    "output_audio_buffer_cleared",
    "overlap_decision",
    "rate_limits_updated",
    "response_created",
    "response_done",
    "session_closed",
    "session_created",
    "sized",
    "sized_event",
    "speech_started",
    "transcript_delta",
    "types",
]


def dumps(body: dict[str, Any], *, spaced: bool = False) -> str:
    """Compact JSON (like orjson and the engine), or with ``", "``/``": "`` spacing."""
    if spaced:
        return json.dumps(body, ensure_ascii=False)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def audio_payload(n_chars: int, seed: int = 0) -> str:
    """Base64 text of exactly ``n_chars`` characters (a multiple of 4)."""
    if n_chars % 4:
        raise ValueError("base64 length must be a multiple of 4")
    raw = bytes((seed + i * 7) % 256 for i in range(n_chars // 4 * 3))
    return base64.b64encode(raw).decode()


# -- engine → client --------------------------------------------------------------------


def audio(
    response_id: str,
    n_chars: int = 16,
    *,
    seq: int = 0,
    beta: bool = False,
    spaced: bool = False,
) -> str:
    """``response.output_audio.delta`` (``response.audio.delta`` when beta)."""
    body = {
        "type": "response.audio.delta" if beta else "response.output_audio.delta",
        "event_id": f"event_a{seq}",
        "response_id": response_id,
        "item_id": f"item_{response_id}",
        "output_index": 0,
        "content_index": 0,
        "delta": audio_payload(n_chars, seed=seq),
        "format": "pcm16",
        "sample_rate_hz": 24000,
        "metadata": {"epoch": 1, "audio_duration_ms": 80},
    }
    return dumps(body, spaced=spaced)


def transcript_delta(response_id: str, text: str = "hi", *, seq: int = 0) -> str:
    return dumps(
        {
            "type": "response.output_audio_transcript.delta",
            "event_id": f"event_t{seq}",
            "response_id": response_id,
            "item_id": f"item_{response_id}",
            "delta": text,
        }
    )


def response_created(response_id: str) -> str:
    return dumps(
        {
            "type": "response.created",
            "event_id": f"event_c_{response_id}",
            "response_id": response_id,
            "response": {
                "id": response_id,
                "object": "realtime.response",
                "status": "in_progress",
            },
        }
    )


def response_done(response_id: str, status: str = "completed", *, reason: str | None = None) -> str:
    details = None if reason is None else {"type": status, "reason": reason}
    return dumps(
        {
            "type": "response.done",
            "event_id": f"event_d_{response_id}",
            "response_id": response_id,
            "response": {
                "id": response_id,
                "object": "realtime.response",
                "status": status,
                "status_details": details,
                "output": [],
            },
        }
    )


def error(code: str = "engine_error", err_type: str = "server_error", *, pad: int = 0) -> str:
    return dumps(
        {
            "type": "error",
            "event_id": "event_err",
            "error": {"type": err_type, "code": code, "message": "x" * pad},
        }
    )


def session_created(session_id: str = "duplex-abc") -> str:
    return dumps({"type": "session.created", "event_id": "event_sc", "session": {"id": session_id}})


def session_closed(reason: str = "client_close", session_id: str = "duplex-abc") -> str:
    return dumps(
        {
            "type": "session.closed",
            "event_id": "event_closed",
            "session_id": session_id,
            "reason": reason,
            "event": {},
        }
    )


def output_audio_buffer_cleared(response_id: str | None = None) -> str:
    body: dict[str, Any] = {"type": "output_audio_buffer.cleared", "event_id": "event_oc"}
    if response_id is not None:
        body["response_id"] = response_id
    return dumps(body)


def overlap_decision(action: str = "barge_in") -> str:
    return dumps(
        {
            "type": "overlap.decision",
            "event_id": "event_od",
            "epoch": 2,
            "policy": "barge_in_on_speech",
            "action": action,
            "reason": "speech",
        }
    )


def speech_started() -> str:
    return dumps(
        {
            "type": "input_audio_buffer.speech_started",
            "event_id": "event_ss",
            "audio_start_ms": 100,
            "item_id": "item_u1",
        }
    )


def rate_limits_updated() -> str:
    return dumps({"type": "rate_limits.updated", "event_id": "event_rl", "rate_limits": []})


def other(type_: str = "session.updated", *, pad: int = 0) -> str:
    return dumps({"type": type_, "event_id": "event_o", "pad": "p" * pad})


def sized(body: dict[str, Any], size: int) -> str:
    """``body`` as compact JSON padded (field ``pad``) to exactly ``size`` bytes."""
    body = {**body, "pad": ""}
    base = len(dumps(body).encode())
    if size < base:
        raise ValueError(f"smallest frame of this shape is {base} bytes")
    body["pad"] = "p" * (size - base)
    text = dumps(body)
    assert len(text.encode()) == size
    return text


def sized_event(
    kind: str, size: int, response_id: str | None = None, *, seq: int = 0
) -> UpstreamEvent:
    """A classified engine event of exactly ``size`` bytes.

    kind: ``audio``, ``transcript``, ``done``, ``error``, ``created``, ``other``.
    """
    body: dict[str, Any]
    if kind == "audio":
        body = {"type": "response.output_audio.delta", "response_id": response_id, "delta": "AAAA"}
    elif kind == "transcript":
        body = {"type": "response.output_audio_transcript.delta", "response_id": response_id}
    elif kind == "done":
        body = {
            "type": "response.done",
            "response_id": response_id,
            "response": {"status": "completed"},
        }
    elif kind == "created":
        body = {"type": "response.created", "response_id": response_id}
    elif kind == "error":
        body = {"type": "error", "error": {"type": "server_error", "code": "x"}}
    elif kind == "other":
        body = {"type": "rate_limits.updated"}
    else:
        raise ValueError(kind)
    body["seq"] = seq
    return classify_upstream(sized(body, size))


def event(text: str) -> UpstreamEvent:
    """Classify an engine frame (shorthand for tests of the buffer)."""
    return classify_upstream(text)


# -- client → engine ------------------------------------------------------------------------


def b_response_cancel(response_id: str | None = None) -> str:
    body: dict[str, Any] = {"type": "response.cancel", "event_id": "evt_cancel"}
    if response_id is not None:
        body["response_id"] = response_id
    return dumps(body)


def b_output_audio_buffer_clear(response_id: str | None = None) -> str:
    body: dict[str, Any] = {"type": "output_audio_buffer.clear"}
    if response_id is not None:
        body["response_id"] = response_id
    return dumps(body)


def b_barge_in() -> str:
    return dumps({"type": "barge_in"})


def b_turn_signal(signal: Any = "barge_in", *, alias: bool = False) -> str:
    return dumps(
        {"type": "signal_turn" if alias else "turn.signal", "event": signal, "payload": {}}
    )


def b_input_cancel() -> str:
    return dumps({"type": "input.cancel"})


def b_response_create() -> str:
    return dumps({"type": "response.create", "event_id": "evt_create", "response": {}})


def b_audio_append(n_chars: int = 16, *, spaced: bool = False) -> str:
    return dumps(
        {"type": "input_audio_buffer.append", "audio": audio_payload(n_chars)}, spaced=spaced
    )


def b_session_close() -> str:
    return dumps({"type": "session.close", "reason": "client_close"})


# -- harness -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivered:
    """One event the proxy wrote to the client."""

    text: str
    body: dict[str, Any]
    closure: bool

    @property
    def type(self) -> str:
        t = self.body.get("type")
        return t if isinstance(t, str) else ""

    @property
    def response_id(self) -> str | None:
        rid = self.body.get("response_id")
        return rid if isinstance(rid, str) else None

    @property
    def is_audio(self) -> bool:
        return self.type in ("response.output_audio.delta", "response.audio.delta")


def make_settings(
    *,
    max_bytes: int = 2 * 1024 * 1024,
    max_events: int = 512,
    reserve_bytes: int = 64 * 1024,
    reserve_events: int = 8,
    policy: OverflowPolicy = OverflowPolicy.CLOSE_SESSION,
    interrupt_on_speech_started: bool = False,
    max_tombstones: int = 256,
    tombstone_ttl: float = 60.0,
) -> SessionSettings:
    return SessionSettings(
        buffer=BufferLimits(
            max_pending_output_bytes=max_bytes,
            max_pending_output_events=max_events,
            output_reserve_bytes=reserve_bytes,
            output_reserve_events=reserve_events,
        ),
        overflow_policy=policy,
        interrupt_on_speech_started=interrupt_on_speech_started,
        max_tombstones=max_tombstones,
        tombstone_ttl=tombstone_ttl,
        # The rules under test one at a time: the limits a deployment runs with are off.
        max_input_audio_rate=0.0,
        max_client_frame_rate=0.0,
        max_pending_input_bytes=0,
        client_resume_grace=0.0,
        playback=PlaybackSettings(ack=AckMode.OFF),
    )


@dataclass
class SessionPair:
    """A SessionCore with both shells played by the test.

    ``now`` is the test's clock; ``tick`` advances it. ``deliveries`` keeps
    everything written to the client, ``upstream_sent`` everything the proxy
    itself sent to the engine, ``forwarded`` the client frames forwarded.
    """

    settings: SessionSettings = field(default_factory=make_settings)
    capabilities: EngineCapabilities | None = None
    now: float = 0.0
    core: SessionCore = field(init=False)
    deliveries: list[Delivered] = field(default_factory=list)
    upstream_sent: list[dict[str, Any]] = field(default_factory=list)
    forwarded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._drops: dict[DropReason, tuple[int, int]] = {}
        self._own_errors: list[AckErrorCode] = []
        self._learned: EngineVersion | None = None
        self._silence: list[float] = []
        self._first_audio: list[float] = []
        self._lead_at_cancel: list[float] = []
        ids = itertools.count(1)
        self.core = SessionCore(
            self.settings,
            new_event_id=lambda: f"event_proxy_{next(ids)}",
            capabilities=self.capabilities,
        )

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def upstream(self, *frames: str) -> list[UpstreamEvent]:
        """Feed engine frames in order."""
        out = [self.core.receive_upstream(f, self.now) for f in frames]
        self.collect_upstream()
        return out

    def client(self, frame: str) -> ClientDecision:
        """Feed one client frame; forwarded frames are recorded apart from the proxy's own."""
        decision = self.core.receive_client(frame, self.now)
        self._record_upstream(self._drain(0).to_upstream, frame)
        return decision

    def timer(self) -> float | None:
        """The core's timer at ``now`` (acks due, paced audio); returns the next deadline."""
        self.core.receive(Fact.TIMER, self.now)
        return self.deadline()

    def deadline(self) -> float | None:
        """The next deadline as a drain says it (what the proxy sends meanwhile is recorded)."""
        out = self._drain(0)
        self._record_upstream(out.to_upstream)
        return out.deadline

    def fact(self, fact: Fact | EndReason, *, amount: int = 0) -> bool:
        """Report a lifecycle fact at ``now``; what the proxy sends upstream is recorded."""
        answer = self.core.receive(fact, self.now, amount=amount)
        self.collect_upstream()
        return answer

    def resume(self, cursor: int) -> tuple[bool, str | None]:
        """A client resumes at ``cursor`` (``SessionCore.attach``)."""
        return self.core.attach(cursor, self.now)

    def take(self) -> Entry | None:
        """Drain one event for the client (room for one): written as it is taken."""
        out = self._drain(1)
        self._record_upstream(out.to_upstream)
        return out.to_client[0] if out.to_client else None

    def write(self, entry: Entry) -> Delivered:
        """Record ``entry`` as the client received it."""
        d = Delivered(entry.event.text, json.loads(entry.event.text), entry.closure)
        self.deliveries.append(d)
        return d

    def deliver(self, n: int | None = None) -> list[Delivered]:
        """Write up to ``n`` events (all that are ready when None).

        Bounded by what the buffer holds (plus the closure notice): a buffer
        that keeps producing fails the test at once instead of growing memory.
        """
        limit = self.core.buffer.pending_events + 2 if n is None else n
        out: list[Delivered] = []
        while len(out) < limit:
            entry = self.take()
            if entry is None:
                return out
            out.append(self.write(entry))
        if n is None and self.take() is not None:
            raise AssertionError(f"the buffer produced more than the {limit} events it held")
        return out

    def collect_upstream(self) -> None:
        """Record what the proxy must send upstream (after a direct ``core`` call)."""
        self._record_upstream(self._drain(0).to_upstream)

    # What the drains reported (the observer's side), taken like the core's own takes.

    def take_drops(self) -> dict[DropReason, tuple[int, int]]:
        self.collect_upstream()
        out, self._drops = self._drops, {}
        return out

    def take_own_errors(self) -> list[AckErrorCode]:
        self.collect_upstream()
        out, self._own_errors = self._own_errors, []
        return out

    def take_learned(self) -> EngineVersion | None:
        self.collect_upstream()
        out, self._learned = self._learned, None
        return out

    def take_observations(self) -> tuple[list[float], list[float]]:
        """(cancel_to_silence, first_audio) seconds reported since the last call."""
        self.collect_upstream()
        out = (self._silence, self._first_audio)
        self._silence, self._first_audio = [], []
        return out

    def take_lead_at_cancel(self) -> list[float]:
        self.collect_upstream()
        out, self._lead_at_cancel = self._lead_at_cancel, []
        return out

    def _drain(self, room: int) -> Drain:
        out = self.core.drain(self.now, room)
        report = out.report
        if report is not None:
            for reason, (events, size) in report.drops.items():
                before = self._drops.get(reason, (0, 0))
                self._drops[reason] = (before[0] + events, before[1] + size)
            self._own_errors.extend(report.own_ack_errors)
            self._learned = report.learned or self._learned
            self._silence.extend(report.silence)
            self._first_audio.extend(report.first_audio)
            self._lead_at_cancel.extend(report.lead_at_cancel)
        return out

    def _record_upstream(self, frames: Sequence[str], forwarded: str | None = None) -> None:
        for frame in frames:
            if frame is forwarded:
                self.forwarded.append(frame)
            else:
                self.upstream_sent.append(json.loads(frame))


def types(deliveries: list[Delivered]) -> list[str]:
    return [d.type for d in deliveries]


def audio_of(deliveries: list[Delivered], response_id: str) -> list[Delivered]:
    return [d for d in deliveries if d.is_audio and d.response_id == response_id]
