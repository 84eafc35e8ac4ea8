"""The session state machine (proxy/core/lifecycle.py): every (state, event) pair.

The expected table below is written out independently of ``SESSION_TRANSITIONS`` so
that a changed transition fails here and must be changed in both places (the
module header draws it). Each of the 3 × 3 pairs is applied: a legal pair
gives its target state, an illegal one raises ``InvalidState`` naming the
state and the event. The last tests drive a ``SessionCore`` through each
legal path, so the core's own moves go through the table.
"""

from __future__ import annotations

import itertools

import pytest

from proxy.core.lifecycle import (
    SESSION_TRANSITIONS,
    Fact,
    InvalidState,
    SessionEvent,
    SessionState,
    next_state,
)
from tests.proxy.core.helpers import SessionPair, session_closed

S = SessionState
E = SessionEvent

EXPECTED: dict[tuple[SessionState, SessionEvent], SessionState] = {
    # Open: a closure notice queued starts closing; a client that goes away ends it at once.
    (S.OPEN, E.CLOSURE_QUEUED): S.CLOSING,
    (S.OPEN, E.CLIENT_GONE): S.CLOSED,
    # Closing: the notice written, or the client gone, ends it.
    (S.CLOSING, E.CLOSURE_DELIVERED): S.CLOSED,
    (S.CLOSING, E.CLIENT_GONE): S.CLOSED,
    # Closed absorbs a late closure write and a repeated end report.
    (S.CLOSED, E.CLOSURE_DELIVERED): S.CLOSED,
    (S.CLOSED, E.CLIENT_GONE): S.CLOSED,
}

ALL_PAIRS = list(itertools.product(SessionState, SessionEvent))


def _id(pair: tuple[SessionState, SessionEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def test_table_matches_the_documented_transitions() -> None:
    actual = {
        (state, event): target
        for state, row in SESSION_TRANSITIONS.items()
        for event, target in row.items()
    }
    assert actual == EXPECTED


def test_every_state_has_a_row_and_every_state_absorbs_the_client_going() -> None:
    assert set(SESSION_TRANSITIONS) == set(SessionState)
    for state in SessionState:
        assert SESSION_TRANSITIONS[state][E.CLIENT_GONE] is S.CLOSED, state


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_id)
def test_next_state(pair: tuple[SessionState, SessionEvent]) -> None:
    state, event = pair
    if pair in EXPECTED:
        assert next_state(state, event) is EXPECTED[pair]
    else:
        with pytest.raises(InvalidState) as info:
            next_state(state, event)
        assert info.value.state is state
        assert info.value.event is event
        assert state.value in str(info.value) and event.value in str(info.value)


def test_the_core_moves_open_closing_closed_on_its_closure() -> None:
    p = SessionPair()
    p.upstream(session_closed())
    assert p.core.state is S.CLOSING
    p.deliver()
    assert p.core.state is S.CLOSED
    p.core.receive(Fact.CLIENT_GONE, p.now)  # a second end report changes nothing
    assert p.core.state is S.CLOSED


def test_the_core_moves_open_closed_when_the_client_goes() -> None:
    p = SessionPair()
    p.core.receive(Fact.CLIENT_GONE, p.now)
    assert p.core.state is S.CLOSED
