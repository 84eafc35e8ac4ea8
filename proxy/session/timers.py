"""A session's timers on an injected scheduler (docs/design.md, Relay shell).

Keepalive, client idle, maximum duration, the close deadline, the upstream
close timeout, and the one core deadline (the drain's ``deadline``: paced
audio, playback acks, a held session's grace). The timers decide *when*; the session decides
what happens then (:class:`TimerListener`). Tests drive them with a manual
clock, without sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Literal, Protocol

from proxy.core.lifecycle import CLOSE_ABNORMAL_ENGINE, CLOSE_NORMAL, EndReason
from proxy.session.limits import RelayLimits

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

    def time_up(self, reason: EndReason) -> None:
        """A limit ended the session: ``CLIENT_IDLE`` (no client event for
        ``client_idle_timeout``), ``MAX_DURATION``, or ``UPSTREAM_TIMEOUT`` (the
        engine did not answer the client's ``session.close`` in time)."""

    def close_deadline_passed(self) -> None:
        """The closing session did not finish in time."""

    def core_due(self) -> None:
        """The core's deadline passed (``Fact.TIMER``)."""


class _NoListener:
    """The listener after ``cancel``: the session is let go of (no reference
    cycle through its timers), and a timer that still fires does nothing."""

    def ping_due(self, side: Side) -> None:
        pass

    def peer_gone(self, side: Side, silent: float) -> None:
        pass

    def time_up(self, reason: EndReason) -> None:
        pass

    def close_deadline_passed(self) -> None:
        pass

    def core_due(self) -> None:
        pass


_GONE: Final = _NoListener()


class SessionTimers:
    """The timers of one session. 0 turns a timer off.

    Args:
        scheduler: time source and timer factory.
        listener: called when a timer fires.
        limits: ``heartbeat_interval``, ``client_idle_timeout`` and
            ``max_session_duration`` (seconds; 0 turns a timer off).
    """

    __slots__ = (
        "_close_deadline",
        "_close_timeout",
        "_core",
        "_core_at",
        "_drain_timeout",
        "_duration",
        "_heartbeat",
        "_heartbeat_timer",
        "_idle",
        "_idle_timer",
        "_listener",
        "_max_duration",
        "_scheduler",
        "_upstream_close",
        "close_deadline_at",
        "last_client_event",
        "last_client_frame",
        "last_upstream_frame",
        "started_at",
    )

    def __init__(self, scheduler: Scheduler, listener: TimerListener, limits: RelayLimits) -> None:
        self._scheduler = scheduler
        self._listener: TimerListener = listener
        self._heartbeat = limits.heartbeat_interval
        self._idle = limits.client_idle_timeout
        self._max_duration = limits.max_session_duration
        self._close_timeout = limits.close_timeout
        self._drain_timeout = limits.drain_timeout
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
        self._core: Cancellable | None = None
        self._core_at: float | None = None
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
        """Stop every timer (the session is over) and let go of the listener."""
        for timer in (
            self._duration,
            self._idle_timer,
            self._heartbeat_timer,
            self._close_deadline,
            self._upstream_close,
            self._core,
        ):
            if timer is not None:
                timer.cancel()
        self._duration = self._idle_timer = self._heartbeat_timer = None
        self._close_deadline = self._upstream_close = self._core = None
        self._core_at = None
        self._listener = _GONE

    def arm_core(self, when: float | None) -> None:
        """Wake the session at ``when`` for the core (None: no deadline); the latest call wins."""
        if when == self._core_at:
            return
        if self._core is not None:
            self._core.cancel()
            self._core = None
        self._core_at = when
        if when is not None:
            self._core = self._scheduler.call_at(when, self._core_fired)

    def _core_fired(self) -> None:
        self._core = None
        self._core_at = None
        self._listener.core_due()

    def arm_upstream_close(self, timeout: float) -> None:
        """The client asked to close: the engine has ``timeout`` seconds to answer."""
        if self._upstream_close is None:
            when = self._scheduler.time() + timeout
            self._upstream_close = self._scheduler.call_at(when, self._upstream_close_due)

    def arm_close_deadline(self, code: int = CLOSE_NORMAL) -> None:
        """Give a closing session ``close_timeout`` seconds to finish (``drain_timeout``
        when the engine was lost: its client is closed with ``code`` 1011); only the
        first call counts."""
        if self._close_deadline is not None or self.close_deadline_at is not None:
            return
        budget = self._drain_timeout if code == CLOSE_ABNORMAL_ENGINE else self._close_timeout
        when = self._scheduler.time() + budget
        self.close_deadline_at = when
        self._close_deadline = self._scheduler.call_at(when, self._deadline_passed)

    # -- callbacks -------------------------------------------------------------------------------

    def _expire(self) -> None:
        self._duration = None
        self._listener.time_up(EndReason.MAX_DURATION)

    def _upstream_close_due(self) -> None:
        self._listener.time_up(EndReason.UPSTREAM_TIMEOUT)

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
        self._listener.time_up(EndReason.CLIENT_IDLE)

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
