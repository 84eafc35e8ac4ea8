"""Sans-I/O core of one simulated duplex session: the side that takes client input.

:class:`DuplexSession` does no I/O and reads no clock: the shell feeds it
client frames (``receive_*``), asks for the next audio chunk when the pace
says so (``produce_*``) and takes what to send in order (``next_outgoing``).
It opens sessions and dispatches client frames, on top of ``SessionState``
and ``ResponseGeneration``; what each client event does is in
:mod:`engine_launcher.simulator.handlers`. docs/design.md, Simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.counters import SessionSlots, SimulatorStats
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.generation import ResponseGeneration
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.session_state import Payload, Phase
from engine_launcher.simulator.wire import (
    CLIENT_ALIASES,
    OPENAI_CLIENT_EVENTS,
    OPENAI_UNHANDLED_EVENTS,
    error_payload,
)

__all__ = ["OPENING_EVENTS", "DuplexSession"]

# First messages that open (or resume) a session themselves instead of
# triggering a default open (docs/engine-protocol.md, Opening a session).
OPENING_EVENTS: Final = frozenset({"session.update", "session.resume"})


class DuplexSession(ResponseGeneration):
    """One simulated duplex session.

    Args:
        config: simulator configuration (pace is applied by the shell).
        bank: precomputed output audio.
        stats: process-wide counters to update.
        handlers: client event type -> handler (``handlers.HANDLERS``); passed
            in so that the session, which the handlers operate on, does not
            import them.
        model: model named in the query string, if any.
        slots: the process's open-session slots, if limited.

    Its attributes are those of
    :class:`~engine_launcher.simulator.session_state.SessionState`.
    """

    def __init__(
        self,
        config: SimulatorConfig,
        bank: AudioBank,
        stats: SimulatorStats,
        *,
        handlers: Mapping[str, Callable[[DuplexSession, dict[str, Any]], None]],
        model: str | None = None,
        slots: SessionSlots | None = None,
    ) -> None:
        super().__init__(config, bank, stats, model=model, slots=slots)
        self._handlers = handlers

    # ------------------------------------------------------------------ opening

    def open(self) -> None:
        """Open the session: ``session.created`` (no seq) then ``session.updated``."""
        if self.phase is not Phase.AWAITING_OPEN:
            return
        if self._slots is not None:
            if not self._slots.take():
                self._reject_capacity(self._slots.limit or 0)
                return
            self.holds_slot = True
        self.session_id = "duplex-" + self._ids.hex32()
        self.phase = Phase.OPEN
        self._stats.sessions_opened += 1
        self.emit(
            {
                "type": "session.created",
                "session": self.session_object(),
                "attachment_generation": 1,
                "resume_token": self._ids.hex32(),
            }
        )
        # docs/engine-protocol.md, Server events: session.created is immediately followed by
        # session.updated (the plain realtime handler sends session.created alone).
        if self._outbox.numbered:
            self.emit({"type": "session.updated", "session": self.session_object()})

    def _reject_capacity(self, limit: int) -> None:
        """``duplex_session.max_sessions`` reached: the open is refused, then close 1000.

        The engine sends the error outside the session journal (no
        ``server_event_seq``) and its handler returns, which closes the socket
        normally. 0.32 marks the error ``retryable``.
        """
        self._stats.capacity_rejections += 1
        self._stats.errors_sent += 1
        payload = error_payload(
            "resource_exhausted", f"duplex_session_capacity_exhausted: limit={limit}"
        )
        if self.config.at_least("0.32"):
            payload["error"]["retryable"] = True
        self._outbox.put_outside_journal(payload)
        self._outbox.put_final(CloseFrame(1000, ""))
        self.phase = Phase.CLOSED

    # ------------------------------------------------------------------ feeding

    def receive_text(self, text: str) -> None:
        """Handle one client text frame."""
        if self.phase is Phase.CLOSED:
            return
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            self.error("invalid_json", "message is not valid JSON")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.error("bad_event", "event must be an object with a string type")
            return
        event_type: str = event["type"]
        if not self._outbox.numbered and event_type not in OPENAI_CLIENT_EVENTS:
            self._invalid_event(event, event_type)
            return
        kind = CLIENT_ALIASES.get(event_type, event_type)
        if self.phase is Phase.AWAITING_OPEN and kind not in OPENING_EVENTS:
            # docs/engine-protocol.md, Opening a session: any other first message opens a default
            # session
            # and is then executed as a command.
            self.open()
        handler = self._handlers.get(kind)
        if handler is None:
            self.error("unknown_event", f"unknown event type {event_type!r}", event)
            return
        handler(self, event)

    def _invalid_event(self, event: Payload, event_type: str) -> None:
        """``--session-mode realtime``: a client event outside the OpenAI Realtime handler.

        Duplex-only events (``playback.ack``, ``barge_in``, ``turn.signal``,
        ``input.cancel``, ``session.resume``, aliases ...) fail its schema and are
        answered without the client's ``event_id``; ``output_audio_buffer.clear``
        passes the schema and is answered as an unknown type, with it.
        """
        known = event_type in OPENAI_UNHANDLED_EVENTS
        client_id = event.get("event_id") if known else None
        message = (
            f"Unknown event type: {event_type}" if known else "Invalid or unrecognized client event"
        )
        payload = error_payload("invalid_event", message)
        payload["error"]["param"] = None
        payload["error"]["event_id"] = client_id if isinstance(client_id, str) else None
        self.emit(payload)

    def receive_binary(self) -> None:
        """Binary frames are not part of the protocol (docs/engine-protocol.md, Framing and
        limits)."""
        self.error("bad_event", "binary frames are not supported")

    def receive_oversized(self, size: int) -> None:
        """A client frame above 15 MiB (docs/engine-protocol.md, Framing and limits)."""
        self.error("event_too_large", f"event of {size} bytes exceeds 15 MiB")

    def receive_open_timeout(self) -> None:
        """No first message within the open deadline: ``config_timeout``, then close."""
        if self.phase is Phase.AWAITING_OPEN:
            self.error("config_timeout", "no first message received in time")
            self._outbox.put_final(CloseFrame(1000, "config_timeout"))
            self.phase = Phase.CLOSED
