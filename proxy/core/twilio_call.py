"""One phone call over Twilio Media Streams, sans-I/O (docs/design.md, Phone front door).

:class:`TwilioCall` translates one stream both ways: Twilio's messages into
the session's client events (the caller's mu-law in the engine's input
format, a turn's end as a commit, ``stop`` as ``session.close``, echoed marks
as ``playback.ack``) and frames Twilio gets at once (``clear`` on a barge-in
the sidecar heard); the engine's events into Twilio frames (160-byte mu-law
``media`` with a ``mark`` per engine chunk, ``clear`` on the engine's
barge-in). The caller's turns are found by the sidecar's turn detector
(proxy/core/turns.py) on the mu-law at 8 kHz. Interpreted in both builds,
like the audio modules it uses; no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from proxy.core.audio_convert import (
    TWILIO_FRAME_BYTES,
    TWILIO_FRAME_MS,
    AudioConverter,
    FrameCutter,
)
from proxy.core.audio_formats import (
    G711_ULAW,
    AudioError,
    AudioFormat,
    Encoding,
    decode_base64,
    decode_samples,
    encode_base64,
    parse_engine_audio,
    parse_engine_format,
)
from proxy.core.turns import (
    CommitInput,
    CreateResponse,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
)

__all__ = [
    "AUDIO_DELTAS",
    "ENGINE_GRACE_FRAMES",
    "MAX_MARKS",
    "BargeIn",
    "CallOptions",
    "CallStart",
    "Inbound",
    "TwilioCall",
    "parse_start",
    "parse_twilio",
]

#: The engine's audio delta events (GA and beta names).
AUDIO_DELTAS: Final = frozenset({"response.output_audio.delta", "response.audio.delta"})
_AUDIO_DONE: Final = frozenset({"response.output_audio.done", "response.audio.done"})
#: Engine events that mean the answer being played is over now (docs/design.md, Cancellation).
_BARGE_IN: Final = frozenset({"input_audio_buffer.speech_started", "output_audio_buffer.cleared"})
#: Marks in flight (sent, not yet echoed); past it the oldest is forgotten.
MAX_MARKS: Final = 1024
#: Frames of the caller's speech over an answer (20 ms each: 200 ms) the engine's own
#: voice detection has to barge in before the sidecar does.
ENGINE_GRACE_FRAMES: Final = 10
#: Cancelled response ids remembered (their late audio never reaches Twilio).
_MAX_CANCELLED: Final = 256
#: The engine's output when it has not said (docs/design.md, Playback).
_DEFAULT_OUTPUT: Final = AudioFormat(Encoding.PCM16, 24_000)
#: What ``start`` must announce (docs/clients.md, Phone calls).
_TWILIO_ENCODING: Final = "audio/x-mulaw"


def parse_twilio(text: str) -> dict[str, Any] | None:
    """A Twilio message (a JSON object with a string ``event``), else None."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("event"), str):
        return None
    return body


@dataclass(frozen=True, slots=True)
class CallStart:
    """What Twilio's ``start`` message says about the stream."""

    stream_sid: str
    call_sid: str = ""
    account_sid: str = ""
    custom: Mapping[str, str] = field(default_factory=dict)


def parse_start(body: Mapping[str, Any]) -> CallStart | str:
    """``start``: the stream's ids and ``customParameters``; a refusal as text.

    The media format must be mu-law at 8 kHz, mono (what ``<Connect><Stream>`` sends).
    """
    start = body.get("start")
    sid = body.get("streamSid")
    if not isinstance(start, dict):
        return "start has no start object"
    sid = start.get("streamSid", sid)
    if not isinstance(sid, str) or not sid:
        return "start has no streamSid"
    media = start.get("mediaFormat")
    if isinstance(media, dict):
        encoding, rate, channels = (
            media.get("encoding"),
            media.get("sampleRate"),
            media.get("channels", 1),
        )
        if encoding != _TWILIO_ENCODING or rate != G711_ULAW.rate or channels != 1:
            return f"unsupported mediaFormat {encoding!r} {rate!r} Hz x{channels!r}"
    custom = start.get("customParameters")
    params = (
        {str(k): v for k, v in custom.items() if isinstance(v, str)}
        if isinstance(custom, dict)
        else {}
    )
    call_sid, account_sid = start.get("callSid"), start.get("accountSid")
    return CallStart(
        sid,
        call_sid if isinstance(call_sid, str) else "",
        account_sid if isinstance(account_sid, str) else "",
        params,
    )


class BargeIn(enum.Enum):
    """Who hears the caller speak over an answer (``twilio_turn_detection``)."""

    #: The engine's voice detection (``turn_detection`` server_vad); the sidecar
    #: clears only what the engine does not (after ``ENGINE_GRACE_FRAMES``).
    ENGINE = "engine"
    #: The sidecar's turn detector at once; the engine is asked for none.
    SIDECAR = "sidecar"


# -- the call ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CallOptions:
    """The session a call opens: from settings, overridden by ``customParameters``."""

    engine_input: AudioFormat
    barge_in: BargeIn = BargeIn.ENGINE
    model: str = ""
    voice: str = ""
    instructions: str = ""


@dataclass(slots=True)
class Inbound:
    """What one Twilio message comes to: client events for the session, frames for
    Twilio now, and whether the stream stopped."""

    engine: list[str] = field(default_factory=list)
    twilio: list[str] = field(default_factory=list)
    stopped: bool = False


@dataclass(slots=True)
class _Mark:
    name: str
    response_id: str
    #: Engine milliseconds of the response played once Twilio echoes it.
    played_ms: int
    cleared: bool = False


class TwilioCall:
    """One stream's translation both ways; see the module docstring.

    Args:
        start: the stream's ``start``.
        options: the engine session it opens.
        turns: the sidecar's turn detector over the caller's audio, at 8 kHz
            (proxy/core/turns.py; its ``create_response`` decides the commit's).
    """

    def __init__(self, start: CallStart, options: CallOptions, turns: TurnDetector) -> None:
        self.start = start
        self.options = options
        self.turns = turns
        self._sid = start.stream_sid
        self._input = AudioConverter(G711_ULAW, options.engine_input)
        self._output_format = _DEFAULT_OUTPUT
        self._output: AudioConverter | None = None
        self._cutter = FrameCutter(TWILIO_FRAME_BYTES, b"\xff")
        #: The response whose audio is being cut into frames, its engine ms taken so
        #: far, and the frames of it sent (20 ms each: the caller's timebase).
        self._playing: str | None = None
        self._sent_ms = 0.0
        self._response_frames = 0
        self._marks: deque[_Mark] = deque()
        self._mark_seq = 0
        #: Marks in ``_marks`` no clear dropped: Twilio still holds audio before them.
        self._unheard = 0
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        #: Responses the engine created and has not finished.
        self._open: set[str] = set()
        self._speaking = False
        #: Frames of the caller's speech since it started, and how many the engine's
        #: own detection has before the sidecar barges in (0: the sidecar's alone).
        self._speech_frames = 0
        self._grace = ENGINE_GRACE_FRAMES if options.barge_in is BargeIn.ENGINE else 0
        #: Counters for the session's report.
        self.clears = 0
        self.clears_by_sidecar = 0
        self.frames_sent = 0
        self.marks_heard = 0
        self.dtmf = 0

    # -- the session it opens --------------------------------------------------------------

    def session_update(self) -> str:
        """The first client event: the engine session this call needs."""
        opts = self.options
        session: dict[str, Any] = {
            "input_audio_format": opts.engine_input.encoding.value,
            "sample_rate_hz": opts.engine_input.rate,
            "turn_detection": ({"type": "server_vad"} if opts.barge_in is BargeIn.ENGINE else None),
        }
        if opts.model:
            session["model"] = opts.model
        if opts.voice:
            session["voice"] = opts.voice
        if opts.instructions:
            session["instructions"] = opts.instructions
        return _dumps({"type": "session.update", "session": session})

    @property
    def playing(self) -> bool:
        """The caller hears (or is about to hear) an answer: audio Twilio has not
        played yet, or a response the engine is still producing."""
        return self._unheard > 0 or bool(self._open)

    # -- Twilio to the session ---------------------------------------------------------------

    def from_twilio(self, body: Mapping[str, Any]) -> Inbound:
        """One parsed Twilio message (:func:`parse_twilio`)."""
        out = Inbound()
        event = body.get("event")
        if event == "media":
            self._media(body, out)
        elif event == "mark":
            mark = body.get("mark")
            name = mark.get("name") if isinstance(mark, dict) else None
            if isinstance(name, str):
                self._mark_echoed(name, out)
        elif event == "stop":
            out.engine.append(_dumps({"type": "session.close", "reason": "twilio_stop"}))
            out.stopped = True
        elif event == "dtmf":
            self.dtmf += 1
        return out

    def _media(self, body: Mapping[str, Any], out: Inbound) -> None:
        media = body.get("media")
        if not isinstance(media, dict):
            return
        track = media.get("track", "inbound")
        if track not in ("inbound", "inbound_track"):
            return
        raw = decode_base64(media.get("payload"))
        if isinstance(raw, AudioError) or not raw:
            return
        samples = decode_samples(Encoding.MULAW, raw)
        turns = self.turns
        turns.receive_response_active(self.playing)
        events = [] if isinstance(samples, AudioError) else turns.receive_samples(samples)
        converted = self._input.convert(raw)
        if isinstance(converted, bytes) and converted:
            out.engine.append(_append(converted))
        started = commit = create = False
        for event in events:
            if isinstance(event, SpeechStarted):
                started = self._speaking = True
                self._speech_frames = 0
            elif isinstance(event, SpeechStopped):
                self._speaking = False
            elif isinstance(event, CommitInput):
                commit = True
            elif isinstance(event, CreateResponse):
                create = True
        if self._speaking and not started:
            self._speech_frames += 1
        if self._speaking and self._speech_frames == self._grace and self.playing:
            # Speech over an answer: the sidecar barges in at once, or, where the
            # engine listens, once the engine had its grace and did not (it had
            # finished generating: what Twilio still plays is the sidecar's to clear).
            clear = self._clear(list(self._open))
            self.clears_by_sidecar += len(clear)
            out.twilio.extend(clear)
            out.engine.append(_dumps({"type": "response.cancel"}))
        if commit:
            tail = self._input.flush()
            if tail:
                out.engine.append(_append(tail))
            commit_event: dict[str, Any] = {"type": "input_audio_buffer.commit"}
            if create:
                commit_event["response_create"] = True
            out.engine.append(_dumps(commit_event))

    def _mark_echoed(self, name: str, out: Inbound) -> None:
        """Twilio played everything before mark ``name`` (or a ``clear`` dropped it)."""
        marks = self._marks
        if not any(m.name == name for m in marks):
            return
        while marks:
            mark = marks.popleft()
            if not mark.cleared:
                self._unheard -= 1
            if mark.name == name:
                if not mark.cleared:
                    self.marks_heard += 1
                    ack = {
                        "type": "playback.ack",
                        "response_id": mark.response_id,
                        "played_ms": mark.played_ms,
                    }
                    out.engine.append(_dumps(ack))
                return

    # -- the session to Twilio ---------------------------------------------------------------

    def to_twilio(self, text: str) -> list[str]:
        """One engine event the session delivered; returns the frames for Twilio."""
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            return []
        if not isinstance(body, dict):
            return []
        kind = body.get("type")
        rid = body.get("response_id")
        rid = rid if isinstance(rid, str) else None
        if kind in AUDIO_DELTAS:
            return self._audio(body, rid)
        if kind in _AUDIO_DONE:
            return self._finish(rid)
        if kind == "response.created":
            response = body.get("response")
            created = response.get("id") if isinstance(response, dict) else None
            if isinstance(created, str) and created not in self._cancelled:
                self._open.add(created)
            return []
        if kind == "response.done":
            response = body.get("response")
            done = response.get("id") if isinstance(response, dict) else rid
            status = response.get("status") if isinstance(response, dict) else None
            if isinstance(done, str):
                self._open.discard(done)
                if status in ("cancelled", "failed"):
                    return self._clear([done])
                return self._finish(done)
            return []
        if kind in _BARGE_IN or (kind == "overlap.decision" and body.get("action") == "barge_in"):
            return self._clear(list(self._open) if rid is None else [rid])
        if kind in ("session.created", "session.updated"):
            self._learn_output(body)
        return []

    def _learn_output(self, body: Mapping[str, Any]) -> None:
        session = body.get("session")
        audio = session.get("audio") if isinstance(session, dict) else None
        out = audio.get("output") if isinstance(audio, dict) else None
        if out is None:
            return
        fmt = parse_engine_audio(out)
        if isinstance(fmt, AudioFormat) and fmt != self._output_format:
            self._output_format = fmt
            self._output = None

    def _audio(self, body: Mapping[str, Any], rid: str | None) -> list[str]:
        if rid is None or rid in self._cancelled:
            return []  # a cancelled answer's late audio: never to the caller
        raw = decode_base64(body.get("delta"))
        if isinstance(raw, AudioError):
            return []
        fmt = self._output_format
        if "format" in body or "sample_rate_hz" in body:
            own = parse_engine_format(
                body.get("format", fmt.encoding.value), body.get("sample_rate_hz", fmt.rate)
            )
            if isinstance(own, AudioFormat):
                fmt = own
        if rid != self._playing:
            self._start_response(rid)
        converter = self._output
        if converter is None or converter.source != fmt:
            converter = self._output = AudioConverter(fmt, G711_ULAW)
        mulaw = converter.convert(raw)
        if isinstance(mulaw, AudioError):
            return []
        self._sent_ms += fmt.duration_ms(len(raw))
        return self._frames(self._cutter.receive(mulaw), rid)

    def _start_response(self, rid: str) -> None:
        self._playing = rid
        self._sent_ms = 0.0
        self._response_frames = 0
        self._cutter.reset()
        if self._output is not None:
            self._output.reset()

    def _finish(self, rid: str | None) -> list[str]:
        """The response's audio is complete: what the resampler and cutter hold, padded."""
        if rid is None or rid != self._playing:
            return []
        tail = self._output.flush() if self._output is not None else b""
        frames = self._cutter.receive(tail)
        last = self._cutter.flush()
        if last:
            frames.append(last)
        self._playing = None
        return self._frames(frames, rid) if frames else []

    def _frames(self, frames: Sequence[bytes], rid: str) -> list[str]:
        if not frames:
            return []
        sid = self._sid
        out = [
            _dumps({"event": "media", "streamSid": sid, "media": {"payload": encode_base64(f)}})
            for f in frames
        ]
        self.frames_sent += len(frames)
        self._response_frames += len(frames)
        self._mark_seq += 1
        name = f"m{self._mark_seq}"
        # What the caller has heard once Twilio played up to here: the frames sent
        # (the converter keeps time, so a frame's 20 ms are 20 ms of the engine's
        # audio), never more than the engine's audio taken (the last frame's padding).
        heard = min(self._response_frames * TWILIO_FRAME_MS, self._sent_ms)
        self._marks.append(_Mark(name, rid, round(heard)))
        self._unheard += 1
        if len(self._marks) > MAX_MARKS and not self._marks.popleft().cleared:
            self._unheard -= 1
        out.append(_dumps({"event": "mark", "streamSid": sid, "mark": {"name": name}}))
        return out

    def _clear(self, responses: Sequence[str]) -> list[str]:
        """The answer is over for the caller: drop what Twilio and the converters hold.

        Returns ``clear`` once per barge-in: only when Twilio may hold audio of an
        answer (marks not echoed) or one is being produced.
        """
        if self._playing is not None:
            responses = [*responses, self._playing]
        for rid in responses:
            self._cancelled[rid] = None
            self._cancelled.move_to_end(rid)
            self._open.discard(rid)
        while len(self._cancelled) > _MAX_CANCELLED:
            self._cancelled.popitem(last=False)
        pending = [m for m in self._marks if not m.cleared] if self._unheard else []
        playing = self._playing is not None
        if playing:
            self._playing = None
            self._cutter.reset()
            if self._output is not None:
                self._output.reset()
        if not pending and not playing:
            return []
        for mark in pending:
            mark.cleared = True  # Twilio echoes them at once; nothing of them was heard
        self._unheard = 0
        self.clears += 1
        return [_dumps({"event": "clear", "streamSid": self._sid})]


def _dumps(body: Mapping[str, Any]) -> str:
    return orjson.dumps(body).decode()


def _append(audio: bytes) -> str:
    return _dumps({"type": "input_audio_buffer.append", "audio": encode_base64(audio)})
