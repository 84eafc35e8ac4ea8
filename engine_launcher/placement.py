"""Which engine replica a new session goes to (docs/design.md, Engine pool).

Pure and I/O-free: the rules only, with time passed in, so every rule is
tested socket-free (tests/engine_launcher/test_pool_placement.py). The state they are
applied to (each replica's supervisor state, drain, engine-full backoff and
session count) has one owner, :class:`~engine_launcher.admission.EngineAdmission`.
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
