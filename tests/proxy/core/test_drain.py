"""``Drain`` and ``Report`` (proxy/core/drain.py): the core's whole output after a call.

One object per session, refilled by every ``SessionCore.drain``; a ``Report`` only
when something changed; the close code only with the closure notice.
"""

from __future__ import annotations

from proxy.core.drain import NOTHING
from proxy.core.lifecycle import EndReason
from proxy.core.session_core import SessionCore
from proxy.core.telemetry import DropReason
from tests.proxy.core.helpers import (
    audio,
    b_response_cancel,
    make_settings,
    response_created,
    transcript_delta,
)

ROOM = 1 << 20


def _core() -> SessionCore:
    return SessionCore(make_settings(), new_event_id=lambda: "event_proxy")


def test_every_drain_is_the_same_object_refilled() -> None:
    core = _core()
    first = core.drain(0.0, ROOM)
    core.receive_upstream(response_created("r1"), 0.0)
    second = core.drain(0.0, ROOM)
    assert second is first
    assert [e.event.type for e in second.to_client] == ["response.created"]


def test_nothing_to_do_is_the_shared_empty_output() -> None:
    drain = _core().drain(0.0, ROOM)
    assert drain.to_client is NOTHING and drain.to_upstream is NOTHING
    assert drain.close is None and drain.report is None and drain.deadline is None


def test_no_room_takes_nothing_and_says_what_stays_queued() -> None:
    core = _core()
    text = response_created("r1")
    core.receive_upstream(text, 0.0)
    drain = core.drain(0.0, 0)
    assert drain.to_client is NOTHING
    assert (drain.pending_events, drain.pending_bytes) == (1, len(text.encode()))


def test_events_are_taken_in_order_while_they_fit_and_a_larger_one_alone() -> None:
    core = _core()
    frames = [response_created("r1"), transcript_delta("r1"), audio("r1", 4000)]
    for text in frames:
        core.receive_upstream(text, 0.0)
    small = len(frames[0].encode()) + len(frames[1].encode())
    drain = core.drain(0.0, small)
    assert [e.event.text for e in drain.to_client] == frames[:2]
    drain = core.drain(0.0, 10)
    assert [e.event.is_audio for e in drain.to_client] == [True], "one event larger than the room"


def test_the_close_frame_comes_once_the_session_ends_and_stays() -> None:
    core = _core()
    core.receive_upstream(response_created("r1"), 0.0)
    assert core.drain(0.0, 0).close is None, "an open session has no close"
    core.receive(EndReason.SHUTDOWN, 0.0)
    first = core.drain(0.0, 1)
    assert not any(e.closure for e in first.to_client), "the closure notice comes later"
    assert first.close == (1001, b"shutdown"), "deliver what is left, then close so"
    last = core.drain(0.0, ROOM)
    assert last.to_client[-1].closure and last.close == (1001, b"shutdown")


def test_a_report_comes_only_when_something_changed() -> None:
    core = _core()
    core.receive_upstream(response_created("r1"), 0.0)
    assert core.drain(0.0, 0).report is None
    core.receive_client(b_response_cancel("r1"), 0.0)
    core.receive_upstream(audio("r1", 400, seq=1), 0.0)  # late audio of a cancelled response
    report = core.drain(0.0, 0).report
    assert report is not None
    assert report.cancelled == ["r1"]
    assert report.drops[DropReason.LATE_AUDIO][0] == 1
    assert core.drain(0.0, 0).report is None, "reported once"


def test_frames_for_the_engine_are_handed_over_once() -> None:
    core = _core()
    core.receive_upstream(response_created("r1"), 0.0)
    core.receive_client(b_response_cancel(), 0.0)
    drain = core.drain(0.0, 0)
    handed = list(drain.to_upstream)
    assert handed
    assert core.drain(0.0, 0).to_upstream is NOTHING
