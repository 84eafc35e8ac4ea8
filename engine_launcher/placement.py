"""Which engine replica a new session goes to (docs/design.md, Engine pool).

Pure and I/O-free: the rules only. The state they are applied to (each
replica's supervisor state, drain, engine-full backoff and session count) has
one owner, :class:`~engine_launcher.admission.EngineAdmission`; the
handshake asks it for a replica and holds that replica's slot for the
session's life. No clock, no sockets, no asyncio, so every rule is tested
socket-free (tests/unit/test_pool_placement.py).

Rules:

- A replica admits when its supervisor serves (ready, or unhealthy but not yet
  declared failed; not degraded: its health fails while its sessions still run),
  it has a target URL, it is not draining, and it holds
  fewer than ``max_per_engine`` sessions (0 = no per-replica limit).
- Of the admitting replicas the one with the fewest sessions wins, ties by
  the lowest pending output bytes (the clients that read slowest), then the
  lowest index, so the choice is deterministic.
- Slots are taken at placement, before the upstream connect awaits, so two
  handshakes racing each other never both see the same free slot.
- A replica whose engine said it is full (``error`` {resource_exhausted} at
  open) admits nothing until ``EngineAdmission.mark_full``'s deadline (``engine_full_backoff``
  seconds later): the next session goes to another replica, or is refused
  ``engine_capacity`` without touching the full engine. Time is passed in.

Bound: one entry per replica, ``engine.replicas`` ≤ ``MAX_REPLICAS`` (64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["SERVING_STATES", "ReplicaLoad", "choose"]

#: Supervisor states in which a replica may take sessions (EngineState values).
SERVING_STATES: Final = frozenset({"ready", "unhealthy"})


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What placement needs to know about one replica at one moment."""

    index: int
    admitting: bool
    sessions: int
    pending_bytes: int


def choose(replicas: Sequence[ReplicaLoad], max_per_engine: int) -> int | None:
    """The replica for a new session, or None when none admits or all are full."""
    candidates = [
        r for r in replicas if r.admitting and (max_per_engine <= 0 or r.sessions < max_per_engine)
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda r: (r.sessions, r.pending_bytes, r.index))
    return best.index
