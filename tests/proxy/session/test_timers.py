"""SessionTimers on a manual clock: every deadline fires at its exact injected time."""

from __future__ import annotations

import pytest

from proxy.core.lifecycle import EndReason
from proxy.session.limits import RelayLimits
from proxy.session.timers import SessionTimers, Side
from tests.proxy.session.fakes import ManualScheduler

START = 1000.0


class Listener:
    def __init__(self, scheduler: ManualScheduler) -> None:
        self.scheduler = scheduler
        self.calls: list[tuple[float, str, object]] = []

    def ping_due(self, side: Side) -> None:
        self.calls.append((self.scheduler.now, "ping", side))

    def peer_gone(self, side: Side, silent: float) -> None:
        self.calls.append((self.scheduler.now, "gone", side))

    def time_up(self, reason: EndReason) -> None:
        name = {EndReason.CLIENT_IDLE: "idle", EndReason.MAX_DURATION: "duration"}
        self.calls.append((self.scheduler.now, name.get(reason, reason.value), None))

    def close_deadline_passed(self) -> None:
        self.calls.append((self.scheduler.now, "deadline", None))

    def of(self, what: str) -> list[tuple[float, object]]:
        return [(t - START, arg) for t, name, arg in self.calls if name == what]


def make(**kwargs: float) -> tuple[ManualScheduler, Listener, SessionTimers]:
    scheduler = ManualScheduler(START)
    listener = Listener(scheduler)
    values = {"close_timeout": 5.0, "drain_timeout": 5.0, "upstream_close_timeout": 5.0}
    limits = RelayLimits(**{**values, **kwargs})
    timers = SessionTimers(scheduler, listener, limits)
    timers.start()
    return scheduler, listener, timers


def test_keepalive_pings_a_side_silent_for_half_an_interval_at_each_half_interval_tick() -> None:
    scheduler, listener, _timers = make(heartbeat_interval=20.0)
    scheduler.advance(9.999)
    assert listener.of("ping") == []
    scheduler.advance(0.001)  # t = 10: first tick; both sides silent for 10 s
    assert listener.of("ping") == [(10.0, "client"), (10.0, "upstream")]


def test_keepalive_does_not_ping_a_side_heard_from_recently() -> None:
    scheduler, listener, timers = make(heartbeat_interval=20.0)
    scheduler.advance(9.0)
    timers.last_client_frame = scheduler.now - 0.0  # heard at t = 9
    scheduler.advance(1.0)  # tick at 10: client silent 1 s, upstream 10 s
    assert listener.of("ping") == [(10.0, "upstream")]


def test_a_side_silent_for_two_intervals_is_gone_at_the_first_tick_after() -> None:
    scheduler, listener, timers = make(heartbeat_interval=20.0)
    timers.last_upstream_frame = START + 35.0  # upstream keeps talking
    scheduler.advance(39.999)
    assert listener.of("gone") == []
    scheduler.advance(0.001)  # t = 40 = 2 intervals of client silence
    assert listener.of("gone") == [(40.0, "client")]


def test_keepalive_off_arms_no_timer() -> None:
    scheduler, _listener, _timers = make(heartbeat_interval=0.0)
    assert scheduler.pending() == []


def test_idle_fires_exactly_after_the_timeout_without_client_events() -> None:
    scheduler, listener, _timers = make(client_idle_timeout=30.0)
    scheduler.advance(29.999)
    assert listener.of("idle") == []
    scheduler.advance(0.001)
    assert listener.of("idle") == [(30.0, None)]


def test_idle_is_pushed_back_by_client_events_not_by_frames() -> None:
    scheduler, listener, timers = make(client_idle_timeout=30.0)
    scheduler.advance(20.0)
    timers.last_client_event = scheduler.now  # a data frame at t = 20
    timers.last_client_frame = START + 45.0  # pings/pongs do not count
    scheduler.advance(10.0)  # t = 30: idle only 10 s, re-armed for t = 50
    assert listener.of("idle") == []
    scheduler.advance(19.999)
    assert listener.of("idle") == []
    scheduler.advance(0.001)
    assert listener.of("idle") == [(50.0, None)]


def test_duration_fires_once_at_the_limit() -> None:
    scheduler, listener, _timers = make(max_session_duration=300.0)
    scheduler.advance(299.999)
    assert listener.of("duration") == []
    scheduler.advance(1000.0)
    assert listener.of("duration") == [(300.0, None)]


@pytest.mark.parametrize("engine_lost", [False, True])
@pytest.mark.parametrize("budget", [0.5, 5.0, 30.0])
def test_close_deadline_fires_budget_seconds_after_it_is_first_armed(
    budget: float, engine_lost: bool
) -> None:
    # close_timeout, or drain_timeout when the engine was lost.
    other = 1000.0
    scheduler, listener, timers = make(
        close_timeout=other if engine_lost else budget,
        drain_timeout=budget if engine_lost else other,
    )
    scheduler.advance(7.0)
    timers.arm_close_deadline(1011 if engine_lost else 1000)
    scheduler.advance(1.0)
    timers.arm_close_deadline(1000 if engine_lost else 1011)  # re-arming changes nothing
    scheduler.advance(budget - 1.0 - 0.001 if budget > 1.0 else 0.0)
    if budget > 1.0:
        assert listener.of("deadline") == []
    scheduler.advance(1000.0)
    assert listener.of("deadline") == [(7.0 + budget, None)]


def test_cancel_stops_every_timer() -> None:
    scheduler, listener, timers = make(
        heartbeat_interval=1.0, client_idle_timeout=2.0, max_session_duration=3.0
    )
    timers.arm_close_deadline()
    timers.cancel()
    scheduler.advance(100.0)
    assert listener.calls == []
