"""``SessionView`` (proxy/core/view.py): what reporters may read of a session.

The core has this shape, and reading it changes nothing: a reporter (observer,
registry, console, access log) can read as often as it likes between drains.
"""

from __future__ import annotations

import pytest

from proxy.core.lifecycle import EndReason, Outcome, SessionState
from proxy.core.session_core import SessionCore
from proxy.core.view import PlaybackTotals, SessionStatistics, SessionView
from tests.proxy.core.helpers import (
    audio,
    b_response_cancel,
    make_settings,
    response_created,
    session_created,
)

ROOM = 1 << 20


def _core() -> SessionCore:
    core = SessionCore(make_settings(), new_event_id=lambda: "event_proxy")
    core.receive_upstream(session_created("duplex-7"), 0.0)
    core.receive_upstream(response_created("r1"), 0.0)
    core.receive_upstream(audio("r1", 400, seq=1), 0.0)
    return core


def _members() -> list[str]:
    return [name for name in vars(SessionView) if not name.startswith("_")]


@pytest.mark.parametrize("name", _members())
def test_the_core_has_every_member_of_the_view(name: str) -> None:
    assert hasattr(_core(), name)


def _reads(view: SessionView) -> tuple[object, ...]:
    return (
        view.state,
        view.outcome,
        view.close_code,
        view.session_id,
        view.pending_bytes,
        view.pending_events,
        view.closing,
        view.resumable,
        view.journal_bytes,
        view.held,
        view.detached_at,
        view.resume_grace_ends_at,
        view.resume_token_matches("nope"),
        view.statistics(),
        view.tombstoned(),
        view.drop_totals(),
        view.playback_totals(),
        view.playback_view(1.0),
        view.quota_seconds(),
    )


def test_reading_the_view_changes_nothing() -> None:
    core = _core()
    core.receive_client(b_response_cancel("r1"), 0.0)
    first = _reads(core)
    assert _reads(core) == first
    drain = core.drain(0.0, ROOM)
    assert drain.report is not None, "the news is still there for the drain to report"


def test_the_statistics_are_a_frozen_snapshot_of_the_session() -> None:
    core = _core()
    stats = core.statistics()
    assert isinstance(stats, SessionStatistics)
    assert stats.state is SessionState.OPEN and stats.session_id == "duplex-7"
    assert stats.buffer.pending_events == core.pending_events == 3
    assert stats.active_response == "r1" and stats.open_responses == ("r1",)
    core.drain(0.0, ROOM)
    assert stats.buffer.pending_events == 3, "a snapshot, not a live view"
    with pytest.raises(AttributeError):
        stats.overflows = 1  # type: ignore[misc]


def test_an_ended_session_shows_its_outcome_and_close_code() -> None:
    core = _core()
    core.receive(EndReason.SHUTDOWN, 0.0)
    assert core.closing and core.state is SessionState.CLOSING
    assert core.outcome is Outcome.SHUTDOWN and core.close_code == 1001


def test_a_new_sessions_playback_totals_are_zero_by_name() -> None:
    core = SessionCore(make_settings(), new_event_id=lambda: "event_proxy")
    assert core.playback_totals() == PlaybackTotals(
        audio_sent=0.0,
        acks_sent=0,
        truncations_client=0,
        truncations_sidecar=0,
        paced_bound_releases=0,
    )
