"""Whether, and where, each engine replica admits: the one owner of that state.

Every question "may a session go to this engine now?" is answered here, from
what the pool reports (``update``, ``set_draining``) and what the edge learns
at a session's open (``mark_full``, ``take``/``release``); the edge, ``/readyz``,
the console and (:meth:`publish_to`) the gauges read it. Who writes and reads
what: docs/design.md, Admission and lifecycle; Engine pool. The choice's rules
are engine_launcher/placement.py. No I/O; the clock is passed in (``now``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from engine_launcher.placement import SERVING_STATES, ReplicaLoad, choose

if TYPE_CHECKING:
    from metrics import SidecarMetrics

__all__ = ["FAILURE_CAUSES", "STATE_RANK", "EngineAdmission"]

#: Causes that count as a failure worth showing (policy.Observation values).
FAILURE_CAUSES: Final = frozenset(
    {"exited", "unhealthy", "start_failed", "give_up", "health_failed"}
)
#: The pool's unlabelled engine_state is its most serving replica's, in this order.
STATE_RANK: Final = (
    "ready",
    "unhealthy",
    "degraded",
    "starting",
    "restarting",
    "stopping",
    "failed",
    "stopped",
)


class EngineAdmission:
    """Every replica's admission state, for placement, ``/readyz``, the console and metrics.

    Args:
        count: number of replicas (fixed for the process's life).
        max_per_engine: sessions per replica; 0 = unlimited.
        on_release: called with the replica index whenever a session leaves
            it (the pool's drain waits for its replica to empty).
        restarts: a replica's restarts over all its runs (the pool counts them).
        live_target: the URL a replica's current supervisor would relay to,
            serving or not (the console shows it).
        clock: monotonic seconds (``ready_since``); ``wall``: Unix seconds
            (``last_failure_at``, shown to people).
    """

    def __init__(
        self,
        count: int,
        max_per_engine: int = 0,
        *,
        on_release: Callable[[int], None] | None = None,
        restarts: Callable[[int], int] = lambda index: 0,
        live_target: Callable[[int], str | None] = lambda index: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
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
        #: Monotonic seconds each replica became ready (None: not ready now).
        self.ready_since: list[float | None] = [None] * count
        #: Each replica's last failure ("cause: detail") and when (Unix seconds).
        self.last_failure = [""] * count
        self.last_failure_at: list[float | None] = [None] * count
        #: Some replica serves; else ``not_ready_reason`` says which change left none.
        self.ready = False
        self.not_ready_reason = "engine is starting"
        self._on_release = on_release or (lambda index: None)
        self._restarts = restarts
        self._live_target = live_target
        self._clock = clock
        self._wall = wall
        self._metrics: SidecarMetrics | None = None

    # -- what the pool reports -------------------------------------------------------------

    def update(
        self, index: int, state: str, target: str | None, detail: str = "", cause: str = ""
    ) -> None:
        """The supervisor of ``index`` moved to ``state`` (``target`` while serving).

        ``state`` and ``cause`` are ``EngineState``/``Observation`` values.
        """
        if state == "ready" and self.states[index] != "ready":
            self.ready_since[index] = self._clock()
        elif state != "ready":
            self.ready_since[index] = None
        if cause in FAILURE_CAUSES:
            self.last_failure[index] = f"{cause}: {detail}" if detail else cause
            self.last_failure_at[index] = self._wall()
        self.states[index] = state
        self.targets[index] = target if state in SERVING_STATES else None
        self.details[index] = detail
        if self.any_serving():
            self.ready = True
            self.not_ready_reason = ""
        else:
            prefix = "engine" if self.count == 1 else f"engine {index}"
            self._not_ready(f"{prefix} is {state}" + (f": {detail}" if detail else ""))
        metrics = self._metrics
        if metrics is not None:
            metrics.engine_replica_up.labels(str(index)).set(
                1.0 if state == "ready" and not self.draining[index] else 0.0
            )
            # The unlabelled family describes the pool: its most serving replica.
            metrics.set_engine_state(self.pool_state())

    def set_draining(self, index: int, draining: bool) -> None:
        """Replica ``index`` began (True) or ended (False) a drain."""
        self.draining[index] = draining
        metrics = self._metrics
        if metrics is not None:
            metrics.engine_replica_draining.labels(str(index)).set(1.0 if draining else 0.0)
            if draining:
                metrics.engine_replica_up.labels(str(index)).set(0.0)
        if not self.any_serving():
            self._not_ready(f"engine {index} is draining")

    def _not_ready(self, reason: str) -> None:
        self.ready = False
        self.not_ready_reason = reason

    def publish_to(self, metrics: SidecarMetrics) -> None:
        """Set the engine gauges from here from now on (the metrics need the count first)."""
        self._metrics = metrics
        for index in range(self.count):
            metrics.engine_replica_sessions.labels(str(index)).set_function(
                lambda index=index: self.sessions[index]  # type: ignore[misc]
            )
        metrics.set_engine_state("starting")

    # -- what the edge reports -------------------------------------------------------------

    def mark_full(self, index: int, until: float) -> None:
        """Replica ``index``'s engine said it is full: admit nothing there until ``until``."""
        self.full_until[index] = max(self.full_until[index], until)

    def take(self, index: int) -> None:
        self.sessions[index] += 1

    def release(self, index: int) -> None:
        self.sessions[index] -= 1
        self._on_release(index)

    # -- placement -------------------------------------------------------------------------

    def serving(self, index: int) -> bool:
        return self.targets[index] is not None and not self.draining[index]

    def any_serving(self) -> bool:
        return any(self.serving(k) for k in range(self.count))

    def first_serving_target(self) -> str | None:
        """Where plain HTTP requests go: the first replica that serves."""
        for index in range(self.count):
            target = self.targets[index]
            if target is not None and self.serving(index):
                return target
        return None

    def full(self, index: int) -> bool:
        return 0 < self.max_per_engine <= self.sessions[index]

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

    # -- views -----------------------------------------------------------------------------

    def pool_state(self) -> str:
        """The most serving replica's state (``STATE_RANK``), for the unlabelled gauge."""
        states = set(self.states)
        for state in STATE_RANK:
            if state in states:
                return state
        return self.states[0]

    def views(self, now: float = 0.0) -> list[dict[str, Any]]:
        """Each replica's state for ``/readyz`` and the drain answer."""
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

    def uptime(self, index: int) -> float | None:
        """Seconds replica ``index`` has been ready (None: it is not), to the millisecond."""
        since = self.ready_since[index]
        return None if since is None else round(self._clock() - since, 3)

    def restarts(self, index: int) -> int:
        return self._restarts(index)

    def live_target(self, index: int) -> str | None:
        return self._live_target(index)

    def _state_word(self, index: int) -> str:
        return f"{index}: {'draining' if self.draining[index] else self.states[index]}"
