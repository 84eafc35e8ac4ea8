"""Responses the client asked for and the engine has not created yet.

A ``response.create`` (or a commit with ``response_create``) is remembered
until its ``response.created``; a cancel without a response id covers these
too, so a cancel that races a create leaks no audio ("born cancelled",
docs/design.md, Cancellation). The time asked gives first-audio latency.
Sans-I/O: ``now`` is passed in.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

from proxy.core.events import ClientEvent

__all__ = ["ResponseRequests", "commit_creates_response"]

#: A response request still unanswered after this long no longer counts as in flight.
CREATE_IN_FLIGHT: Final = 10.0

#: ``response.create`` requests remembered per session, awaiting their
#: ``response.created`` (the oldest dropped); the tracing spans keep as many.
MAX_PENDING_CREATES: Final = 64

#: Error codes with which the engine refuses to start a response (docs/engine-protocol.md,
#: Terminal events and errors).
_CREATE_REFUSALS: Final = frozenset(
    {"response_create_without_input", "response_already_active", "input_audio_buffer_empty"}
)


def commit_creates_response(event: ClientEvent) -> bool:
    """An ``input_audio_buffer.commit`` that also asks for a response."""
    if event.type not in ("input_audio_buffer.commit", "input.commit") or event.body is None:
        return False
    return bool(event.body.get("response_create") or event.body.get("create_response"))


class ResponseRequests:
    """Requests in flight, in order, bounded by ``MAX_PENDING_CREATES``."""

    def __init__(self) -> None:
        #: (time asked, client event_id), oldest first.
        self._pending: deque[tuple[float, str | None]] = deque(maxlen=MAX_PENDING_CREATES)
        self._born_cancelled = 0
        #: When each created response was asked for (until its first audio is written).
        self.asked_at: dict[str, float] = {}

    def asked(self, now: float, event_id: str | None) -> None:
        self._pending.append((now, event_id))

    def created(self, response_id: str) -> bool:
        """``response.created``: True when a cancel already covered it (born cancelled)."""
        if self._pending:
            self.asked_at[response_id] = self._pending.popleft()[0]
        if self._born_cancelled > 0:
            self._born_cancelled -= 1
            return True
        return False

    def cancel_in_flight(self, now: float) -> None:
        """A cancel without a response id: the requests in flight are born cancelled.

        A request older than ``CREATE_IN_FLIGHT`` was answered some way not
        recognised; it must not cancel a later response.
        """
        self._born_cancelled = sum(
            1 for asked, _ in self._pending if now - asked < CREATE_IN_FLIGHT
        )

    @property
    def born_cancelled(self) -> int:
        """Requests in flight a cancel already covers (their response is not created yet)."""
        return self._born_cancelled

    def refused(self, body: dict[str, Any] | None) -> None:
        """An engine ``error`` that may answer a request: that response never comes.

        Matched by the echoed ``error.event_id`` when the client set one,
        else by the codes the engine uses to refuse a response.
        """
        error = (body or {}).get("error")
        pending = self._pending
        if not isinstance(error, dict) or not pending:
            return
        echoed = error.get("event_id")
        index = None
        if isinstance(echoed, str):
            index = next((i for i, (_, eid) in enumerate(pending) if eid == echoed), None)
        elif error.get("code") in _CREATE_REFUSALS:
            index = 0
        if index is None:
            return
        del pending[index]
        self._born_cancelled = min(self._born_cancelled, len(pending))
