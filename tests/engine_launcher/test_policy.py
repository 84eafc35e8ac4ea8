"""The engine state machine (engine_launcher/policy.py): every (state, observation) pair.

The expected table below is written out independently of ``ENGINE_TRANSITIONS`` so
that a changed transition fails here and must be changed in both places (the
table is part of the contract docs/design.md, Engine supervision, describes). Each of the 8 × 11
pairs is applied to a fresh machine: a legal pair lands in its target state,
an illegal one raises ``InvalidTransition`` naming the state and the
observation and leaves the state unchanged.
"""

from __future__ import annotations

import itertools

import pytest

from engine_launcher.policy import (
    ENGINE_TRANSITIONS,
    EngineState,
    EngineStateMachine,
    InvalidTransition,
    Observation,
)

S = EngineState
O = Observation

EXPECTED: dict[tuple[EngineState, Observation], EngineState] = {
    # Starting: the first health 200 makes it ready; a failed probe keeps waiting.
    (S.STARTING, O.READY): S.READY,
    (S.STARTING, O.HEALTH_FAILED): S.STARTING,
    (S.STARTING, O.EXITED): S.RESTARTING,
    (S.STARTING, O.START_FAILED): S.RESTARTING,
    (S.STARTING, O.STOP): S.STOPPING,
    # Ready: one failed poll makes it unhealthy, the limit or an exit restarts it.
    (S.READY, O.HEALTH_OK): S.READY,
    (S.READY, O.HEALTH_FAILED): S.UNHEALTHY,
    (S.READY, O.UNHEALTHY): S.RESTARTING,
    (S.READY, O.EXITED): S.RESTARTING,
    (S.READY, O.STOP): S.STOPPING,
    # The limit reached while its frames still reach sessions: degraded, not restarted.
    (S.READY, O.BUSY): S.DEGRADED,
    # Unhealthy: recovers on one good poll.
    (S.UNHEALTHY, O.HEALTH_OK): S.READY,
    (S.UNHEALTHY, O.HEALTH_FAILED): S.UNHEALTHY,
    (S.UNHEALTHY, O.UNHEALTHY): S.RESTARTING,
    (S.UNHEALTHY, O.BUSY): S.DEGRADED,
    (S.UNHEALTHY, O.EXITED): S.RESTARTING,
    (S.UNHEALTHY, O.STOP): S.STOPPING,
    # Degraded: a good poll makes it ready; still busy keeps it; no frames or an
    # exit restarts it. Below the limit it never is (failures only reset on a good poll).
    (S.DEGRADED, O.HEALTH_OK): S.READY,
    (S.DEGRADED, O.BUSY): S.DEGRADED,
    (S.DEGRADED, O.UNHEALTHY): S.RESTARTING,
    (S.DEGRADED, O.EXITED): S.RESTARTING,
    (S.DEGRADED, O.STOP): S.STOPPING,
    # Restarting: backoff elapsed, or the budget is spent.
    (S.RESTARTING, O.RESTART): S.STARTING,
    (S.RESTARTING, O.GIVE_UP): S.FAILED,
    (S.RESTARTING, O.EXITED): S.RESTARTING,
    (S.RESTARTING, O.STOP): S.STOPPING,
    # Stopping and the two final states absorb repeated stops.
    (S.STOPPING, O.STOPPED): S.STOPPED,
    (S.STOPPING, O.EXITED): S.STOPPING,
    (S.STOPPING, O.STOP): S.STOPPING,
    (S.STOPPED, O.STOP): S.STOPPED,
    (S.FAILED, O.STOP): S.FAILED,
}

ALL_PAIRS = list(itertools.product(EngineState, Observation))
SERVING = {S.READY, S.UNHEALTHY}


def _id(pair: tuple[EngineState, Observation]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def machine_in(state: EngineState) -> EngineStateMachine:
    machine = EngineStateMachine()
    machine.state = state
    return machine


def test_table_matches_the_documented_transitions() -> None:
    actual = {
        (state, observation): target
        for state, row in ENGINE_TRANSITIONS.items()
        for observation, target in row.items()
    }
    assert actual == EXPECTED


def test_every_state_has_a_row_and_every_state_can_be_stopped() -> None:
    assert set(ENGINE_TRANSITIONS) == set(EngineState)
    for state in EngineState:
        assert O.STOP in ENGINE_TRANSITIONS[state], state


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_id)
def test_apply(pair: tuple[EngineState, Observation]) -> None:
    state, observation = pair
    machine = machine_in(state)
    if pair in EXPECTED:
        assert machine.apply(observation) is EXPECTED[pair]
        assert machine.state is EXPECTED[pair]
    else:
        with pytest.raises(InvalidTransition) as info:
            machine.apply(observation)
        assert info.value.state is state
        assert info.value.observation is observation
        assert str(info.value) == f"no transition from {state.value} on {observation.value}"
        assert machine.state is state  # an illegal observation changes nothing


def test_illegal_pairs_are_exactly_the_rest() -> None:
    illegal = [p for p in ALL_PAIRS if p not in EXPECTED]
    assert len(ALL_PAIRS) == 88
    assert len(illegal) == 88 - len(EXPECTED) == 57


@pytest.mark.parametrize("state", list(EngineState), ids=lambda s: s.value)
def test_serving_only_while_ready_or_unhealthy(state: EngineState) -> None:
    assert machine_in(state).serving is (state in SERVING)


@pytest.mark.parametrize("state", list(EngineState), ids=lambda s: s.value)
def test_running_while_serving_or_degraded(state: EngineState) -> None:
    """A degraded engine keeps its sessions (running) but admits none (not serving)."""
    assert machine_in(state).running is (state in SERVING or state is S.DEGRADED)


def test_a_new_machine_starts_in_starting() -> None:
    assert EngineStateMachine().state is S.STARTING


def test_crash_restart_cycle() -> None:
    machine = EngineStateMachine()
    path = [O.READY, O.HEALTH_FAILED, O.HEALTH_OK, O.EXITED, O.RESTART, O.READY, O.UNHEALTHY]
    states = [machine.apply(o) for o in path]
    assert states == [
        S.READY,
        S.UNHEALTHY,
        S.READY,
        S.RESTARTING,
        S.STARTING,
        S.READY,
        S.RESTARTING,
    ]
    assert machine.apply(O.GIVE_UP) is S.FAILED
    assert machine.apply(O.STOP) is S.FAILED
    with pytest.raises(InvalidTransition):
        machine.apply(O.RESTART)


def test_failed_and_stopped_are_final() -> None:
    for final in (S.FAILED, S.STOPPED):
        reachable = set(ENGINE_TRANSITIONS[final].values())
        assert reachable == {final}
