"""What the session core hands its shell after a call: one drain, and the news for reporters.

``Drain`` is the core's whole output (docs/design.md, Session core): events to
write to the client, frames to send upstream, the next deadline, how the
client's connection closes once the session is over for it, and a ``Report``
when the session's telemetry changed. One object per session, refilled by
every ``SessionCore.drain`` call and read at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from proxy.core.buffer import Entry
from proxy.core.capabilities import EngineVersion
from proxy.core.playback_state import AckErrorCode
from proxy.core.telemetry import DropReason

__all__ = ["NOTHING", "Drain", "Report"]

#: An empty output, shared.
NOTHING: Final[tuple[()]] = ()


class Report:
    """What changed in a session's telemetry since the last report (read-only for reporters).

    Built only when something changed, never per ordinary audio delta.
    """

    __slots__ = (
        "cancelled",
        "drops",
        "engine_full",
        "first_audio",
        "late_after_eviction",
        "lead_at_cancel",
        "learned",
        "overflow_policy",
        "overflows",
        "own_ack_errors",
        "replayed",
        "resume_expired",
        "resume_refused",
        "silence",
    )

    def __init__(
        self,
        *,
        drops: dict[DropReason, tuple[int, int]],
        overflows: int,
        overflow_policy: str,
        cancelled: Sequence[str],
        silence: Sequence[float],
        first_audio: Sequence[float],
        lead_at_cancel: Sequence[float],
        own_ack_errors: Sequence[AckErrorCode],
        learned: EngineVersion | None,
        late_after_eviction: int,
        engine_full: bool,
        replayed: int = 0,
        resume_expired: bool = False,
        resume_refused: bool = False,
    ) -> None:
        #: Dropped (events, bytes) by reason since the last report.
        self.drops = drops
        #: Overflows of the session's own bound since the last report, and the policy applied.
        self.overflows = overflows
        self.overflow_policy = overflow_policy
        #: Responses tombstoned since the last report, oldest first.
        self.cancelled = cancelled
        #: Cancel-to-silence and first-audio timings observed (seconds).
        self.silence = silence
        self.first_audio = first_audio
        #: Audio the client held unplayed at each cancel (seconds).
        self.lead_at_cancel = lead_at_cancel
        #: Errors the engine answered the sidecar's own playback frames with.
        self.own_ack_errors = own_ack_errors
        #: Engine behaviour seen on the wire that the capabilities did not expect.
        self.learned = learned
        #: Late audio of responses whose tombstone was already evicted, since the last report.
        self.late_after_eviction = late_after_eviction
        #: The engine refused this session as full (said once).
        self.engine_full = engine_full
        #: Events replayed to a client that resumed, and a held session whose grace ran out.
        self.replayed = replayed
        self.resume_expired = resume_expired
        #: A ``session.resume`` that reached this session's core was refused (the one answer).
        self.resume_refused = resume_refused


class Drain:
    """The core's output after a call; one per session, refilled by ``SessionCore.drain``.

    The shell writes ``to_client`` (in order, one transport write; they count
    as written), sends ``to_upstream`` (in order), arms one timer at
    ``deadline`` (``Fact.TIMER`` then), and hands the drain to the session's
    observer (``report`` when not None). Once ``close`` is set the session is
    over for its client: the shell delivers what is left within its close
    deadline and closes the connection with that frame (at once for a session
    handed over: ``Phase.HANDED_OVER``).
    """

    __slots__ = (
        "close",
        "deadline",
        "journal_bytes",
        "pending_bytes",
        "pending_events",
        "report",
        "to_client",
        "to_upstream",
    )

    def __init__(self) -> None:
        self.to_client: Sequence[Entry] = ()
        self.to_upstream: Sequence[str] = ()
        #: The client connection's close frame (code, reason); None while the session is open.
        self.close: tuple[int, bytes] | None = None
        #: When the shell reports ``Fact.TIMER`` next (None: no deadline).
        self.deadline: float | None = None
        #: Output still queued after the drain (the registry's process-wide total).
        self.pending_bytes = 0
        self.pending_events = 0
        #: What the resume journal holds (bytes); counts with the pending output.
        self.journal_bytes = 0
        self.report: Report | None = None
