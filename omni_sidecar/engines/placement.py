"""Which engine replica a new session goes to (docs/design.md, Engine pool).

Pure and I/O-free: the server feeds each replica's supervisor state into a
:class:`Router`, the handshake asks it for a replica and holds that replica's
slot for the session's life. No clock, no sockets, no asyncio, so every rule
is tested socket-free (tests/unit/test_pool_placement.py).

Rules:

- A replica admits when its supervisor serves (ready, or unhealthy but not yet
  declared failed), it has a target URL, it is not draining, and it holds
  fewer than ``max_per_engine`` sessions (0 = no per-replica limit).
- Of the admitting replicas the one with the fewest sessions wins, ties by
  the lowest pending output bytes (the clients that read slowest), then the
  lowest index, so the choice is deterministic.
- Slots are taken at placement, before the upstream connect awaits, so two
  handshakes racing each other never both see the same free slot.
- A replica whose engine said it is full (``error`` {resource_exhausted} at
  open) admits nothing until ``mark_full``'s deadline (``engine_full_backoff``
  seconds later): the next session goes to another replica, or is refused
  ``engine_capacity`` without touching the full engine. Time is passed in.

Bound: one entry per replica, ``engine.replicas`` ≤ ``MAX_REPLICAS`` (64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["ReplicaLoad", "Router", "choose"]

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


class Router:
    """Replica states and per-replica session counts, for placement and ``/readyz``.

    Args:
        count: number of replicas (fixed for the process's life).
        max_per_engine: sessions per replica; 0 = unlimited.
        on_release: called with the replica index whenever a session leaves
            it (the pool's drain waits for its replica to empty).
    """

    def __init__(
        self,
        count: int,
        max_per_engine: int = 0,
        *,
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.count = count
        self.max_per_engine = max_per_engine
        self.states = ["starting"] * count
        self.details = [""] * count
        self.targets: list[str | None] = [None] * count
        self.draining = [False] * count
        self.sessions = [0] * count
        #: Until when (monotonic seconds) each replica's engine is taken as full.
        self.full_until = [0.0] * count
        self._on_release = on_release or (lambda index: None)

    def update(self, index: int, state: str, target: str | None, detail: str = "") -> None:
        """The supervisor of ``index`` moved to ``state`` (``target`` while serving)."""
        self.states[index] = state
        self.targets[index] = target if state in SERVING_STATES else None
        self.details[index] = detail

    def set_draining(self, index: int, draining: bool) -> None:
        self.draining[index] = draining

    def serving(self, index: int) -> bool:
        return self.targets[index] is not None and not self.draining[index]

    def full(self, index: int) -> bool:
        return 0 < self.max_per_engine <= self.sessions[index]

    def mark_full(self, index: int, until: float) -> None:
        """Replica ``index``'s engine said it is full: admit nothing there until ``until``."""
        self.full_until[index] = max(self.full_until[index], until)

    def backing_off(self, index: int, now: float) -> bool:
        """Its engine said it is full, less than ``engine_full_backoff`` ago."""
        return self.full_until[index] > now

    def full_for(self, index: int, now: float) -> float:
        """Seconds replica ``index`` still admits nothing after its engine said it is full
        (0: it admits), rounded to the millisecond for ``/readyz`` and the console."""
        return round(max(0.0, self.full_until[index] - now), 3)

    def retry_after(self, now: float) -> float:
        """Seconds until the first serving replica's engine-full backoff ends (0: none)."""
        waits = [
            self.full_until[k] - now
            for k in range(self.count)
            if self.serving(k) and self.backing_off(k, now)
        ]
        return min(waits, default=0.0)

    def loads(self, pending_bytes: Sequence[int] = (), now: float = 0.0) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(
                index=k,
                admitting=self.serving(k) and not self.backing_off(k, now),
                sessions=self.sessions[k],
                pending_bytes=pending_bytes[k] if k < len(pending_bytes) else 0,
            )
            for k in range(self.count)
        ]

    def choose(self, pending_bytes: Sequence[int] = (), now: float = 0.0) -> int | None:
        return choose(self.loads(pending_bytes, now), self.max_per_engine)

    def refusal(self, now: float = 0.0) -> tuple[str, str] | None:
        """Why no session can be placed now: ``not_ready``, ``capacity`` or
        ``engine_capacity`` (every replica with room said it is full); None if one can."""
        serving = [k for k in range(self.count) if self.serving(k)]
        if not serving:
            states = ", ".join(self._state_word(k) for k in range(self.count))
            return "not_ready", f"no engine replica admits sessions ({states})"
        if all(self.full(k) for k in serving):
            return "capacity", "every engine replica is full"
        if all(self.full(k) or self.backing_off(k, now) for k in serving):
            return "engine_capacity", "the engine said it has no room for another session"
        return None

    def take(self, index: int) -> None:
        self.sessions[index] += 1

    def release(self, index: int) -> None:
        self.sessions[index] -= 1
        self._on_release(index)

    def views(self, now: float = 0.0) -> list[dict[str, Any]]:
        """Each replica's state for ``/readyz`` and the console."""
        return [
            {
                "engine": k,
                "state": "draining" if self.draining[k] else self.states[k],
                "admitting": self.serving(k) and not self.full(k) and not self.backing_off(k, now),
                "sessions": self.sessions[k],
                "max_sessions": self.max_per_engine,
                **({"detail": self.details[k]} if self.details[k] else {}),
                **(
                    {"engine_full_for_seconds": self.full_for(k, now)}
                    if self.backing_off(k, now)
                    else {}
                ),
            }
            for k in range(self.count)
        ]

    def _state_word(self, index: int) -> str:
        return f"{index}: {'draining' if self.draining[index] else self.states[index]}"
