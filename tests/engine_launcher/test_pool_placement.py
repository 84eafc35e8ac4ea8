"""Replica choice, socket-free (engine_launcher/placement.py, engine_launcher/admission.py;
docs/design.md, Engine pool)."""

from __future__ import annotations

import pytest

from engine_launcher.admission import EngineAdmission
from engine_launcher.placement import ReplicaLoad, choose


def load(index: int, sessions: int, pending: int = 0, *, admitting: bool = True) -> ReplicaLoad:
    return ReplicaLoad(index, admitting, sessions, pending)


def ready_router(count: int, max_per_engine: int = 0) -> EngineAdmission:
    router = EngineAdmission(count, max_per_engine)
    for k in range(count):
        router.update(k, "ready", f"ws://127.0.0.1:{9000 + k}")
    return router


def test_fewest_sessions_wins() -> None:
    assert choose([load(0, 3), load(1, 1), load(2, 2)], 0) == 1


def test_ties_go_to_the_lowest_pending_bytes_then_the_lowest_index() -> None:
    assert choose([load(0, 1, 500), load(1, 1, 100), load(2, 1, 300)], 0) == 1
    assert choose([load(0, 1, 7), load(1, 1, 7)], 0) == 0


def test_never_a_replica_that_does_not_admit_or_is_full() -> None:
    assert choose([load(0, 0, admitting=False), load(1, 5)], 0) == 1
    assert choose([load(0, 0, admitting=False), load(1, 2)], 2) is None
    assert choose([], 0) is None


@pytest.mark.parametrize("state", ["starting", "restarting", "stopping", "stopped", "failed"])
def test_a_replica_that_is_not_serving_gets_nothing(state: str) -> None:
    router = ready_router(2)
    router.take(1)
    router.take(1)
    router.update(0, state, "ws://127.0.0.1:9000")  # a stale target is ignored
    assert router.targets[0] is None
    assert router.choose() == 1


def test_unhealthy_but_not_yet_declared_failed_still_serves() -> None:
    router = ready_router(1)
    router.update(0, "unhealthy", "ws://127.0.0.1:9000")
    assert router.choose() == 0


def test_a_draining_replica_gets_nothing_and_says_so() -> None:
    router = ready_router(2)
    router.take(1)
    router.take(1)
    router.set_draining(0, True)
    assert router.choose() == 1
    views = router.views()
    assert (views[0]["state"], views[0]["admitting"]) == ("draining", False)


def test_refusal_tells_capacity_from_not_ready() -> None:
    router = EngineAdmission(2, 1)
    assert router.refusal() is not None and router.refusal()[0] == "not_ready"  # type: ignore[index]
    router.update(0, "ready", "ws://a:1")
    assert router.refusal() is None
    router.take(0)
    assert router.refusal() == ("capacity", "every engine replica is full")
    router.update(1, "ready", "ws://a:2")
    assert router.refusal() is None
    assert router.choose() == 1


def test_slots_are_held_until_released_and_release_is_reported() -> None:
    released: list[int] = []
    router = EngineAdmission(2, 2, on_release=released.append)
    for k in range(2):
        router.update(k, "ready", f"ws://a:{k + 1}")
    placed = []
    for _ in range(4):
        k = router.choose()
        assert k is not None
        router.take(k)
        placed.append(k)
    assert placed == [0, 1, 0, 1]
    assert router.choose() is None
    router.release(1)
    assert released == [1]
    assert router.choose() == 1


def test_sixty_sessions_spread_evenly_and_pending_bytes_break_ties() -> None:
    router = ready_router(3)
    for _ in range(60):
        k = router.choose()
        assert k is not None
        router.take(k)
    assert router.sessions == [20, 20, 20]
    assert router.choose([900, 100, 500]) == 1


def test_a_router_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="count"):
        EngineAdmission(0)


def test_a_replica_whose_engine_said_full_admits_nothing_until_its_backoff_ends() -> None:
    router = ready_router(2)
    router.mark_full(0, until=105.0)
    assert router.choose(now=100.0) == 1, "the next session goes to the other replica"
    assert router.views(100.0)[0]["admitting"] is False
    assert router.views(100.0)[0]["engine_full_for_seconds"] == 5.0
    router.mark_full(1, until=103.0)
    assert router.choose(now=100.0) is None
    assert router.refusal(100.0) == (
        "engine_capacity",
        "the engine said it has no room for another session",
    )
    assert router.retry_after(100.0) == 3.0, "the first backoff to end"
    assert router.choose(now=103.0) == 1, "its backoff is over"
    assert router.refusal(105.0) is None and router.choose(now=105.0) == 0
    assert "engine_full_for_seconds" not in router.views(105.0)[0]


def test_a_full_count_is_capacity_not_engine_capacity() -> None:
    router = ready_router(1, max_per_engine=1)
    router.take(0)
    router.mark_full(0, until=10.0)
    assert router.refusal(5.0) == ("capacity", "every engine replica is full")
