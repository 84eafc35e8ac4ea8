"""``SessionTelemetry`` (proxy/core/telemetry.py): drops, cancels and timings of one session.

What changed is taken once (``take_*``) and then reads as nothing new; the
lifetime totals stay. Cancel-to-silence windows are bounded like the ledger.
"""

from __future__ import annotations

from proxy.core.telemetry import DropReason, SessionTelemetry


def test_drops_are_taken_once_and_counted_for_the_whole_session() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.count_drop(DropReason.LATE_AUDIO, 100)
    t.count_drop(DropReason.LATE_AUDIO, 50, events=2)
    t.count_drop(DropReason.OVERFLOW, 10)
    assert t.news
    assert t.take_drops() == {DropReason.LATE_AUDIO: (3, 150), DropReason.OVERFLOW: (1, 10)}
    assert t.take_drops() == {}, "taken: nothing new until the next drop"
    t.count_drop(DropReason.LATE_AUDIO, 1)
    assert t.take_drops() == {DropReason.LATE_AUDIO: (1, 1)}
    totals = t.drop_totals()
    assert totals[DropReason.LATE_AUDIO] == (4, 151)
    assert totals[DropReason.OVERFLOW] == (1, 10)
    assert totals[DropReason.SESSION_CLOSED] == (0, 0)
    assert set(totals) == set(DropReason)


def test_a_drop_of_no_events_is_no_news() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.count_drop(DropReason.CANCELLED_AUDIO, 100, events=0)
    assert not t.news
    assert t.take_drops() == {}


def test_cancelled_and_failed_responses_are_counted_and_taken_in_order() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.response_cancelled("r1", 1.0)
    t.response_failed("r2")
    assert t.cancels == 2 and t.news
    assert t.take_cancelled() == ["r1", "r2"]
    assert t.take_cancelled() == []


def test_cancel_to_silence_is_the_last_audio_after_the_cancel() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.response_cancelled("r1", 10.0)
    t.silence_windows["r1"].last_audio_at = 10.25  # the core marks audio written late
    t.observe_silence("r1")
    assert t.take_observations() == ([0.25], [])
    t.observe_silence("r1")
    assert t.take_observations() == ((), ()), "one window, one observation"


def test_a_window_without_late_audio_observes_zero() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.response_cancelled("r1", 3.0)
    t.finish()
    assert t.take_observations() == ([0.0], [])


def test_windows_are_bounded_the_oldest_observed_early() -> None:
    t = SessionTelemetry(max_silence_windows=2)
    for i, rid in enumerate(("r1", "r2", "r3")):
        t.response_cancelled(rid, float(i))
    assert list(t.silence_windows) == ["r2", "r3"]
    silence, _ = t.take_observations()
    assert list(silence) == [0.0], "r1 was observed when r3 opened"


def test_first_audio_timings_are_taken_with_the_silences() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.first_audio(0.4)
    t.first_audio(0.6)
    assert t.take_observations() == ([], [0.4, 0.6])
    assert t.take_observations() == ((), ())


def test_finish_observes_every_open_window() -> None:
    t = SessionTelemetry(max_silence_windows=4)
    t.response_cancelled("r1", 0.0)
    t.response_cancelled("r2", 0.0)
    t.finish()
    assert t.silence_windows == {}
    assert len(t.take_observations()[0]) == 2
