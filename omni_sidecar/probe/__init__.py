"""``omni-sidecar probe``: a realtime client for people and benchmarks.

The probe opens one realtime session, streams audio, asks for one or more
responses and measures what a client sees: time to ``session.created``, time
to the first audio delta, how much audio arrived and, when it cancels, how much
audio of the cancelled response still arrived after ``response.cancel``: the
gap the sidecar exists to close (docs/engine-protocol.md, Late audio after a cancel).

That last figure is an amount of audio, not a time: frames received after the
cancel was sent and the length of the audio they carry, computed from the
decoded size of each delta in its format (the delta's own ``format`` and
``sample_rate_hz``, else the session's output format from ``session.created`` /
``session.updated``, else PCM16 at 24 kHz). A wall-clock "cancel to silence"
would mislead: stale audio usually arrives in one burst right after the
cancel, so a few milliseconds of wall time can carry seconds of old answer.

What a listener hears is a third figure. :class:`PlayoutBuffer` models a client
that plays every received delta at 1x from the moment it arrives (queued behind
what it still has to play) and does not clear its buffer on a cancel, like a
telephony bridge. "Old answer heard after barge-in" is then the audio of the
cancelled response played after the cancel moment: what was buffered and not
yet played when the cancel was sent, plus that response's audio that still
arrived afterwards. Engines generate faster than real time, so an unpaced path
leaves seconds in the buffer even when no late delta arrives at all.

It is built like the rest of the package: :class:`_Recorder` is a sans-I/O core
that takes events and timestamps and says what to send back (acks, the cancel);
:func:`run_probe` is the thin asyncio/aiohttp shell around it. The shell reads
``time.monotonic()`` because it is the I/O layer; the recorder never does.

Exceptions::

    ProxyError
    └── ProbeError                                  (bad input file, protocol trouble)
        ├── ProbeConnectError(ProbeError, ConnectionError)   url, status
        └── ProbeTimeout(ProbeError, TimeoutError)           timeout, stage, result
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import math
import sys
import time
import wave
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson

from omni_sidecar.core.events import AUDIO_DELTA_TYPES
from omni_sidecar.core.ratelimit import BYTES_PER_SAMPLE
from omni_sidecar.errors import ConfigError, ProxyError

__all__ = [
    "DEFAULT_URL",
    "PlayoutBuffer",
    "ProbeConnectError",
    "ProbeError",
    "ProbeOptions",
    "ProbeResult",
    "ProbeTimeout",
    "add_probe_arguments",
    "base64_decoded_length",
    "format_result",
    "main_probe",
    "options_from_args",
    "run_probe",
    "voice_like_pcm16",
]

SECONDS: Final = 1.0
DEFAULT_URL: Final = "ws://127.0.0.1:8000/v1/realtime"
#: Rate of the generated input signal, and of what we declare in each append.
GENERATED_SAMPLE_RATE_HZ: Final = 16_000
#: Output audio is PCM16 at 24 kHz unless the delta or the session says otherwise
#: (docs/engine-protocol.md, Conventions).
DEFAULT_OUTPUT_FORMAT: Final = "pcm16"
DEFAULT_OUTPUT_SAMPLE_RATE_HZ: Final = 24_000
MAX_MSG_BYTES: Final = 64 * 1024 * 1024
#: Bound on each closing step: waiting for ``session.closed``, then the close frame.
DEFAULT_CLOSE_TIMEOUT: Final = 5 * SECONDS
_PROG: Final = "omni-sidecar probe"


class ProbeError(ProxyError):
    """The probe could not do its job (unreadable input, broken connection)."""


class ProbeConnectError(ProbeError, ConnectionError):
    """The WebSocket could not be opened.

    Args:
        url: The URL the probe tried.
        detail: What went wrong, on one line.
        status: The HTTP status when the server refused the upgrade, else None.
    """

    url: str
    status: int | None

    def __init__(self, url: str, detail: str, *, status: int | None = None) -> None:
        self.url = url
        self.status = status
        super().__init__(f"cannot connect to {url}: {detail}")


class ProbeTimeout(ProbeError, TimeoutError):
    """The overall deadline passed before the session completed.

    Args:
        timeout: The deadline in seconds.
        stage: What the probe was waiting for, e.g. ``response.done 1/2``.
        result: Everything measured until then.
    """

    timeout: float
    stage: str
    result: ProbeResult

    def __init__(self, timeout: float, stage: str, result: ProbeResult) -> None:
        self.timeout = timeout
        self.stage = stage
        self.result = result
        super().__init__(f"timed out after {timeout:g} s waiting for {stage}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeOptions:
    """What the probe does.

    Args:
        url: The realtime WebSocket URL.
        wav: A PCM16 mono WAV file to stream; None streams a generated
            voice-like signal at 16 kHz.
        input_seconds: Seconds of audio streamed before each commit (a shorter
            WAV is sent whole).
        append_ms: Audio length of each ``input_audio_buffer.append``.
        realtime: Pace the appends in real time; False sends them at once.
        cancel_after_ms: After this much received audio of a response, send
            ``response.cancel`` with its ``response_id``; None never cancels.
        timeout: Overall deadline in seconds, connect included.
        headers: Extra HTTP headers for the upgrade request.
        event_ack: Answer each event carrying ``server_event_seq`` with
            ``session.event_ack`` (as DuplexClient does, docs/engine-protocol.md, Conventions).
        responses: How many responses to request, one after the other.

    Raises:
        ConfigError: A value is out of range.
    """

    url: str = DEFAULT_URL
    wav: Path | None = None
    input_seconds: float = 1.0
    append_ms: float = 200.0
    realtime: bool = True
    cancel_after_ms: float | None = None
    timeout: float = 30 * SECONDS
    headers: tuple[tuple[str, str], ...] = ()
    event_ack: bool = False
    responses: int = 1

    def __post_init__(self) -> None:
        for key in ("input_seconds", "append_ms", "timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be positive", "ProbeOptions")
        if self.cancel_after_ms is not None and not self.cancel_after_ms >= 0:
            raise ConfigError("cancel_after_ms", "must not be negative", "ProbeOptions")
        if self.responses < 1:
            raise ConfigError("responses", "must be at least 1", "ProbeOptions")


@dataclass(slots=True, kw_only=True)
class ProbeResult:
    """What the probe measured. Durations are seconds, None when not reached.

    Attributes:
        session_created_seconds: From the start of the connect to ``session.created``.
        first_audio_seconds: From sending the first ``response.create`` to its
            first audio delta.
        response_first_audio_seconds: The same for every response that had audio.
        audio_seconds: All audio received, from the base64 length of the deltas.
        audio_frames: Number of audio deltas received.
        cancels_sent: ``response.cancel`` events sent.
        stale_audio_frames: Audio deltas of a cancelled response received after
            its cancel was sent, over all cancelled responses.
        stale_audio_seconds: The audio length of those deltas (decoded size in
            the delta's or the session's format), not a wall-clock time.
        old_answer_heard_after_barge_in_ms: Milliseconds of cancelled-response
            audio a 1x playout client that does not clear its buffer plays
            after the cancel (:class:`PlayoutBuffer`), over all cancelled
            responses; None when no cancel was sent. In ms, as printed.
        response_statuses: ``response.done`` statuses in order.
        event_types: Types of all received events in order.
        errors: Codes of all ``error`` events in order.
        close_code: The WebSocket close code, None if never closed.
        session_closed_reason: ``reason`` of ``session.closed``.
        completed: ``session.created`` arrived and every requested response
            ended with ``response.done``.
    """

    session_created_seconds: float | None = None
    first_audio_seconds: float | None = None
    response_first_audio_seconds: list[float] = field(default_factory=list)
    audio_seconds: float = 0.0
    audio_frames: int = 0
    cancels_sent: int = 0
    stale_audio_frames: int = 0
    stale_audio_seconds: float = 0.0
    old_answer_heard_after_barge_in_ms: float | None = None
    response_statuses: list[str] = field(default_factory=list)
    event_types: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    close_code: int | None = None
    session_closed_reason: str | None = None
    completed: bool = False


@dataclass(slots=True)
class _Track:
    """One response's audio in a :class:`PlayoutBuffer`, seconds and monotonic times."""

    received: float = 0.0
    #: (start, end) play times of its deltas not yet fully played at the last add.
    unplayed: deque[tuple[float, float]] = field(default_factory=deque)
    cancelled_at: float | None = None
    unplayed_at_cancel: float = 0.0
    after_cancel: float = 0.0


class PlayoutBuffer:
    """A client that plays received audio at 1x and never clears its buffer.

    Sans-I/O: times are passed in (monotonic seconds). Each delta starts to
    play when it arrives or when the audio queued before it has played,
    whichever is later, so playback of a response starts at its first delta and
    runs at real time; audio arriving faster than that accumulates. On a cancel
    nothing is dropped: that is the client without a "clear" the figure is
    about (a phone bridge, a naive browser player). Responses are keyed by the
    caller (the probe uses ``response_id``).

    Times must not go backwards. Memory is bounded by the audio still queued:
    a response keeps only the deltas not yet fully played, and nothing per
    delta once it is cancelled.
    """

    def __init__(self) -> None:
        self._free_at = -math.inf  # when everything queued so far has played
        self._tracks: dict[str, _Track] = {}

    def add(self, key: str, seconds: float, now: float) -> None:
        """Queue one received delta of response ``key`` that plays ``seconds``."""
        start = max(now, self._free_at)
        end = start + seconds
        self._free_at = end
        track = self._tracks.setdefault(key, _Track())
        track.received += seconds
        if track.cancelled_at is not None:
            track.after_cancel += seconds  # played in full, after the cancel
            return
        while track.unplayed and track.unplayed[0][1] <= now:
            track.unplayed.popleft()
        track.unplayed.append((start, end))

    def cancel(self, key: str, now: float) -> None:
        """Record the barge-in on ``key`` at ``now``; only the first one counts."""
        track = self._tracks.setdefault(key, _Track())
        if track.cancelled_at is not None:
            return
        track.cancelled_at = now
        track.unplayed_at_cancel = sum(
            end - max(start, now) for start, end in track.unplayed if end > now
        )
        track.unplayed.clear()

    def played_at_cancel(self, key: str) -> float | None:
        """Seconds of ``key`` played when it was cancelled (the listener's position)."""
        track = self._tracks.get(key)
        if track is None or track.cancelled_at is None:
            return None
        return max(0.0, track.received - track.after_cancel - track.unplayed_at_cancel)

    def heard_after_cancel(self, key: str) -> float | None:
        """Seconds of ``key`` played after its cancel: buffered then + arrived since."""
        track = self._tracks.get(key)
        if track is None or track.cancelled_at is None:
            return None
        return track.unplayed_at_cancel + track.after_cancel

    def total_heard_after_cancel(self) -> float | None:
        """:meth:`heard_after_cancel` summed over cancelled responses; None if none was."""
        heard = [self.heard_after_cancel(key) for key in self._tracks]
        values = [value for value in heard if value is not None]
        return sum(values) if values else None


def base64_decoded_length(text: str) -> int:
    """Return how many bytes ``text`` decodes to, without decoding it.

    Args:
        text: Canonical base64 (no whitespace).

    Returns:
        ``len * 3 // 4`` minus the padding.
    """
    padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, len(text) * 3 // 4 - padding)


def voice_like_pcm16(seconds: float, sample_rate_hz: int = GENERATED_SAMPLE_RATE_HZ) -> bytes:
    """Generate a signal that voice activity detectors take for speech.

    A harmonic-rich tone around 130 Hz with a slow pitch contour, amplitude
    modulated at about four syllables per second.

    Args:
        seconds: Length of the signal.
        sample_rate_hz: Sample rate.

    Returns:
        PCM16 little-endian mono samples.
    """
    two_pi = 2.0 * math.pi
    samples = array("h")
    phase = 0.0
    for n in range(max(0, round(seconds * sample_rate_hz))):
        t = n / sample_rate_hz
        pitch_hz = 130.0 + 25.0 * math.sin(two_pi * 0.7 * t)
        phase = (phase + two_pi * pitch_hz / sample_rate_hz) % two_pi
        envelope = 0.5 - 0.5 * math.cos(two_pi * 4.0 * t)
        harmonics = sum(math.sin(k * phase) / k for k in range(1, 6))  # |sum| < 2
        samples.append(int(0.3 * 32767 * envelope * harmonics / 2.0))
    if sys.byteorder == "big":
        samples.byteswap()
    return samples.tobytes()


def _positive_int_or_none(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _response_id(event: Mapping[str, Any]) -> str | None:
    """Top-level ``response_id``, else ``response.id`` (docs/engine-protocol.md, Server events)."""
    value = event.get("response_id")
    if isinstance(value, str):
        return value
    response = event.get("response")
    if isinstance(response, dict) and isinstance(response.get("id"), str):
        return str(response["id"])
    return None


class _Recorder:
    """Sans-I/O core of the probe: events and timestamps in, replies out.

    The shell calls :meth:`begin_response` before sending ``response.create``,
    feeds every received event to :meth:`receive_event` (which returns the
    events to send back at once) and reports each sent cancel through
    :meth:`cancel_sent`. Responses are identified by ``response_id``; a delta
    without one belongs to the response in progress (key ``""`` if unknown).
    """

    def __init__(self, options: ProbeOptions, started_at: float) -> None:
        self.result = ProbeResult()
        self.session_created = False
        self.session_closed = False
        self.closed = False
        self.in_response = False
        self.responses_done = 0
        self.stage = "connect"
        self._options = options
        self._started_at = started_at
        self._create_event_id: str | None = None
        self._create_sent_at = 0.0
        self._current_id: str | None = None
        self._current_audio_seconds = 0.0
        self._first_audio_pending = False
        self._cancel_requested = False
        self._cancelled_at: dict[str, float] = {}
        self._finished: set[str] = set()
        self._output_format = DEFAULT_OUTPUT_FORMAT
        self._output_rate = DEFAULT_OUTPUT_SAMPLE_RATE_HZ
        self._playout = PlayoutBuffer()

    def begin_response(self, create_event_id: str, now: float) -> None:
        """Start waiting for a new response; call just before ``response.create``."""
        self.in_response = True
        self._create_event_id = create_event_id
        self._create_sent_at = now
        self._current_id = None
        self._current_audio_seconds = 0.0
        self._first_audio_pending = True
        self._cancel_requested = False

    def cancel_sent(self, response_id: str | None, now: float) -> None:
        """Record that the ``response.cancel`` built by :meth:`receive_event` went out."""
        self._cancelled_at[response_id or ""] = now
        self._playout.cancel(response_id or "", now)
        self.result.cancels_sent += 1

    def receive_malformed(self) -> None:
        """Record a frame that is not a JSON object."""
        self.result.event_types.append("<malformed>")

    def receive_event(self, event: Mapping[str, Any], now: float) -> list[dict[str, Any]]:
        """Record one server event.

        Args:
            event: The parsed event.
            now: When it was received (monotonic seconds).

        Returns:
            Events to send now, in order (``session.event_ack``, ``response.cancel``).
        """
        raw_type = event.get("type")
        event_type = raw_type if isinstance(raw_type, str) else "<untyped>"
        self.result.event_types.append(event_type)
        outgoing: list[dict[str, Any]] = []
        seq = event.get("server_event_seq")
        if self._options.event_ack and isinstance(seq, int) and not isinstance(seq, bool):
            outgoing.append({"type": "session.event_ack", "server_event_seq": seq})
        if event_type in AUDIO_DELTA_TYPES:
            outgoing.extend(self._receive_audio(event, now))
        elif event_type in ("session.created", "session.updated"):
            self._note_output_format(event.get("session"))
            if event_type == "session.created" and not self.session_created:
                self.session_created = True
                self.result.session_created_seconds = now - self._started_at
        elif event_type == "response.created":
            response_id = _response_id(event)
            if self.in_response and self._current_id is None and response_id not in self._finished:
                self._current_id = response_id
        elif event_type == "response.done":
            self._receive_done(event)
        elif event_type == "error":
            self._receive_error(event)
        elif event_type == "session.closed":
            self.session_closed = True
            reason = event.get("reason")
            self.result.session_closed_reason = reason if isinstance(reason, str) else None
        return outgoing

    def _note_output_format(self, session: object) -> None:
        """Remember the session's output format: vLLM-Omni's ``audio.output``
        {format, sample_rate_hz}, OpenAI GA's {format: {type, rate}}, or the
        beta ``output_audio_format``."""
        if not isinstance(session, dict):
            return
        audio = session.get("audio")
        output = audio.get("output") if isinstance(audio, dict) else None
        spec = output.get("format") if isinstance(output, dict) else None
        if spec is None:
            spec = session.get("output_audio_format")
        if isinstance(spec, dict):  # GA: {"type": "audio/pcm", "rate": 24000}
            rate = _positive_int_or_none(spec.get("rate"))
            spec = spec.get("type")
            if rate is not None:
                self._output_rate = rate
        if isinstance(spec, str) and spec in BYTES_PER_SAMPLE:
            self._output_format = spec
        if isinstance(output, dict):
            rate = _positive_int_or_none(output.get("sample_rate_hz"))
            if rate is not None:
                self._output_rate = rate

    def _audio_seconds(self, event: Mapping[str, Any]) -> float:
        """Audio length of one delta from its decoded size, without decoding it."""
        delta = event.get("delta")
        size = base64_decoded_length(delta) if isinstance(delta, str) else 0
        rate = _positive_int_or_none(event.get("sample_rate_hz")) or self._output_rate
        audio_format = event.get("format")
        if not isinstance(audio_format, str) or audio_format not in BYTES_PER_SAMPLE:
            audio_format = self._output_format
        return size / BYTES_PER_SAMPLE[audio_format] / rate

    def _receive_audio(self, event: Mapping[str, Any], now: float) -> list[dict[str, Any]]:
        seconds = self._audio_seconds(event)
        self.result.audio_frames += 1
        self.result.audio_seconds += seconds
        response_id = _response_id(event)
        key = response_id if response_id is not None else (self._current_id or "")
        self._playout.add(key, seconds, now)  # a client plays whatever it receives
        if key in self._cancelled_at:
            # Audio queued before the cancel is still delivered by the released
            # engines (docs/engine-protocol.md, Late audio after a cancel).
            self.result.stale_audio_frames += 1
            self.result.stale_audio_seconds += seconds
            return []
        if not self.in_response or key in self._finished:
            return []
        if self._current_id is None:
            self._current_id = response_id
        elif response_id is not None and response_id != self._current_id:
            return []  # audio of some other response; counted in the totals only
        if self._first_audio_pending:
            self._first_audio_pending = False
            first_audio = now - self._create_sent_at
            self.result.response_first_audio_seconds.append(first_audio)
            if self.result.first_audio_seconds is None:
                self.result.first_audio_seconds = first_audio
        self._current_audio_seconds += seconds
        limit_ms = self._options.cancel_after_ms
        if limit_ms is None or self._cancel_requested:
            return []
        if self._current_audio_seconds * 1000.0 < limit_ms:
            return []
        self._cancel_requested = True
        cancel: dict[str, Any] = {"type": "response.cancel"}
        if self._current_id is not None:
            cancel["response_id"] = self._current_id
        return [cancel]

    def _receive_done(self, event: Mapping[str, Any]) -> None:
        response = event.get("response")
        status = response.get("status") if isinstance(response, dict) else None
        self.result.response_statuses.append(status if isinstance(status, str) else "unknown")
        response_id = _response_id(event)
        self._finished.add(response_id if response_id is not None else (self._current_id or ""))
        if self.in_response and (
            response_id is None or self._current_id is None or response_id == self._current_id
        ):
            self.in_response = False
            self.responses_done += 1

    def _receive_error(self, event: Mapping[str, Any]) -> None:
        # Nested envelope {error:{code,…}}; route-level ones are flat
        # (docs/engine-protocol.md, Terminal events and errors).
        error = event.get("error")
        code = error.get("code") if isinstance(error, dict) else event.get("code")
        self.result.errors.append(str(code) if code is not None else "unknown")
        if (
            self.in_response
            and isinstance(error, dict)
            and error.get("event_id") == self._create_event_id
        ):
            self.in_response = False  # response.create was rejected; no response.done follows

    def finish(self) -> ProbeResult:
        """Return the result, with the completion flag filled in."""
        self.result.completed = (
            self.session_created and self.responses_done >= self._options.responses
        )
        heard = self._playout.total_heard_after_cancel()
        self.result.old_answer_heard_after_barge_in_ms = None if heard is None else heard * 1000.0
        return self.result


@dataclass(frozen=True, slots=True)
class _InputAudio:
    pcm: bytes
    sample_rate_hz: int


def _load_input_audio(options: ProbeOptions) -> _InputAudio:
    if options.wav is None:
        rate = GENERATED_SAMPLE_RATE_HZ
        return _InputAudio(voice_like_pcm16(options.input_seconds, rate), rate)
    try:
        with wave.open(str(options.wav), "rb") as reader:
            if reader.getnchannels() != 1 or reader.getsampwidth() != 2:
                raise ProbeError(f"{options.wav}: not a PCM16 mono WAV file")
            rate = reader.getframerate()
            pcm = reader.readframes(max(1, round(options.input_seconds * rate)))
    except (OSError, EOFError, wave.Error) as exc:
        raise ProbeError(f"cannot read {options.wav}: {exc}") from exc
    if not pcm:
        raise ProbeError(f"{options.wav}: no audio frames")
    return _InputAudio(pcm, rate)


class _Sender:
    """Serialises sends from the driver and the reader; False once the socket is gone."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._lock = asyncio.Lock()

    async def send(self, event: Mapping[str, Any]) -> bool:
        async with self._lock:
            if self._ws.closed:
                return False
            try:
                await self._ws.send_str(orjson.dumps(event).decode())
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too
                return False
            return True


class _Changes:
    """Wakes the driver whenever the reader has recorded something."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._event.clear()
            await self._event.wait()


async def _read_events(
    ws: aiohttp.ClientWebSocketResponse, recorder: _Recorder, sender: _Sender, changes: _Changes
) -> None:
    try:
        async for message in ws:  # ends on CLOSE/CLOSING/CLOSED; autoclose answers the close
            now = time.monotonic()
            if message.type is aiohttp.WSMsgType.ERROR:
                break
            if message.type is not aiohttp.WSMsgType.TEXT:
                continue
            try:
                event = orjson.loads(message.data)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                recorder.receive_malformed()
                continue
            for reply in recorder.receive_event(event, now):
                sent_at = time.monotonic()
                if await sender.send(reply) and reply["type"] == "response.cancel":
                    recorder.cancel_sent(reply.get("response_id"), sent_at)
            changes.notify()
    finally:
        recorder.closed = True
        changes.notify()


async def _stream_input(sender: _Sender, audio: _InputAudio, options: ProbeOptions) -> bool:
    rate = audio.sample_rate_hz
    chunk_bytes = 2 * max(1, round(rate * options.append_ms / 1000.0))
    started_at = time.monotonic()
    for offset in range(0, len(audio.pcm), chunk_bytes):
        if options.realtime:
            delay = started_at + offset / 2 / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        chunk = audio.pcm[offset : offset + chunk_bytes]
        append = {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(chunk).decode("ascii"),
            "format": "pcm16",
            "sample_rate_hz": rate,
        }
        if not await sender.send(append):
            return False
    return True


async def _drive(
    options: ProbeOptions,
    audio: _InputAudio,
    recorder: _Recorder,
    sender: _Sender,
    changes: _Changes,
) -> None:
    recorder.stage = "session.created"
    update = {
        "type": "session.update",
        "session": {"modalities": ["audio", "text"], "extra_body": {"auto_response": False}},
    }
    if not await sender.send(update):
        return
    await changes.wait_until(lambda: recorder.session_created or recorder.closed)
    for index in range(1, options.responses + 1):
        if recorder.closed:
            return
        recorder.stage = f"input audio {index}/{options.responses}"
        if not await _stream_input(sender, audio, options):
            return
        if not await sender.send({"type": "input_audio_buffer.commit"}):
            return
        recorder.stage = f"response.done {index}/{options.responses}"
        create_id = f"probe_response_create_{index}"
        recorder.begin_response(create_id, time.monotonic())
        if not await sender.send({"type": "response.create", "event_id": create_id}):
            return
        await changes.wait_until(lambda: not recorder.in_response or recorder.closed)
    if recorder.closed:
        return
    recorder.stage = "session.closed"
    if await sender.send({"type": "session.close"}):
        try:
            async with asyncio.timeout(DEFAULT_CLOSE_TIMEOUT):
                await changes.wait_until(lambda: recorder.session_closed or recorder.closed)
            recorder.stage = "the close frame"
            async with asyncio.timeout(DEFAULT_CLOSE_TIMEOUT):
                await changes.wait_until(lambda: recorder.closed)
        except TimeoutError:
            pass  # bounded courtesy waits; we close ourselves below


async def _run_session(options: ProbeOptions, audio: _InputAudio, recorder: _Recorder) -> None:
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(
                options.url,
                headers=list(options.headers),
                max_msg_size=MAX_MSG_BYTES,
                compress=0,
                timeout=aiohttp.ClientWSTimeout(ws_close=DEFAULT_CLOSE_TIMEOUT),
            )
        except aiohttp.WSServerHandshakeError as exc:
            detail = f"HTTP {exc.status} {exc.message}".strip()
            raise ProbeConnectError(options.url, detail, status=exc.status) from exc
        except aiohttp.ClientConnectorError as exc:
            raise ProbeConnectError(options.url, str(exc.os_error) or str(exc)) from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise ProbeConnectError(options.url, str(exc) or type(exc).__name__) from exc
        sender = _Sender(ws)
        changes = _Changes()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_read_events(ws, recorder, sender, changes))
                await _drive(options, audio, recorder, sender, changes)
                await ws.close()  # no-op when the server already closed; ends the reader
        except BaseExceptionGroup as exc_group:
            if len(exc_group.exceptions) == 1:
                raise exc_group.exceptions[0] from exc_group
            raise
        finally:
            await ws.close()  # bounded by ws_close
            recorder.result.close_code = ws.close_code


async def run_probe(options: ProbeOptions) -> ProbeResult:
    """Run one realtime session against ``options.url`` and measure it.

    Sends ``session.update``, waits for ``session.created``, then for each
    response streams the input, commits, sends ``response.create`` and waits
    for ``response.done`` (cancelling on the way when asked); finally sends
    ``session.close`` and waits, bounded, for ``session.closed`` and the close.

    Args:
        options: What to do.

    Returns:
        The measurements; check :attr:`ProbeResult.completed`.

    Raises:
        ProbeConnectError: The WebSocket could not be opened.
        ProbeTimeout: ``options.timeout`` passed; it carries the partial result.
        ProbeError: The WAV input could not be used.
    """
    audio = _load_input_audio(options)
    recorder = _Recorder(options, time.monotonic())
    deadline = asyncio.timeout(options.timeout)
    try:
        async with deadline:
            await _run_session(options, audio, recorder)
    except TimeoutError as exc:
        if not deadline.expired():
            raise ProbeError(f"timeout inside aiohttp: {exc}") from exc
        raise ProbeTimeout(options.timeout, recorder.stage, recorder.finish()) from None
    return recorder.finish()


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000.0:.1f} ms"


def _stale_audio_line(result: ProbeResult) -> str:
    prefix = "audio of the cancelled response received after the cancel"
    if not result.cancels_sent:
        return f"{prefix}: n/a (no cancel sent)"
    frames = "frame" if result.stale_audio_frames == 1 else "frames"
    return (
        f"{prefix}: {result.stale_audio_frames} {frames}, "
        f"{result.stale_audio_seconds * 1000.0:.1f} ms of audio"
    )


def _heard_after_barge_in_line(result: ProbeResult) -> str:
    prefix = "old answer heard after barge-in"
    heard = result.old_answer_heard_after_barge_in_ms
    if heard is None:
        return f"{prefix}: n/a (no cancel sent)"
    return f"{prefix}: {heard:.1f} ms"


def format_result(result: ProbeResult, *, as_json: bool) -> str:
    """Render a result for a person (one line per figure) or as JSON.

    Args:
        result: What :func:`run_probe` returned.
        as_json: Return a JSON object with every field instead of text.

    Returns:
        The text, without a trailing newline.
    """
    if as_json:
        return orjson.dumps(dataclasses.asdict(result), option=orjson.OPT_INDENT_2).decode()
    lines = [
        f"session.created after {_ms(result.session_created_seconds)}",
        f"first audio after {_ms(result.first_audio_seconds)}",
    ]
    if len(result.response_first_audio_seconds) > 1:
        each = ", ".join(_ms(s) for s in result.response_first_audio_seconds)
        lines.append(f"first audio per response: {each}")
    lines += [
        f"audio received: {result.audio_seconds:.3f} s in {result.audio_frames} frames",
        f"response.done statuses: {', '.join(result.response_statuses) or 'none'}",
        _stale_audio_line(result),
        _heard_after_barge_in_line(result),
        f"errors: {', '.join(result.errors) or 'none'}",
        f"session.closed reason: {result.session_closed_reason or 'n/a'}",
        f"close code: {result.close_code if result.close_code is not None else 'n/a'}",
        f"events received: {len(result.event_types)}",
        f"completed: {'yes' if result.completed else 'no'}",
    ]
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``probe`` subcommand's arguments to ``parser``.

    Args:
        parser: The (sub)parser; :func:`options_from_args` reads its namespace.
    """
    defaults = ProbeOptions()
    parser.add_argument("url", nargs="?", default=defaults.url, help=f"default {defaults.url}")
    parser.add_argument("--wav", type=Path, default=None, help="PCM16 mono WAV to stream")
    parser.add_argument(
        "--input-seconds",
        type=_positive_float,
        default=defaults.input_seconds,
        metavar="S",
        help="audio streamed before each commit (default %(default)s)",
    )
    parser.add_argument(
        "--append-ms",
        type=_positive_float,
        default=defaults.append_ms,
        metavar="MS",
        help="audio per input_audio_buffer.append (default %(default)s)",
    )
    parser.add_argument(
        "--no-realtime", dest="realtime", action="store_false", help="send input unpaced"
    )
    parser.add_argument(
        "--cancel-after-ms",
        type=_non_negative_float,
        default=None,
        metavar="MS",
        help="cancel each response after this much received audio",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=defaults.timeout,
        metavar="S",
        help="overall deadline (default %(default)s)",
    )
    parser.add_argument(
        "--header",
        dest="headers",
        type=_header,
        action="append",
        default=None,
        metavar="NAME:VALUE",
        help="extra upgrade header (repeatable)",
    )
    parser.add_argument("--event-ack", action="store_true", help="ack server_event_seq")
    parser.add_argument(
        "--responses",
        type=_positive_int,
        default=defaults.responses,
        metavar="N",
        help="responses to request in sequence (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def options_from_args(ns: argparse.Namespace) -> ProbeOptions:
    """Build :class:`ProbeOptions` from a namespace parsed with :func:`add_probe_arguments`.

    Raises:
        ConfigError: A value is out of range.
    """
    return ProbeOptions(
        url=ns.url,
        wav=ns.wav,
        input_seconds=ns.input_seconds,
        append_ms=ns.append_ms,
        realtime=ns.realtime,
        cancel_after_ms=ns.cancel_after_ms,
        timeout=ns.timeout,
        headers=tuple(ns.headers or ()),
        event_ack=ns.event_ack,
        responses=ns.responses,
    )


def _error(message: str) -> None:
    print(f"{_PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def main_probe(ns: argparse.Namespace) -> int:
    """Run the probe for the CLI and print its result.

    Args:
        ns: Namespace parsed with :func:`add_probe_arguments`.

    Returns:
        0 when the session completed; 1 on a connect failure, a timeout (the
        partial result is printed first) or an incomplete session; 2 for an
        invalid option; 130 on Ctrl-C. Errors are one line on stderr.
    """
    try:
        options = options_from_args(ns)
    except ConfigError as exc:
        _error(str(exc))
        return 2
    try:
        result = asyncio.run(run_probe(options))
    except ProbeTimeout as exc:
        print(format_result(exc.result, as_json=ns.json))
        _error(str(exc))
        return 1
    except ProbeError as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    print(format_result(result, as_json=ns.json))
    if not result.completed:
        code = result.close_code if result.close_code is not None else "none"
        _error(f"session did not complete (close code {code}, errors: {result.errors or 'none'})")
        return 1
    return 0
