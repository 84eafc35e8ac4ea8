"""The OpenAI front door of one session: client -> engine and engine -> client.

Sans-I/O, like the session core beside it; the client connection calls it at
two points (``proxy/session/openai_side.py``): each client frame before the
relay reads it, each engine event as it is written. The core keeps working
in the engine's dialect and timebase, so usage and quotas are charged by the
engine's word and cancelled audio is gone before the dialect sees it
(docs/design.md, OpenAI dialect).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import orjson

from proxy.core.audio_convert import AudioConverter
from proxy.core.audio_convert import silence as silence_of
from proxy.core.audio_formats import (
    OPENAI_PCM16,
    AudioError,
    AudioFormat,
    Encoding,
    decode_base64,
    encode_base64,
    parse_engine_audio,
    parse_engine_format,
    parse_openai_format,
)
from proxy.core.dialect.shapes import (
    as_object,
    error_body,
    fix_item,
    fix_response,
    frame_text,
    session_object,
    sets_turn_detection,
)
from proxy.core.dialect.tables import (
    CANCEL,
    CLIENT_INTERRUPTS,
    COMMIT,
    COMMIT_AND_CREATE,
    CREATE,
    EMPTY_TURN_MS,
    ENGINE_INTERRUPTS,
    EngineDialect,
    Flavour,
    vocabulary,
)
from proxy.core.dialect.turn_hook import TurnAction, TurnSignal, TurnSource, TurnSourceFactory
from proxy.core.events import UpstreamEvent, classify_upstream

__all__ = ["ClientStep", "OpenAIDialect"]

_NOTHING: Final[tuple[str, ...]] = ()


class ClientStep:
    """What one client frame becomes: ``forward``, the frames the relay reads in its
    place, in order (none, or more, such as the resampler's held audio before a
    commit); ``replies``, engine-shaped events the dialect answers with at once."""

    __slots__ = ("forward", "replies")

    def __init__(self, forward: tuple[str, ...], replies: tuple[str, ...] = _NOTHING) -> None:
        self.forward = forward
        self.replies = replies


class OpenAIDialect:
    """One session's translation between an OpenAI client and the engine.

    Args:
        flavour: GA or beta, as the client asked (docs/clients.md, OpenAI Realtime clients).
        engine: the engine release's table.
        new_event_id: a fresh ``event_id`` for events the sidecar makes.
        turns: builds the session's own turn detection (None: the sidecar has none).
    """

    def __init__(
        self,
        flavour: Flavour,
        engine: EngineDialect,
        new_event_id: Callable[[], str],
        turns: TurnSourceFactory | None = None,
    ) -> None:
        self.flavour = flavour
        self.vocab = vocabulary(flavour)
        self.engine = engine
        self._new_id = new_event_id
        #: The client's formats (OpenAI's default: PCM16 24 kHz both ways).
        self.client_input: AudioFormat = OPENAI_PCM16
        self.client_output: AudioFormat = OPENAI_PCM16
        #: The engine's, from its session.created (else the table's).
        self.engine_input = engine.input_format
        self.engine_output = engine.output_format
        self._input = AudioConverter(self.client_input, self.engine_input)
        self._output = AudioConverter(self.engine_output, self.client_output)
        self._output_response: str | None = None
        #: The response being converted was interrupted: its held audio is not flushed.
        self._interrupted = False
        #: The formats agree: audio passes as the peer wrote it (its text, not re-encoded).
        self._output_identity = self.engine_output == self.client_output
        self._input_identity = self.client_input == self.engine_input
        #: Whether the engine truncates items itself (its session.created may say).
        self.truncates = engine.truncates
        #: Turn detection in effect, as the client's session shows it.
        self.turn_detection: dict[str, Any] | None = None
        #: Input appended since the last commit (a response.create commits it first), and
        #: input committed since the last response (a response.create has something to answer).
        self.uncommitted = False
        self.committed = False
        #: The sidecar's own turn detection (turn_hook), built at the first session.update
        #: that asks for turn detection the engine does not do; its audio converter.
        self._turn_factory = turns
        self._turns: TurnSource | None = None
        self._turn_audio: AudioConverter | None = None
        self._user_item = self._item_id()
        #: OpenAI's default turn detection, for the engine with the client's first frame.
        self._default_turns: tuple[dict[str, Any] | None] | None = (
            self._turn_detection({"type": "server_vad"}),
        )
        #: ``response.metadata`` of creates not answered yet, oldest first; then per response.
        self._asked: deque[dict[str, str] | None] = deque(maxlen=64)
        self._metadata: dict[str, dict[str, str] | None] = {}
        #: Items the sidecar truncated itself (the engine does not): their rest is dropped.
        self._truncated: set[str] = set()
        #: The last item announced (the engine sends conversation.item.added and .created).
        self._announced: str | None = None
        self._handlers: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
            "session.created": self._session,
            "session.updated": self._session,
            "response.created": self._response,
            "response.done": self._response,
            "error": self._error,
            "conversation.item.added": self._announce,
            "conversation.item.created": self._announce,
            "conversation.item.done": self._item,
            "conversation.item.retrieved": self._item,
            "response.output_item.added": self._item,
            "response.output_item.done": self._item,
            "conversation.item.input_audio_transcription.completed": self._transcription,
            "response.output_audio.done": self._audio_done,
            "response.audio.done": self._audio_done,
        }
        #: Transcript deltas are parsed only once an item was truncated here.
        self._transcripts = (
            "response.output_audio_transcript.delta",
            "response.audio_transcript.delta",
        )

    # -- client -> engine ------------------------------------------------------------------

    def from_client(self, text: str) -> ClientStep:
        """One client text frame (see the module docstring)."""
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            return ClientStep((text,))  # the core answers it (invalid_json)
        if not isinstance(body, dict):
            return ClientStep((text,))
        if self._default_turns is None:
            return self._step(body, text)
        # OpenAI's sessions start with server VAD on: the engine is asked for it with
        # the client's first frame, unless that frame sets turn detection itself.
        default, self._default_turns = self._default_turns, None
        step = self._step(body, text)
        if body.get("type") == "session.update" and sets_turn_detection(body):
            return step
        update = frame_text({"type": "session.update", "session": {"turn_detection": default[0]}})
        return ClientStep((update, *step.forward), step.replies)

    def _step(self, body: dict[str, Any], text: str) -> ClientStep:
        kind = body.get("type")
        if kind in CLIENT_INTERRUPTS:
            self._interrupted = True
        if kind == "input_audio_buffer.append":
            return self._append(body, text)
        if kind == "input_audio_buffer.commit":
            self.uncommitted = False
            self.committed = True
            if self._turns is not None:
                self._turns.clear()
            return ClientStep((*self._held_input(), text))
        if kind == "input_audio_buffer.clear":
            self.uncommitted = False
            self._input.reset()
            if self._turns is not None:
                self._turns.clear()
            return ClientStep((text,))
        if kind == "session.update":
            return self._session_update(body)
        if kind == "response.create":
            return self._response_create(body, text)
        if kind == "conversation.item.truncate":
            return self._truncate(body, text)
        return ClientStep((text,))

    def _append(self, body: dict[str, Any], text: str) -> ClientStep:
        as_is = self._input_identity and "format" not in body and "sample_rate_hz" not in body
        turns = self._turns
        if as_is and turns is None:
            self.uncommitted = True
            return ClientStep((text,))
        data = decode_base64(body.get("audio"))
        converted = data if isinstance(data, AudioError) else self._input.convert(data)
        if isinstance(converted, AudioError):
            return ClientStep(
                (), (self._engine_error(converted.kind.value, converted.message, body),)
            )
        self.uncommitted = True
        if not as_is:
            out: dict[str, Any] = {
                "type": "input_audio_buffer.append",
                "audio": encode_base64(converted),
            }
            if "event_id" in body:
                out["event_id"] = body["event_id"]
            text = frame_text(out)
        if turns is None:
            return ClientStep((text,))
        return self._turn_step(turns, text, converted)

    def _turn_step(self, turns: TurnSource, append: str, audio: bytes) -> ClientStep:
        """The append, then what the turn detector's signals make of it."""
        converter = self._turn_audio
        target = AudioFormat(Encoding.PCM16, turns.rate)
        if converter is None or (converter.source, converter.target) != (self.engine_input, target):
            converter = self._turn_audio = AudioConverter(self.engine_input, target)
        pcm = converter.convert(audio)
        if isinstance(pcm, AudioError) or not pcm:
            return ClientStep((append,))
        return self._turn_frames(turns.audio(pcm), [append])

    def _turn_frames(self, signals: Sequence[TurnSignal], forward: list[str]) -> ClientStep:
        """OpenAI's speech events for the client, commits and cancels for the engine."""
        replies: list[str] = []
        for signal in signals:
            action = signal.action
            if action is TurnAction.SPEECH_STARTED or action is TurnAction.SPEECH_STOPPED:
                key = "audio_start_ms" if action is TurnAction.SPEECH_STARTED else "audio_end_ms"
                event = {
                    "type": f"input_audio_buffer.{action.value}",
                    "event_id": self._new_id(),
                    key: signal.audio_ms,
                    "item_id": self._user_item,
                }
                replies.append(frame_text(event))
            elif action is TurnAction.CANCEL_RESPONSE:
                self._interrupted = True
                forward.append(CANCEL)  # the core silences it at once, as for the client's
            elif action is TurnAction.COMMIT:
                forward.extend(self._held_input())
                forward.append(COMMIT)
                self.uncommitted = False
                self.committed = True
                self._user_item = self._item_id()
            elif forward[-1] == COMMIT:  # CREATE_RESPONSE right after its commit
                forward[-1] = COMMIT_AND_CREATE
                self._asked.append(None)
            else:
                forward.append(CREATE)
                self._asked.append(None)
        return ClientStep(tuple(forward), tuple(replies))

    def _item_id(self) -> str:
        return "item_" + self._new_id().rpartition("_")[2]

    def _session_update(self, body: dict[str, Any]) -> ClientStep:
        session = body.get("session")
        session = session if isinstance(session, dict) else {}
        audio = session.get("audio")
        audio = audio if isinstance(audio, dict) else {}
        audio_in = as_object(audio.get("input"))
        audio_out = as_object(audio.get("output"))
        engine: dict[str, Any] = {}
        for key in ("instructions", "temperature", "tools", "tool_choice", "model"):
            if key in session:
                engine[key] = session[key]
        voice = audio_out.get("voice", session.get("voice"))
        if voice is not None:
            engine["voice"] = voice
        modalities = session.get("output_modalities", session.get("modalities"))
        if isinstance(modalities, list):
            # The engine speaks and writes its transcript: audio implies text.
            engine["modalities"] = ["audio", "text"] if "audio" in modalities else ["text"]
        limit = session.get("max_output_tokens", session.get("max_response_output_tokens"))
        if limit is not None:
            engine["max_response_output_tokens"] = limit
        replies: list[str] = []
        for side, value in (
            ("input", audio_in.get("format", session.get("input_audio_format"))),
            ("output", audio_out.get("format", session.get("output_audio_format"))),
        ):
            if value is None:
                continue
            fmt = parse_openai_format(value)
            if isinstance(fmt, AudioError):  # what is in effect stays; session.updated shows it
                replies.append(self._engine_error(fmt.kind.value, fmt.message, body))
            elif side == "input":
                self.client_input = fmt
            else:
                self.client_output = fmt
        self._rebuild_converters()
        missing = object()
        td = audio_in.get("turn_detection", session.get("turn_detection", missing))
        if td is not missing:
            engine["turn_detection"] = self._turn_detection(td)
        out: dict[str, Any] = {"type": "session.update", "session": engine}
        if "event_id" in body:
            out["event_id"] = body["event_id"]
        return ClientStep((frame_text(out),), tuple(replies))

    def _turn_detection(self, td: object) -> dict[str, Any] | None:
        """What the engine is asked for; :attr:`turn_detection` says what is in effect."""
        off = not isinstance(td, dict) or td.get("type") in (None, "none")
        if not off and not self.engine.engine_turns and self._turn_factory is not None:
            # The engine ends no turns: the sidecar's own detection takes them, the
            # engine is asked for none (its barge-in would race the sidecar's).
            if self._turns is None:
                self._turns = self._turn_factory()
            assert isinstance(td, dict)
            self.turn_detection = self._turns.configure(td)
            return None
        if self._turns is not None:
            self._turns.configure(None)
        if off or not isinstance(td, dict):
            self.turn_detection = None
            return None
        asked = self.engine.turn_detection.get(str(td.get("type")))
        if asked is None:
            self.turn_detection = None
            return None
        engine = {k: v for k, v in td.items() if k in self.engine.turn_detection_fields}
        engine["type"] = asked
        # The engine barges in on speech and creates no response by itself.
        self.turn_detection = {**engine, "create_response": False, "interrupt_response": True}
        return engine

    def _response_create(self, body: dict[str, Any], text: str) -> ClientStep:
        response = body.get("response")
        metadata = response.get("metadata") if isinstance(response, dict) else None
        self._asked.append(
            {str(k): v for k, v in metadata.items() if isinstance(v, str)}
            if isinstance(metadata, dict)
            else None
        )
        if not self.uncommitted and self.committed:
            return ClientStep((text,))
        # OpenAI commits uncommitted input at a response.create, and answers one with
        # no new input at all (a greeting); the engine needs committed input for both.
        out: dict[str, Any] = {"type": "input_audio_buffer.commit", "response_create": True}
        if "event_id" in body:
            out["event_id"] = body["event_id"]
        if self.uncommitted:
            self.uncommitted = False
            return ClientStep((*self._held_input(), frame_text(out)))
        out["is_speech"] = True  # a turn of its own, not a silence declaration
        return ClientStep((self._empty_turn(), frame_text(out)))

    def _empty_turn(self) -> str:
        """An append of :data:`EMPTY_TURN_MS` of silence in the engine's format."""
        fmt = self.engine_input
        silence = encode_base64(silence_of(fmt.encoding) * (fmt.rate * EMPTY_TURN_MS // 1000))
        return frame_text({"type": "input_audio_buffer.append", "audio": silence})

    def _held_input(self) -> tuple[str, ...]:
        """The end of the turn's audio the resampler still holds, as an append ahead
        of the commit (none when it holds nothing)."""
        tail = self._input.flush()
        if not tail:
            return ()
        return (frame_text({"type": "input_audio_buffer.append", "audio": encode_base64(tail)}),)

    def _truncate(self, body: dict[str, Any], text: str) -> ClientStep:
        item_id = body.get("item_id")
        end = body.get("audio_end_ms")
        if self.truncates:
            if isinstance(end, int | float) and not isinstance(end, bool):
                body["audio_end_ms"] = round(self._output.source_ms_for(float(end)))
                return ClientStep((frame_text(body),))
            return ClientStep((text,))
        # Answered from the playback ledger: the client played to audio_end_ms;
        # the rest of that item is dropped (docs/clients.md, Truncation).
        if isinstance(item_id, str):
            self._truncated.add(item_id)
            for kind in self._transcripts:
                self._handlers[kind] = self._item_text
        reply = {
            "type": "conversation.item.truncated",
            "event_id": self._new_id(),
            "item_id": item_id,
            "content_index": body.get("content_index", 0),
            "audio_end_ms": end if isinstance(end, int) else 0,
        }
        return ClientStep((), (frame_text(reply),))

    def _engine_error(self, code: str, message: str, body: dict[str, Any]) -> str:
        error: dict[str, Any] = {"type": "invalid_request_error", "code": code, "message": message}
        if isinstance(body.get("event_id"), str):
            error["event_id"] = body["event_id"]
        return frame_text({"type": "error", "event_id": self._new_id(), "error": error})

    def _rebuild_converters(self) -> None:
        if (self._input.source, self._input.target) != (self.client_input, self.engine_input):
            self._input = AudioConverter(self.client_input, self.engine_input)
        if (self._output.source, self._output.target) != (self.engine_output, self.client_output):
            self._output = AudioConverter(self.engine_output, self.client_output)
            self._output_response = None
        self._output_identity = self.engine_output == self.client_output
        self._input_identity = self.client_input == self.engine_input

    # -- engine -> client ------------------------------------------------------------------

    def to_client(self, text: str) -> list[str]:
        """The texts to write for one engine event, in order (0..n)."""
        out: list[str] = []
        event = classify_upstream(text)
        vocab = self.vocab
        if event.is_audio:
            if self._same_audio(event):
                if event.type != vocab.audio_delta:
                    # Only the name differs: the first quoted occurrence is the type
                    # (base64 has no quotes; ids and metadata never spell an event name).
                    text = text.replace(f'"{event.type}"', f'"{vocab.audio_delta}"', 1)
                out.append(text)  # the client's format and item: as the engine wrote it
            else:
                self._audio_delta(text, out)
            return out
        kind = event.type
        if kind in ENGINE_INTERRUPTS:
            self._interrupted = True
        name = vocab.renames.get(kind, kind)
        if name not in vocab.types:
            return out  # an engine extension a stock parser does not know: not sent
        handler = self._handlers.get(kind)
        if handler is None and name == kind:
            out.append(text)  # the same shape: the engine's own text
            return out
        body = event.body if event.body is not None else self._parse(text)
        if body is None:
            return out
        body["type"] = name
        if handler is None:
            out.append(frame_text(body))
        else:
            handler(body, out)
        return out

    def _same_audio(self, event: UpstreamEvent) -> bool:
        """An audio delta the client takes as the engine wrote it, but for its name:
        no conversion, not of an item truncated here."""
        if not self._output_identity:
            return False
        meta = event.audio_meta
        if meta is None:
            return True
        if self._truncated and meta.get("item_id") in self._truncated:
            return False
        rate = meta.get("sample_rate_hz")
        return rate is None or rate == self.engine_output.rate

    @staticmethod
    def _parse(text: str) -> dict[str, Any] | None:
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None

    def _session(self, body: dict[str, Any], out: list[str]) -> None:
        session = body.get("session")
        if isinstance(session, dict):
            audio = session.get("audio")
            if isinstance(audio, dict):
                found_in = parse_engine_audio(audio.get("input"))
                found_out = parse_engine_audio(audio.get("output"))
                if isinstance(found_in, AudioFormat):
                    self.engine_input = found_in
                if isinstance(found_out, AudioFormat):
                    self.engine_output = found_out
                self._rebuild_converters()
            capabilities = session.get("capabilities")
            if isinstance(capabilities, dict) and "supports_audio_truncate" in capabilities:
                self.truncates = capabilities["supports_audio_truncate"] is True
            body["session"] = session_object(
                session,
                vocab=self.vocab,
                input_format=self.client_input,
                output_format=self.client_output,
                turn_detection=self.turn_detection,
                engine_formats=(self.engine_input, self.engine_output),
            )
        # Resume credentials are the engine protocol's (a stock client never resumes).
        body.pop("resume_token", None)
        body.pop("attachment_generation", None)
        out.append(frame_text(body))

    def _response(self, body: dict[str, Any], out: list[str]) -> None:
        response = body.get("response")
        if not isinstance(response, dict):
            return
        rid = str(response.get("id") or body.get("response_id") or "")
        if body["type"] == "response.created":
            metadata = self._asked.popleft() if self._asked else None
            self._metadata[rid] = metadata
            self.committed = False
            if self._turns is not None:
                self._turns.response_active(True)
        else:
            metadata = self._metadata.pop(rid, None)
            if self._turns is not None:
                self._turns.response_active(False)
            status = response.get("status")
            if status != "completed" and self._output_response == rid:
                self._output.reset()  # its held audio is never played
                self._output_response = None
        fix_response(response, vocab=self.vocab, engine=self.engine, metadata=metadata)
        out.append(frame_text(body))

    def _error(self, body: dict[str, Any], out: list[str]) -> None:
        error = body.get("error")
        code = error.get("code") if isinstance(error, dict) else body.get("code")
        if code in self.engine.hidden_errors:
            return
        if not isinstance(body.get("event_id"), str):
            body["event_id"] = self._new_id()  # the route-level shape has none
        out.append(frame_text(error_body(body, self.engine.error_codes)))

    def _announce(self, body: dict[str, Any], out: list[str]) -> None:
        item = body.get("item")
        item_id = item.get("id") if isinstance(item, dict) else None
        if item_id is not None and item_id == self._announced:
            return  # the engine's second announcement of the same item
        self._announced = item_id if isinstance(item_id, str) else None
        self._item(body, out)

    def _item(self, body: dict[str, Any], out: list[str]) -> None:
        fix_item(body.get("item"), self.vocab)
        out.append(frame_text(body))

    def _item_text(self, body: dict[str, Any], out: list[str]) -> None:
        if body.get("item_id") in self._truncated:
            return
        out.append(frame_text(body))

    def _transcription(self, body: dict[str, Any], out: list[str]) -> None:
        if "usage" not in body:
            body["usage"] = {"type": "duration", "seconds": 0}
        if not isinstance(body.get("transcript"), str):
            body["transcript"] = ""
        out.append(frame_text(body))

    def _audio_delta(self, text: str, out: list[str]) -> None:
        body = self._parse(text)
        if body is None or body.get("item_id") in self._truncated:
            return
        rid = body.get("response_id")
        if rid != self._output_response:
            self._output.reset()  # another response: nothing of the last one follows it
            self._output_response = rid if isinstance(rid, str) else None
            self._interrupted = False
        source = parse_engine_format(body.pop("format", None), body.pop("sample_rate_hz", None))
        if isinstance(source, AudioFormat) and source != self.engine_output:
            self.engine_output = source
            self._rebuild_converters()
            self._output_response = rid if isinstance(rid, str) else None
        audio = self._output.convert_base64(body.get("delta"))
        if isinstance(audio, AudioError) or not audio:
            return
        body["type"] = self.vocab.audio_delta
        body["delta"] = audio
        out.append(frame_text(body))

    def _audio_done(self, body: dict[str, Any], out: list[str]) -> None:
        rid = body.get("response_id")
        if rid == self._output_response and self._interrupted:
            self._output.reset()  # what the resampler holds of an interrupted answer: dropped
            self._output_response = None
        elif rid == self._output_response and body.get("item_id") not in self._truncated:
            tail = self._output.flush()
            if tail:
                delta = {
                    "type": self.vocab.audio_delta,
                    "event_id": self._new_id(),
                    "response_id": rid,
                    "item_id": body.get("item_id"),
                    "output_index": body.get("output_index", 0),
                    "content_index": body.get("content_index", 0),
                    "delta": encode_base64(tail),
                }
                out.append(frame_text(delta))
            self._output_response = None
        out.append(frame_text(body))
