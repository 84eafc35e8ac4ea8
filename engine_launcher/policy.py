"""Pure supervision logic: engine states, their transitions, backoff, restart budget,
and what an answer to ``GET /health`` says about an endpoint.

Every state change goes through ``EngineStateMachine.apply``, which looks the
(state, observation) pair up in ``ENGINE_TRANSITIONS``; a missing pair raises
``InvalidTransition`` naming both. Nothing here reads a clock or a random
source: ``now`` and ``rng`` are arguments. The state diagram and the rules:
docs/design.md, Engine supervision.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ENGINE_TRANSITIONS",
    "NO_HEALTH_ROUTE_STATUSES",
    "Backoff",
    "EngineState",
    "EngineStateMachine",
    "HealthVerdict",
    "InvalidTransition",
    "Observation",
    "RestartBudget",
    "health_verdict",
]


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DEGRADED = "degraded"  # health failing, frames still flowing: kept, admits nothing new
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Observation(enum.Enum):
    READY = "ready"  # first health 200 after a start
    HEALTH_OK = "health_ok"
    HEALTH_FAILED = "health_failed"  # one failed poll, below the limit
    UNHEALTHY = "unhealthy"  # failed polls reached the limit
    BUSY = "busy"  # failed polls reached the limit, but engine frames still reach sessions
    EXITED = "exited"  # the child process ended
    START_FAILED = "start_failed"  # could not spawn, or not ready in time
    RESTART = "restart"  # backoff elapsed, budget allows
    GIVE_UP = "give_up"  # restart budget exhausted
    STOP = "stop"
    STOPPED = "stopped"


class InvalidTransition(RuntimeError):
    """An observation that makes no sense in the current state."""

    def __init__(self, state: EngineState, observation: Observation) -> None:
        super().__init__(f"no transition from {state.value} on {observation.value}")
        self.state = state
        self.observation = observation


S = EngineState
O = Observation

ENGINE_TRANSITIONS: Final[dict[EngineState, dict[Observation, EngineState]]] = {
    S.STARTING: {
        O.READY: S.READY,
        O.EXITED: S.RESTARTING,
        O.START_FAILED: S.RESTARTING,
        O.HEALTH_FAILED: S.STARTING,
        O.STOP: S.STOPPING,
    },
    S.READY: {
        O.HEALTH_OK: S.READY,
        O.HEALTH_FAILED: S.UNHEALTHY,
        O.UNHEALTHY: S.RESTARTING,
        O.BUSY: S.DEGRADED,
        O.EXITED: S.RESTARTING,
        O.STOP: S.STOPPING,
    },
    S.UNHEALTHY: {
        O.HEALTH_OK: S.READY,
        O.HEALTH_FAILED: S.UNHEALTHY,
        O.UNHEALTHY: S.RESTARTING,
        O.BUSY: S.DEGRADED,
        O.EXITED: S.RESTARTING,
        O.STOP: S.STOPPING,
    },
    S.DEGRADED: {
        O.HEALTH_OK: S.READY,
        O.BUSY: S.DEGRADED,
        O.UNHEALTHY: S.RESTARTING,
        O.EXITED: S.RESTARTING,
        O.STOP: S.STOPPING,
    },
    S.RESTARTING: {
        O.RESTART: S.STARTING,
        O.GIVE_UP: S.FAILED,
        O.EXITED: S.RESTARTING,
        O.STOP: S.STOPPING,
    },
    S.STOPPING: {O.STOPPED: S.STOPPED, O.EXITED: S.STOPPING, O.STOP: S.STOPPING},
    S.STOPPED: {O.STOP: S.STOPPED},
    S.FAILED: {O.STOP: S.FAILED},
}

del S, O


class EngineStateMachine:
    """Holds the current state; ``apply`` is the only way to change it."""

    def __init__(self) -> None:
        self.state = EngineState.STARTING

    def apply(self, observation: Observation) -> EngineState:
        """Move on an observation.

        Raises:
            InvalidTransition: the pair is not in ``ENGINE_TRANSITIONS``.
        """
        try:
            self.state = ENGINE_TRANSITIONS[self.state][observation]
        except KeyError:
            raise InvalidTransition(self.state, observation) from None
        return self.state

    @property
    def serving(self) -> bool:
        """Sessions may be admitted (an unhealthy engine still serves until it fails)."""
        return self.state is EngineState.READY or self.state is EngineState.UNHEALTHY

    @property
    def running(self) -> bool:
        """The engine runs its sessions: serving, or degraded (admitting nothing new)."""
        return self.serving or self.state is EngineState.DEGRADED


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Exponential backoff with jitter: initial·2^n, capped, ± jitter fraction."""

    initial: float = 1.0
    cap: float = 60.0
    jitter: float = 0.1

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Delay before restart number ``attempt`` (0-based)."""
        base = min(self.cap, self.initial * (2.0 ** min(attempt, 62)))
        spread = base * self.jitter
        return max(0.0, min(self.cap, base + rng.uniform(-spread, spread)))


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window`` seconds."""

    def __init__(self, max_restarts: int, window: float) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._times: deque[float] = deque()

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] >= self.window:
            self._times.popleft()

    def allows(self, now: float) -> bool:
        self._trim(now)
        return len(self._times) < self.max_restarts

    def record(self, now: float) -> None:
        self._trim(now)
        self._times.append(now)

    def recent(self, now: float) -> int:
        """Restarts inside the window; also the backoff attempt number."""
        self._trim(now)
        return len(self._times)


# -- readiness answers --------------------------------------------------------------------------


class HealthVerdict(enum.Enum):
    """What one answer to ``GET /health`` says about the endpoint."""

    HEALTHY = "healthy"  # 200
    NO_HEALTH_ROUTE = "no_health_route"  # the server has no such route: ask another way
    UNHEALTHY = "unhealthy"  # the route is there and says no (5xx, 401, 3xx …)


#: Statuses a server without a health route gives a plain ``GET /health``:
#: 400 (picows: a GET that is not an upgrade), 404 (no such route), 405 (a
#: route for another method) and 426 (the ``websockets`` library: Upgrade
#: Required). None of them says the engine is unwell.
NO_HEALTH_ROUTE_STATUSES: Final = frozenset({400, 404, 405, 426})


def health_verdict(status: int | None) -> HealthVerdict:
    """Classify one answer to ``GET /health``.

    Args:
        status: the HTTP status, or ``None`` when the port answered but not
            with HTTP (garbage, or a close without a status line). A refused
            or timed-out connection is no answer and never reaches here: it
            is unhealthy whatever the probe.

    Returns:
        HEALTHY for 200; NO_HEALTH_ROUTE for :data:`NO_HEALTH_ROUTE_STATUSES`
        and for a non-HTTP answer; UNHEALTHY for every other status, 5xx
        included.
    """
    if status is None or status in NO_HEALTH_ROUTE_STATUSES:
        return HealthVerdict.NO_HEALTH_ROUTE
    if status == 200:
        return HealthVerdict.HEALTHY
    return HealthVerdict.UNHEALTHY
