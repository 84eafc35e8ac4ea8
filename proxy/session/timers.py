"""A session's timers: keepalive, idle timeout, maximum duration, close deadline.

Time comes from an injected :class:`Scheduler` (the event loop in production,
a manual clock in tests), so every deadline can be checked at exact injected
times without sleeping. The timers decide *when*; what happens then is the
session's business, through :class:`TimerListener`.

- **Keepalive** (``heartbeat_interval``): every half interval, a side silent
  for half an interval is pinged; a side silent for two intervals (no frame,
  no pong) is gone. A live peer is thus never silent for much more than one
  interval plus a round trip: a full interval of margin. Activity is a
  timestamp the session stores per received frame, so keepalive costs nothing
  per event.
- **Idle** (``client_idle_timeout``): no client *event* (data frame) for that
  long ends the session. Pings and pongs are not events: a client that only
  answers pings is idle.
- **Duration** (``max_session_duration``).
- **Close deadline**: once a session is closing it has a bounded time to
  deliver its final events and close frame, also while its client does not
  read; then the connection is dropped.
- **Pacing and playback**: one-shot wake-ups at the times the core asks
  for (paced audio release, playback acks).
- **Upstream close** (``upstream_close_timeout``): starts when the client
  sends ``session.close``; if the engine has not answered by then, the proxy
  closes the session itself, so a close always completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, Protocol

__all__ = ["LoopScheduler", "Scheduler", "SessionTimers", "Side", "TimerListener"]

Side = Literal["client", "upstream"]


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """Time and timers (``asyncio.AbstractEventLoop`` has this shape)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopScheduler:
    """The running event loop as a :class:`Scheduler`."""

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()

    def time(self) -> float:
        return self._loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        return self._loop.call_at(when, callback)


class TimerListener(Protocol):
    """What the session does when a timer fires."""

    def ping_due(self, side: Side) -> None:
        """Send a keepalive ping to ``side``."""

    def peer_gone(self, side: Side, silent: float) -> None:
        """``side`` was silent for two keepalive intervals: drop it."""

    def client_idle(self, idle: float) -> None:
        """No client event for ``client_idle_timeout``."""

    def duration_reached(self) -> None:
        """``max_session_duration`` passed."""

    def close_deadline_passed(self) -> None:
        """The closing session did not finish in time."""

    def upstream_close_timed_out(self) -> None:
        """The engine did not answer the client's ``session.close`` in time."""

    def pace_due(self) -> None:
        """Paced audio held back may be released now."""

    def playback_due(self) -> None:
        """Playback acks may be due."""


class SessionTimers:
    """The timers of one session. 0 turns a timer off.

    Args:
        scheduler: time source and timer factory.
        listener: called when a timer fires.
        heartbeat_interval: keepalive period, seconds.
        client_idle_timeout: seconds without a client event.
        max_session_duration: seconds.
    """

    __slots__ = (
        "_close_deadline",
        "_duration",
        "_heartbeat",
        "_heartbeat_timer",
        "_idle",
        "_idle_timer",
        "_listener",
        "_max_duration",
        "_pace",
        "_pace_at",
        "_playback",
        "_scheduler",
        "_upstream_close",
        "close_deadline_at",
        "last_client_event",
        "last_client_frame",
        "last_upstream_frame",
        "started_at",
    )

    def __init__(
        self,
        scheduler: Scheduler,
        listener: TimerListener,
        *,
        heartbeat_interval: float = 0.0,
        client_idle_timeout: float = 0.0,
        max_session_duration: float = 0.0,
    ) -> None:
        self._scheduler = scheduler
        self._listener = listener
        self._heartbeat = heartbeat_interval
        self._idle = client_idle_timeout
        self._max_duration = max_session_duration
        now = scheduler.time()
        self.started_at = now
        #: Last frame of any kind from each side (keepalive).
        self.last_client_frame = now
        self.last_upstream_frame = now
        #: Last data frame from the client (idle timeout).
        self.last_client_event = now
        self._heartbeat_timer: Cancellable | None = None
        self._idle_timer: Cancellable | None = None
        self._duration: Cancellable | None = None
        self._close_deadline: Cancellable | None = None
        self._upstream_close: Cancellable | None = None
        self._pace: Cancellable | None = None
        self._pace_at = 0.0
        self._playback: Cancellable | None = None
        self.close_deadline_at: float | None = None

    def now(self) -> float:
        return self._scheduler.time()

    def start(self) -> None:
        """Arm the timers that are on."""
        now = self._scheduler.time()
        if self._max_duration > 0:
            self._duration = self._scheduler.call_at(now + self._max_duration, self._expire)
        if self._idle > 0:
            self._idle_timer = self._scheduler.call_at(now + self._idle, self._check_idle)
        if self._heartbeat > 0:
            self._heartbeat_timer = self._scheduler.call_at(
                now + self._heartbeat / 2, self._heartbeat_tick
            )

    def cancel(self) -> None:
        """Stop every timer (the session is over)."""
        for timer in (
            self._duration,
            self._idle_timer,
            self._heartbeat_timer,
            self._close_deadline,
            self._upstream_close,
            self._pace,
            self._playback,
        ):
            if timer is not None:
                timer.cancel()
        self._duration = self._idle_timer = self._heartbeat_timer = None
        self._close_deadline = self._upstream_close = self._pace = self._playback = None

    def arm_pace(self, when: float) -> None:
        """Wake the session at ``when`` to release paced audio (the earliest wins)."""
        if self._pace is not None:
            if self._pace_at <= when:
                return
            self._pace.cancel()
        self._pace_at = when
        self._pace = self._scheduler.call_at(when, self._pace_fired)

    @property
    def playback_armed(self) -> bool:
        return self._playback is not None

    def arm_playback(self, when: float) -> None:
        """Wake the session at ``when`` for playback acks, unless already armed."""
        if self._playback is None:
            self._playback = self._scheduler.call_at(when, self._playback_fired)

    def _pace_fired(self) -> None:
        self._pace = None
        self._listener.pace_due()

    def _playback_fired(self) -> None:
        self._playback = None
        self._listener.playback_due()

    def arm_upstream_close(self, timeout: float) -> None:
        """The client asked to close: the engine has ``timeout`` seconds to answer."""
        if self._upstream_close is None:
            when = self._scheduler.time() + timeout
            self._upstream_close = self._scheduler.call_at(when, self._upstream_close_due)

    def arm_close_deadline(self, budget: float) -> None:
        """Give a closing session ``budget`` seconds to finish; only the first call counts."""
        if self._close_deadline is not None or self.close_deadline_at is not None:
            return
        when = self._scheduler.time() + budget
        self.close_deadline_at = when
        self._close_deadline = self._scheduler.call_at(when, self._deadline_passed)

    # -- callbacks -------------------------------------------------------------------------------

    def _expire(self) -> None:
        self._duration = None
        self._listener.duration_reached()

    def _upstream_close_due(self) -> None:
        self._listener.upstream_close_timed_out()

    def _deadline_passed(self) -> None:
        self._close_deadline = None
        self._listener.close_deadline_passed()

    def _check_idle(self) -> None:
        now = self._scheduler.time()
        idle = now - self.last_client_event
        if idle < self._idle:
            self._idle_timer = self._scheduler.call_at(now + self._idle - idle, self._check_idle)
            return
        self._idle_timer = None
        self._listener.client_idle(idle)

    def _heartbeat_tick(self) -> None:
        now = self._scheduler.time()
        interval = self._heartbeat
        self._heartbeat_timer = self._scheduler.call_at(now + interval / 2, self._heartbeat_tick)
        sides: tuple[tuple[Side, float], ...] = (
            ("client", self.last_client_frame),
            ("upstream", self.last_upstream_frame),
        )
        for side, last in sides:
            silent = now - last
            if silent >= 2 * interval:
                self._listener.peer_gone(side, silent)
            elif silent >= interval / 2:
                self._listener.ping_due(side)
