"""``SessionView``: what everything that reports on a session may read of it.

The observer, the registry, the console, the access log, usage, quotas and
tracing read a session through this read-only view (docs/design.md, Session
core); they never reach the core's parts and write nothing into it. The core
(``SessionCore``) has this shape; only the relay holds it as the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from proxy.core.buffer import BufferStatistics
from proxy.core.ledger import LedgerStatistics
from proxy.core.lifecycle import Outcome, SessionState
from proxy.core.telemetry import DropReason
from proxy.core.usage import UsageRecord

__all__ = ["PlaybackTotals", "SessionStatistics", "SessionView"]


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """A snapshot of one session for /debug/sessions and the console."""

    state: SessionState
    session_id: str | None
    buffer: BufferStatistics
    ledger: LedgerStatistics
    drops: dict[DropReason, tuple[int, int]]
    overflows: int
    cancels: int
    active_response: str | None
    open_responses: tuple[str, ...]


class PlaybackTotals(NamedTuple):
    """The playback ledger's running totals (the observer exports their growth)."""

    audio_sent: float
    acks_sent: int
    truncations_client: int
    truncations_sidecar: int
    paced_bound_releases: int


class SessionView(Protocol):
    """Read-only: attributes without setters and queries without side effects."""

    @property
    def state(self) -> SessionState: ...

    @property
    def outcome(self) -> Outcome | None: ...

    @property
    def close_code(self) -> int | None:
        """The code the session decided to close the client with (None: not decided)."""

    @property
    def session_id(self) -> str | None:
        """The engine's session id (from ``session.created``)."""

    @property
    def pending_bytes(self) -> int:
        """Output queued for the client, bytes (both budgets)."""

    @property
    def pending_events(self) -> int: ...

    @property
    def closing(self) -> bool:
        """The closure notice is queued: the session is ending."""

    @property
    def resumable(self) -> bool:
        """The engine offers resume and the sidecar holds the session when its client drops."""

    @property
    def journal_bytes(self) -> int:
        """What the resume journal holds (bytes), inside the session's output budget."""

    @property
    def held(self) -> bool:
        """The client dropped and the session waits for a resume (the one home of the fact)."""

    @property
    def detached_at(self) -> float | None:
        """When the client dropped while the session is held for a resume (None: attached)."""

    @property
    def resume_grace_ends_at(self) -> float | None:
        """When a held session ends unless its client resumes (None: not held)."""

    def resume_token_matches(self, token: str) -> bool:
        """A ``session.resume`` presents this session's current token (constant time)."""

    def statistics(self) -> SessionStatistics: ...

    def tombstoned(self) -> list[str]:
        """Cancelled and failed responses still remembered, oldest first."""

    def drop_totals(self) -> dict[DropReason, tuple[int, int]]:
        """Drops by reason over the session's life, as (events, bytes)."""

    def playback_totals(self) -> PlaybackTotals: ...

    def playback_view(self, now: float) -> dict[str, Any]:
        """The playback ledger as JSON (docs/design.md, Playback)."""

    def quota_seconds(self) -> float:
        """Audio seconds this session counts against its key's day quota so far."""

    def usage_record(self, key: str, session_seconds: float, now: float) -> UsageRecord:
        """The session's usage record as it stands at ``now``."""
