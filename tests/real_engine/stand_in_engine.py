"""A stand-in engine under vLLM-Omni's real serving layer (heavy test tier).

Runs against vllm-omni 0.30.0 and 0.32.0rc1 (``make test-real-engine
VLLM_OMNI=...``); ``RELEASE`` says which one is installed and what it does.

vLLM-Omni's own CPU tests exercise ``OmniDuplexSessionHandler`` by building a
``DuplexOmni`` without running its constructor and handing it an engine object
that answers the session RPCs in-process. This module does the same, so that
everything above the model is the released code:

- ``vllm_omni.entrypoints.openai.api_server.router`` serves ``/v1/realtime``,
  ``/v1/duplex`` and ``/health`` exactly as ``vllm-omni serve`` mounts them;
- ``OmniDuplexSessionHandler`` does the handshake, parses client events into
  ``DuplexCommand`` objects, journals and sequences server events
  (``server_event_seq``), resume credentials, ``session.event_ack``;
- ``DuplexOmni`` / ``DuplexSessionHandle`` route commands and events;
- every wire event is produced by the engine's own Realtime projection
  (``vllm_omni.engine.duplex.realtime_events``) from internal events, like the
  session runner does.

Only the model is replaced: a response is ``chunks`` PCM16 audio units paced
``interval_s`` apart. A cancel finds ``late_chunks`` more deltas of the
cancelled response already produced and queued ahead of its ``response.done``
(cancelled). What happens to them is the release's own code:

- 0.30 (docs/engine-protocol.md, Late audio after a cancel): the handle's
  outbox is an unbounded queue, so they are delivered, numbered, to the client;
- 0.31 and later: the engine hands each session a bounded
  ``DuplexOutputBuffer`` (``open_session_async(output_buffer=...)``) and, on an
  accepted cancel, the session runner removes the response's queued audio from
  it (``invalidate``) before the handler numbers anything. The stand-in makes
  that same call; the buffer and the handler's ``output_guard`` are released code.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import dataclasses
import math
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import vllm_omni
from packaging.version import Version
from vllm_omni.config.stage_config import DuplexSessionRuntimeConfig
from vllm_omni.engine.duplex import commands as duplex_commands
from vllm_omni.engine.duplex import events as duplex_events
from vllm_omni.engine.duplex import realtime_events as projection
from vllm_omni.engine.duplex.config import DuplexCapabilities, DuplexSessionConfig
from vllm_omni.engine.duplex.messages import (
    DuplexControlResultMessage,
    DuplexSessionError,
    DuplexSessionEventMessage,
)
from vllm_omni.entrypoints.duplex.serving import OmniDuplexSessionHandler
from vllm_omni.entrypoints.duplex_omni import DuplexOmni

__all__ = ["RELEASE", "Pace", "Release", "StandInEngine", "build_app", "build_omni"]

WORDS: Final = ("Hello", " from", " the", " stand-in", " engine", ".")


@dataclass(frozen=True, slots=True)
class Release:
    """The installed vLLM-Omni release and the serving-layer behaviour it ships."""

    version: str
    #: 0.31+: per-session ``DuplexOutputBuffer``; a cancel removes the response's
    #: queued audio before it is numbered (no late audio, no ``server_event_seq`` gap).
    removes_cancelled_audio: bool
    #: 0.32+: ``playback.ack`` keeps ``truncate: true`` (0.30/0.31 parse it away).
    keeps_ack_truncate: bool

    @classmethod
    def installed(cls) -> Release:
        """Read ``vllm_omni.__version__``."""
        version = Version(vllm_omni.__version__)
        return cls(
            version=vllm_omni.__version__,
            removes_cancelled_audio=version >= Version("0.31.0rc1"),
            keeps_ack_truncate=version >= Version("0.32.0rc1"),
        )


RELEASE: Final = Release.installed()


@dataclass(frozen=True, slots=True)
class Pace:
    """Output of one response: ``chunks`` units of ``chunk_ms``, ``interval_s`` apart."""

    chunk_ms: int = 200
    chunks: int = 5
    interval_s: float = 0.2
    late_chunks: int = 3
    sample_rate: int = 24000


def _tone(ms: int, rate: int) -> str:
    n = rate * ms // 1000
    samples = array.array(
        "h", (int(8000 * math.sin(2 * math.pi * 220 * i / rate)) for i in range(n))
    )
    return base64.b64encode(samples.tobytes()).decode()


@dataclass
class _Session:
    session_id: str
    config: DuplexSessionConfig
    state: projection.RealtimeProjectionState
    epoch: int = 0
    turn_id: int = 0
    committed: bool = False
    active: str | None = None
    produced: int = 0
    producer: asyncio.Task[None] | None = None
    closed: bool = False
    #: 0.31+: the handle's bounded output, given at open (None on 0.30).
    output: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class StandInEngine:
    """The ``DuplexOmniEngine`` surface ``DuplexOmni`` calls, answered in-process."""

    def __init__(self, pace: Pace = Pace(), *, resumable: bool = False) -> None:
        self.pace = pace
        self.duplex_session_config = DuplexSessionRuntimeConfig(max_sessions=16)
        # resumable: the serving layer issues resume tokens and journals events
        # (its session_attachment); a resume the sidecar holds never reaches here.
        self.duplex_capabilities = DuplexCapabilities(
            supports_barge_in=True,
            supports_playback_ack=True,
            supports_session_resume=resumable,
            chunk_period_ms=pace.chunk_ms,
        )
        self.omni: DuplexOmni | None = None
        self.sessions: dict[str, _Session] = {}
        self.commands: list[tuple[str, Any]] = []
        #: ``AckPlayback`` commands as the real serving layer parsed them.
        self.acks: list[Any] = []
        #: Deltas of cancelled responses queued after the cancel arrived.
        self.late_audio_sent = 0
        self._audio = _tone(pace.chunk_ms, pace.sample_rate)

    # ---- what DuplexOmni calls --------------------------------------------------------

    def is_alive(self) -> bool:
        return True

    async def open_session_async(
        self,
        session_id: str,
        session_config: DuplexSessionConfig,
        *,
        output_buffer: Any = None,
        **_: Any,
    ) -> DuplexControlResultMessage:
        if (output_buffer is not None) != RELEASE.removes_cancelled_audio:
            raise AssertionError(
                f"vllm-omni {RELEASE.version} passed output_buffer={output_buffer!r} at open"
            )
        state = projection.RealtimeProjectionState(
            session_id=session_id, model=session_config.model, initial_session_update=True
        )
        session = _Session(
            session_id=session_id, config=session_config, state=state, output=output_buffer
        )
        self.sessions[session_id] = session
        public = self._public_session(session)
        # The runner's first event; the projection adds the session.updated that follows.
        self._project(session, {"type": "session.created", "session": public})
        return DuplexControlResultMessage(
            control_id=uuid.uuid4().hex,
            operation="open",
            session_id=session_id,
            ok=True,
            lease_generation=1,
            capabilities=self.duplex_capabilities,
            public_session=public,
        )

    async def submit_command_async(self, session_id: str, command: Any) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise DuplexSessionError(
                "unknown session", code="unknown_session", session_id=session_id
            )
        self.commands.append((session_id, command))
        async with session.lock:
            self._handle(session, command)

    async def close_session_async(
        self, session_id: str, *, reason: str = "client_close", **_: Any
    ) -> DuplexControlResultMessage:
        session = self.sessions.get(session_id)
        if session is not None:
            await self._close(session, reason)
        return DuplexControlResultMessage(
            control_id=uuid.uuid4().hex, operation="close", session_id=session_id, ok=True
        )

    async def touch_session_async(self, session_id: str, **_: Any) -> DuplexControlResultMessage:
        return DuplexControlResultMessage(
            control_id=uuid.uuid4().hex, operation="touch", session_id=session_id, ok=True
        )

    async def resume_session_async(self, session_id: str, **_: Any) -> DuplexControlResultMessage:
        raise DuplexSessionError(
            "resume is not supported", code="unsupported_session_resume", session_id=session_id
        )

    # ---- the session -----------------------------------------------------------------

    def _public_session(self, s: _Session) -> dict[str, object]:
        return {
            "id": s.session_id,
            "state": "active",
            "turn_state": "speaking" if s.active else "listening",
            "epoch": s.epoch,
            "turn_id": s.turn_id,
            "active_response_id": s.active,
            "model": s.config.model,
            "modalities": list(s.config.modalities),
            "capabilities": self.duplex_capabilities.as_dict(),
        }

    def _emit(self, s: _Session, events: list[Any]) -> None:
        assert self.omni is not None
        for event in events:
            bound = dataclasses.replace(event, session_id=s.session_id, epoch=s.epoch)
            if s.output is not None and not isinstance(bound, duplex_events.SessionClosed):
                # 0.31+: the session manager puts output straight into the
                # handle's buffer; only the closing notice travels as a message.
                s.output.put(bound)
                continue
            self.omni._route_engine_message(
                DuplexSessionEventMessage(session_id=s.session_id, event=bound)
            )

    def _project(self, s: _Session, internal: Mapping[str, object]) -> None:
        self._emit(s, projection.project_internal_event(s.state, internal))

    def _error(self, s: _Session, code: str, message: str, command: Any) -> None:
        self._emit(s, [duplex_events.error_event(code, message, event_id=command.event_id)])

    def _handle(self, s: _Session, command: Any) -> None:
        c = duplex_commands
        if isinstance(command, c.AppendAudio):
            self._emit(s, projection.note_input_append(s.state, command.payload()))
        elif isinstance(command, c.Commit):
            self._commit(s, command)
        elif isinstance(command, c.CreateResponse):
            if s.active is not None:
                self._error(s, "response_already_active", "a response is active", command)
            elif not s.committed:
                self._error(s, "response_create_without_input", "commit audio first", command)
            else:
                self._start_response(s)
        elif isinstance(command, c.CancelResponse):
            self._cancel(s, command)
        elif isinstance(command, c.ClearInput):
            projection.clear_input_buffer(s.state)
            self._emit(s, [duplex_events.InputCleared()])
        elif isinstance(command, c.Heartbeat):
            self._emit(s, [duplex_events.SessionHeartbeatAck()])
        elif isinstance(command, c.UpdateSession):
            s.state.apply_session_defaults(dict(command.patch))
            public = {**self._public_session(s), **dict(command.patch)}
            self._project(s, {"type": "session.updated", "session": public})
        elif isinstance(command, c.AckPlayback):
            self.acks.append(command)
            details = {
                "type": "playback.acknowledged",
                "session_id": s.session_id,
                "epoch": s.epoch,
                "item_id": command.item_id,
                "played_ms": command.played_ms,
                "committed_ms": command.committed_ms
                if command.committed_ms is not None
                else command.played_ms,
                # As the released ledgers: echo the flag the parser left on the command.
                "truncate": getattr(command, "truncate", False) is True,
            }
            self._emit(s, [duplex_events.PlaybackAcknowledged(details=details)])
        elif isinstance(command, c.CloseSession):
            asyncio.get_running_loop().create_task(self._close(s, command.reason or "client_close"))
        else:
            self._error(s, "unknown_event", f"{type(command).__name__} is not served here", command)

    def _commit(self, s: _Session, command: Any) -> None:
        resolved = projection.resolve_commit(s.state, command)
        self._emit(s, resolved.events)
        if resolved.payload is None:
            return  # rejected (input_audio_buffer_empty)
        if resolved.payload.get("is_speech") is False:
            self._project(s, {"type": "response.listen", "epoch": s.epoch})
            return
        s.turn_id += 1
        s.committed = True
        self._project(
            s,
            {
                "type": "input.committed",
                "session_id": s.session_id,
                "turn_id": s.turn_id,
                "epoch": s.epoch,
                "history_len": s.turn_id,
                "realtime_item_id": resolved.payload["realtime_item_id"],
                "message": {"role": "user", "transcript": ""},
            },
        )
        auto = s.config.extra_body.get("auto_response") is True
        if (command.create_response or auto) and s.active is None:
            self._start_response(s)

    def _start_response(self, s: _Session) -> None:
        rid = f"resp-{s.session_id}-{s.epoch}-{secrets.token_hex(4)}"
        s.active = rid
        s.produced = 0
        s.committed = False
        self._project(
            s,
            {
                "type": "response.created",
                "response_id": rid,
                "session_id": s.session_id,
                "epoch": s.epoch,
                "turn_id": s.turn_id,
                "modalities": list(s.config.modalities),
            },
        )
        s.producer = asyncio.get_running_loop().create_task(self._produce(s, rid))

    def _delta(self, s: _Session, rid: str, *, last: bool) -> None:
        index = s.produced
        s.produced += 1
        self._project(
            s,
            {
                "type": "response.output_audio.delta",
                "response_id": rid,
                "session_id": s.session_id,
                "epoch": s.epoch,
                "audio": self._audio,
                "text": WORDS[index % len(WORDS)],
                "format": "pcm16",
                "sample_rate_hz": self.pace.sample_rate,
                "model_speak": True,
                "audio_duration_ms": self.pace.chunk_ms,
                "end_of_turn": last,
            },
        )

    async def _produce(self, s: _Session, rid: str) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.pace.interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            async with s.lock:
                if s.active != rid or s.closed:
                    return
                last = s.produced + 1 >= self.pace.chunks
                self._delta(s, rid, last=last)
                if last:
                    s.active = None
                    return

    def _cancel(self, s: _Session, command: Any) -> None:
        resolved = projection.resolve_cancel_response(s.state, command)
        self._emit(s, resolved.events)
        if not resolved.payloads:
            return
        rid = resolved.payloads[0].get("response_id")
        if s.active is None or rid != s.active:
            if command.response_id is None:
                self._error(s, "response_not_active", "no response is active", command)
            return
        cancelled_epoch = s.epoch
        # Audio the model already produced sits queued ahead of the cancellation
        # notice; on 0.30 the handle's unbounded outbox delivers it.
        for _ in range(min(self.pace.late_chunks, self.pace.chunks - s.produced)):
            self._delta(s, rid, last=False)
            self.late_audio_sent += 1
        if s.output is not None:
            # 0.31+ runner: an accepted cancel removes the response's queued audio.
            s.output.invalidate(rid, through_epoch=cancelled_epoch)
        s.epoch += 1
        s.active = None
        sent_ms = s.produced * self.pace.chunk_ms
        self._project(
            s,
            {
                "type": "audio.cancelled",
                "response_id": rid,
                "reason": "client_cancelled",
                "cancelled_epoch": cancelled_epoch,
                "epoch": s.epoch,
                "committed_ms": 0,
                "playback": {"generated_ms": sent_ms, "sent_ms": sent_ms, "played_ms": 0,
                             "committed_ms": 0},
            },
        )  # fmt: skip

    async def _close(self, s: _Session, reason: str) -> None:
        async with s.lock:
            if s.closed:
                return
            s.closed = True
            s.active = None
            self._project(
                s, {"type": "session.closed", "session_id": s.session_id, "reason": reason}
            )
        if s.producer is not None and not s.producer.done():
            s.producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s.producer


def build_omni(engine: StandInEngine, *, model: str) -> DuplexOmni:
    """A ``DuplexOmni`` over the stand-in engine, without starting an orchestrator."""
    omni = DuplexOmni.__new__(DuplexOmni)
    omni.engine = engine  # type: ignore[assignment]
    omni.model = model
    omni._handles = {}
    omni._resume_compensations = set()
    omni._resume_replay_backoff_s = (0.5, 5.0)
    # AsyncOmni's output pump reads the orchestrator queue; the stand-in routes
    # events itself (``_route_engine_message``), so mark the pump as running.
    omni.final_output_task = object()  # type: ignore[assignment]
    engine.omni = omni
    return omni


def build_app(omni: DuplexOmni) -> Any:
    """The FastAPI app with vLLM-Omni's own routes and duplex app state (api_server style)."""
    from fastapi import FastAPI
    from vllm_omni.entrypoints.openai.api_server import router

    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = omni
    app.state.openai_serving_duplex = OmniDuplexSessionHandler(duplex_omni=omni)
    app.state.duplex_warmup_done = None
    return app
