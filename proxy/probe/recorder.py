"""The probe's sans-I/O core: received events and timestamps in, replies and figures out.

:class:`Recorder` takes every server event with the time it arrived and says
what to send back at once (``session.event_ack``, the ``response.cancel``); it
fills in the :class:`~proxy.probe.options.ProbeResult`. It never reads
a clock: the shell in :mod:`proxy.probe.measured_session` passes time in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.core.events import AUDIO_DELTA_TYPES
from proxy.core.playback_state import DEFAULT_OUTPUT_FORMAT, DEFAULT_OUTPUT_RATE
from proxy.core.ratelimit import BYTES_PER_SAMPLE
from proxy.probe.options import ProbeOptions, ProbeResult
from proxy.probe.playout import PlayoutBuffer, base64_decoded_length

__all__ = ["Recorder"]


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


class Recorder:
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
        # PCM16 at 24 kHz unless the delta or the session says otherwise
        # (docs/engine-protocol.md, Conventions): the core's defaults.
        self._output_rate = DEFAULT_OUTPUT_RATE
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
