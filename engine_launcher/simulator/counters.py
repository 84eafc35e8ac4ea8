"""What the simulator process counts across its sessions: open-session slots and stats.

:class:`SessionSlots` is ``duplex_session.max_sessions`` (a session that cannot
take a slot is refused); :class:`SimulatorStats` the process-wide counters that
``/metrics`` renders. Both are shared by every session of the process and do no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionSlots", "SimulatorStats"]


class SessionSlots:
    """``duplex_session.max_sessions``: open sessions of one process (no I/O).

    Args:
        limit: most open sessions; ``None`` means no limit.
    """

    __slots__ = ("limit", "taken")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def take(self) -> bool:
        """Claim a slot for a session being opened; ``False`` when full."""
        if self.limit is not None and self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        """Give back a slot claimed by :meth:`take`."""
        self.taken -= 1


@dataclass(slots=True)
class SimulatorStats:
    """Process-wide counters, shared by all sessions (rendered by ``/metrics``)."""

    sessions_active: int = 0
    sessions_total: int = 0
    #: Sessions opened (``session.created`` sent): on connect with ``model=`` and
    #: autostart on, or by the first client event. A socket that closes before
    #: either (a readiness handshake) opens none.
    sessions_opened: int = 0
    events_sent: int = 0
    bytes_sent: int = 0
    responses_completed: int = 0
    responses_cancelled: int = 0
    late_audio_events: int = 0
    removed_audio_events: int = 0
    output_overflows: int = 0
    capacity_rejections: int = 0
    errors_sent: int = 0
    outbox_events: int = 0
    outbox_bytes: int = 0
    #: Sessions whose socket dropped, in their disconnect grace now (a gauge).
    sessions_detached: int = 0
    #: Sessions resumed by a new socket.
    resumes: int = 0
    #: Detached sessions whose grace ran out.
    sessions_expired: int = 0
    #: Sessions whose replay journal overflowed (``journal_overflow``).
    journal_overflows: int = 0
