"""OutputBuffer (proxy/core/buffer.py): docs/design.md, Output buffer, docs/engine-protocol.md,
Bounded output upstream.

Budgets and their exact boundaries, the reserve for ``error``/``response.done``,
FIFO order across both budgets, the closure slot, the held event, per-response
invalidation and statistics.
"""

from __future__ import annotations

import pytest

from proxy.core.buffer import (
    DEFAULT_MAX_CLOSE_NOTICE_BYTES,
    DEFAULT_MAX_PENDING_OUTPUT_BYTES,
    DEFAULT_MAX_PENDING_OUTPUT_EVENTS,
    DEFAULT_OUTPUT_RESERVE_BYTES,
    DEFAULT_OUTPUT_RESERVE_EVENTS,
    BufferLimits,
    Entry,
    Offer,
    OutputBuffer,
)
from proxy.core.events import UpstreamEvent
from proxy.core.notices import compact_session_closed, session_closed
from tests.proxy.core.helpers import sized_event

ORDINARY_KINDS = ["audio", "transcript", "created", "other"]
RESERVE_KINDS = ["error", "done"]


def make(
    *,
    max_bytes: int = 10_000,
    max_events: int = 100,
    reserve_bytes: int = 1_000,
    reserve_events: int = 2,
    close_bytes: int = 4096,
) -> OutputBuffer:
    return OutputBuffer(
        BufferLimits(
            max_pending_output_bytes=max_bytes,
            max_pending_output_events=max_events,
            output_reserve_bytes=reserve_bytes,
            output_reserve_events=reserve_events,
            max_close_notice_bytes=close_bytes,
        )
    )


def drain(buf: OutputBuffer) -> list[Entry]:
    out: list[Entry] = []
    while (entry := buf.pop()) is not None:
        out.append(entry)
    return out


def events_of(entries: list[Entry]) -> list[UpstreamEvent]:
    return [e.event for e in entries]


def closed_notice(size: int | None = None, reason: str = "shutdown") -> UpstreamEvent:
    notice = session_closed("event_close", "duplex-1", reason)
    if size is None:
        return notice
    detail = "d" * (size - notice.size - len('"detail":""'))
    notice = session_closed("event_close", "duplex-1", reason, detail=detail)
    assert notice.size == size
    return notice


COMPACT = compact_session_closed("event_compact", "duplex-1")


class TestDefaults:
    def test_design_defaults(self) -> None:
        limits = BufferLimits()
        assert (
            limits.max_pending_output_bytes == DEFAULT_MAX_PENDING_OUTPUT_BYTES == 2 * 1024 * 1024
        )
        assert limits.max_pending_output_events == DEFAULT_MAX_PENDING_OUTPUT_EVENTS == 512
        assert limits.output_reserve_bytes == DEFAULT_OUTPUT_RESERVE_BYTES == 64 * 1024
        assert limits.output_reserve_events == DEFAULT_OUTPUT_RESERVE_EVENTS == 8
        assert limits.max_close_notice_bytes == DEFAULT_MAX_CLOSE_NOTICE_BYTES == 4096

    @pytest.mark.parametrize(
        "name",
        [
            "max_pending_output_bytes",
            "max_pending_output_events",
            "output_reserve_bytes",
            "output_reserve_events",
            "max_close_notice_bytes",
        ],
    )
    def test_negative_limit_rejected(self, name: str) -> None:
        with pytest.raises(ValueError, match=name):
            BufferLimits(**{name: -1})


class TestOrdinaryBudget:
    @pytest.mark.parametrize("kind", ORDINARY_KINDS + RESERVE_KINDS)
    def test_event_count_limit_is_exact(self, kind: str) -> None:
        buf = make(max_events=3, reserve_events=0)
        results = [buf.offer(sized_event(kind, 100, "r1", seq=i), 0.0) for i in range(4)]
        assert results == [Offer.ACCEPTED] * 3 + [Offer.REJECTED_FULL]
        assert buf.pending_events == 3
        assert buf.statistics().pending_events == 3
        assert buf.statistics().rejected_full == 1

    def test_byte_limit_exact_fit_accepted(self) -> None:
        buf = make(max_bytes=300)
        assert buf.offer(sized_event("audio", 100, "r1"), 0.0) is Offer.ACCEPTED
        assert buf.offer(sized_event("audio", 200, "r1"), 0.0) is Offer.ACCEPTED
        assert buf.pending_bytes == 300
        assert buf.offer(sized_event("other", 60), 0.0) is Offer.REJECTED_FULL

    def test_byte_limit_one_over_rejected(self) -> None:
        buf = make(max_bytes=300)
        assert buf.offer(sized_event("audio", 100, "r1"), 0.0) is Offer.ACCEPTED
        assert buf.offer(sized_event("audio", 201, "r1"), 0.0) is Offer.REJECTED_FULL
        # a smaller one still fits: a rejection does not close the budget
        assert buf.offer(sized_event("audio", 200, "r1"), 0.0) is Offer.ACCEPTED
        assert [e.event.size for e in drain(buf)] == [100, 200]

    def test_single_event_larger_than_budget(self) -> None:
        buf = make(max_bytes=100, reserve_bytes=0)
        assert buf.offer(sized_event("audio", 101, "r1"), 0.0) is Offer.REJECTED_FULL
        assert buf.pending_events == 0

    def test_taking_releases_budget(self) -> None:
        buf = make(max_events=2, max_bytes=400)
        first = sized_event("audio", 200, "r1", seq=1)
        buf.offer(first, 0.0)
        buf.offer(sized_event("audio", 200, "r1", seq=2), 0.0)
        assert buf.offer(sized_event("audio", 100, "r1"), 0.0) is Offer.REJECTED_FULL
        entry = buf.pop()
        assert entry is not None and entry.event is first
        # a taken event is outside the budget
        assert buf.statistics().pending_events == 1
        assert buf.pending_bytes == 200
        assert buf.offer(sized_event("audio", 200, "r1", seq=3), 0.0) is Offer.ACCEPTED

    def test_enqueued_at_is_recorded(self) -> None:
        buf = make()
        buf.offer(sized_event("other", 100), 12.5)
        entry = buf.pop()
        assert entry is not None
        assert entry.enqueued_at == 12.5
        assert not entry.reserved and not entry.closure

    def test_zero_ordinary_budget_rejects_ordinary_kinds(self) -> None:
        buf = make(max_events=0)
        assert buf.offer(sized_event("audio", 100, "r1"), 0.0) is Offer.REJECTED_FULL
        assert buf.offer(sized_event("error", 100), 0.0) is Offer.ACCEPTED_RESERVE


class TestReserve:
    @pytest.mark.parametrize("kind", RESERVE_KINDS)
    def test_reserve_kinds_use_ordinary_budget_while_it_has_room(self, kind: str) -> None:
        buf = make(max_events=2)
        assert buf.offer(sized_event(kind, 100, "r1"), 0.0) is Offer.ACCEPTED
        stats = buf.statistics()
        assert (stats.reserve_events, stats.reserve_bytes) == (0, 0)
        head = buf.peek()
        assert head is not None and not head.reserved

    @pytest.mark.parametrize("kind", RESERVE_KINDS)
    def test_reserve_kinds_enter_reserve_when_ordinary_full(self, kind: str) -> None:
        buf = make(max_events=1, reserve_events=2, reserve_bytes=1000)
        buf.offer(sized_event("audio", 100, "r1"), 0.0)
        assert buf.offer(sized_event(kind, 150, "r1"), 0.0) is Offer.ACCEPTED_RESERVE
        stats = buf.statistics()
        assert (stats.reserve_events, stats.reserve_bytes) == (1, 150)
        assert (stats.pending_events, stats.pending_bytes) == (2, 250)
        assert [e.reserved for e in drain(buf)] == [False, True]

    def test_reserve_used_when_ordinary_bytes_do_not_fit(self) -> None:
        # "full" means the event does not fit, also by bytes with events to spare
        buf = make(max_bytes=250, max_events=100)
        buf.offer(sized_event("audio", 200, "r1"), 0.0)
        assert buf.offer(sized_event("error", 100), 0.0) is Offer.ACCEPTED_RESERVE

    @pytest.mark.parametrize("kind", ORDINARY_KINDS)
    def test_ordinary_kinds_never_enter_reserve(self, kind: str) -> None:
        buf = make(max_events=1, reserve_events=8, reserve_bytes=10_000)
        buf.offer(sized_event("audio", 100, "r1"), 0.0)
        assert buf.offer(sized_event(kind, 100, "r1"), 0.0) is Offer.REJECTED_FULL
        assert buf.statistics().reserve_events == 0

    def test_reserve_event_limit_is_exact(self) -> None:
        buf = make(max_events=0, reserve_events=2, reserve_bytes=10_000)
        results = [buf.offer(sized_event("error", 100, seq=i), 0.0) for i in range(3)]
        assert results == [Offer.ACCEPTED_RESERVE, Offer.ACCEPTED_RESERVE, Offer.REJECTED_FULL]

    def test_reserve_byte_limit_is_exact(self) -> None:
        buf = make(max_events=0, reserve_events=8, reserve_bytes=300)
        assert buf.offer(sized_event("done", 100, "r1"), 0.0) is Offer.ACCEPTED_RESERVE
        assert buf.offer(sized_event("error", 201), 0.0) is Offer.REJECTED_FULL
        assert buf.offer(sized_event("error", 200), 0.0) is Offer.ACCEPTED_RESERVE
        assert buf.statistics().reserve_bytes == 300

    def test_taking_a_reserved_event_releases_reserve(self) -> None:
        buf = make(max_events=0, reserve_events=1, reserve_bytes=1000)
        buf.offer(sized_event("error", 100), 0.0)
        assert buf.offer(sized_event("error", 100, seq=1), 0.0) is Offer.REJECTED_FULL
        entry = buf.pop()
        assert entry is not None and entry.reserved
        assert buf.statistics().reserve_events == 0
        assert buf.offer(sized_event("error", 100, seq=2), 0.0) is Offer.ACCEPTED_RESERVE

    def test_fifo_across_budgets(self) -> None:
        buf = make(max_events=2, reserve_events=4)
        a1 = sized_event("audio", 100, "r1", seq=1)
        a2 = sized_event("audio", 100, "r1", seq=2)
        err = sized_event("error", 100)
        done = sized_event("done", 100, "r1")
        for ev in (a1, a2, err, done):
            assert buf.offer(ev, 0.0).accepted
        # one slot frees up; an ordinary event queued now comes after the reserve
        first = buf.pop()
        assert first is not None and first.event is a1
        late = sized_event("other", 100)
        assert buf.offer(late, 0.0) is Offer.ACCEPTED
        assert events_of(drain(buf)) == [a2, err, done, late]


class TestClosure:
    def test_closure_comes_after_everything_queued_exactly_once(self) -> None:
        buf = make()
        evs = [sized_event("audio", 100, "r1", seq=i) for i in range(3)]
        for ev in evs:
            buf.offer(ev, 0.0)
        notice = closed_notice()
        assert buf.close(notice, compact=COMPACT, now=1.0) is True
        assert buf.closed
        out = drain(buf)
        assert events_of(out) == [*evs, notice]
        assert [e.closure for e in out] == [False, False, False, True]
        assert not buf.closure_pending
        assert buf.pop() is None
        assert buf.peek() is None

    def test_closure_of_empty_buffer(self) -> None:
        buf = make()
        assert buf.peek() is None
        notice = closed_notice()
        buf.close(notice, compact=COMPACT, now=0.0)
        assert buf.peek() is not None
        assert buf.statistics().closure_pending
        entry = buf.pop()
        assert entry is not None and entry.closure and entry.event is notice
        assert not buf.statistics().closure_pending
        assert buf.pop() is None

    def test_duplicate_close_is_harmless(self) -> None:
        buf = make()
        first = closed_notice(reason="shutdown")
        assert buf.close(first, compact=COMPACT, now=0.0) is True
        assert buf.close(closed_notice(reason="other"), compact=COMPACT, now=0.0) is False
        assert events_of(drain(buf)) == [first]

    @pytest.mark.parametrize("kind", ORDINARY_KINDS + RESERVE_KINDS)
    def test_offers_after_close_are_refused(self, kind: str) -> None:
        buf = make()
        buf.close(closed_notice(), compact=COMPACT, now=0.0)
        assert buf.offer(sized_event(kind, 100, "r1"), 0.0) is Offer.REJECTED_CLOSED
        assert not Offer.REJECTED_CLOSED.accepted
        assert buf.pending_events == 0
        assert buf.statistics().rejected_full == 0

    def test_closure_is_outside_both_budgets(self) -> None:
        buf = make(max_events=1, reserve_events=1)
        buf.offer(sized_event("audio", 100, "r1"), 0.0)
        buf.offer(sized_event("error", 100), 0.0)
        assert buf.offer(sized_event("error", 100, seq=2), 0.0) is Offer.REJECTED_FULL
        notice = closed_notice()
        assert buf.close(notice, compact=COMPACT, now=0.0)
        stats = buf.statistics()
        assert (stats.pending_events, stats.pending_bytes) == (2, 200)
        out = drain(buf)
        assert len(out) == 3 and out[-1].event is notice

    def test_notice_at_limit_is_kept(self) -> None:
        buf = make(close_bytes=600)
        notice = closed_notice(600)
        buf.close(notice, compact=COMPACT, now=0.0)
        entry = buf.pop()
        assert entry is not None and entry.event is notice

    def test_oversized_notice_is_replaced_by_compact(self) -> None:
        buf = make(close_bytes=600)
        buf.close(closed_notice(601), compact=COMPACT, now=0.0)
        entry = buf.pop()
        assert entry is not None and entry.closure
        assert entry.event is COMPACT
        body = entry.event.body
        assert body is not None
        assert body["reason"] == "close_details_exceed_output_limit"
        assert body["session_id"] == "duplex-1"
        assert body["event"] == {}

    def test_default_limit_4096(self) -> None:
        buf = OutputBuffer(BufferLimits())
        buf.close(closed_notice(4097), compact=COMPACT, now=0.0)
        entry = buf.pop()
        assert entry is not None and entry.event is COMPACT

    def test_invalidate_after_close_still_removes_audio(self) -> None:
        buf = make()
        a = sized_event("audio", 100, "r1")
        t = sized_event("transcript", 100, "r1")
        buf.offer(a, 0.0)
        buf.offer(t, 0.0)
        notice = closed_notice()
        buf.close(notice, compact=COMPACT, now=0.0)
        assert buf.invalidate("r1") == (1, 100)
        assert events_of(drain(buf)) == [t, notice]


class TestPeek:
    def test_peek_shows_what_pop_takes_next_without_taking_it(self) -> None:
        buf = make()
        first = sized_event("audio", 100, "r1", seq=1)
        buf.offer(first, 0.0)
        buf.offer(sized_event("audio", 100, "r1", seq=2), 0.0)
        head = buf.peek()
        assert head is not None and head.event is first
        assert buf.pending_events == 2, "peeking takes nothing out of the budget"
        assert buf.pop() is head

    def test_peek_shows_the_closure_last_and_pop_takes_it_once(self) -> None:
        buf = make()
        buf.offer(sized_event("audio", 100, "r1"), 0.0)
        notice = closed_notice()
        buf.close(notice, compact=COMPACT, now=0.0)
        buf.pop()
        head = buf.peek()
        assert head is not None and head.closure and head.event is notice
        assert buf.pop() is head
        assert buf.peek() is None and buf.pop() is None


class TestInvalidate:
    def test_removes_only_that_responses_audio_keeping_order(self) -> None:
        buf = make(max_events=6, reserve_events=4)
        a1 = sized_event("audio", 100, "r1", seq=1)
        t1 = sized_event("transcript", 110, "r1", seq=1)
        b1 = sized_event("audio", 120, "r2", seq=1)
        a2 = sized_event("audio", 130, "r1", seq=2)
        o1 = sized_event("other", 140)
        b2 = sized_event("audio", 150, "r2", seq=2)
        err = sized_event("error", 160)  # reserve
        d1 = sized_event("done", 170, "r1")  # reserve
        for ev in (a1, t1, b1, a2, o1, b2, err, d1):
            assert buf.offer(ev, 0.0).accepted
        before = buf.statistics()
        assert buf.invalidate("r1") == (2, 230)
        stats = buf.statistics()
        assert stats.pending_events == before.pending_events - 2
        assert stats.pending_bytes == before.pending_bytes - 230
        assert (stats.reserve_events, stats.reserve_bytes) == (2, 330)
        assert (stats.invalidated_events, stats.invalidated_bytes) == (2, 230)
        # freed ordinary room is usable again
        c1 = sized_event("audio", 100, "r3")
        assert buf.offer(c1, 0.0) is Offer.ACCEPTED
        assert events_of(drain(buf)) == [t1, b1, o1, b2, err, d1, c1]

    def test_invalidations_are_counted(self) -> None:
        buf = make()
        for rid, size in (("r1", 100), ("r2", 120), ("r2", 150)):
            buf.offer(sized_event("audio", size, rid), 0.0)
        buf.invalidate("r1")
        assert buf.invalidate("r2") == (2, 270)
        assert (buf.statistics().invalidated_events, buf.statistics().invalidated_bytes) == (3, 370)

    def test_nothing_to_remove(self) -> None:
        buf = make()
        t = sized_event("transcript", 100, "r1")
        buf.offer(t, 0.0)
        assert buf.invalidate("r1") == (0, 0)
        assert buf.invalidate("nope") == (0, 0)
        assert events_of(drain(buf)) == [t]
        assert buf.statistics().invalidated_events == 0

    def test_beta_audio_is_removed_too(self) -> None:
        from tests.proxy.core.helpers import audio, event

        buf = make()
        buf.offer(event(audio("r1", beta=True)), 0.0)
        buf.offer(event(audio("r1", beta=False)), 0.0)
        assert buf.invalidate("r1")[0] == 2
        assert buf.pending_events == 0


class TestStatistics:
    def test_snapshot_fields(self) -> None:
        buf = make(max_events=2, max_bytes=1000, reserve_events=2, reserve_bytes=1000)
        s0 = buf.statistics()
        assert s0 == type(s0)(
            pending_bytes=0,
            pending_events=0,
            reserve_bytes=0,
            reserve_events=0,
            peak_pending_bytes=0,
            invalidated_events=0,
            invalidated_bytes=0,
            rejected_full=0,
            closure_pending=False,
            closed=False,
        )
        buf.offer(sized_event("audio", 300, "r1"), 0.0)
        buf.offer(sized_event("audio", 200, "r1"), 0.0)
        buf.offer(sized_event("error", 150), 0.0)
        buf.offer(sized_event("audio", 100, "r2"), 0.0)  # rejected
        buf.pop()
        buf.invalidate("r1")
        buf.close(closed_notice(), compact=COMPACT, now=0.0)
        s1 = buf.statistics()
        assert s1.pending_bytes == 150
        assert s1.pending_events == 1
        assert (s1.reserve_bytes, s1.reserve_events) == (150, 1)
        assert s1.peak_pending_bytes == 650
        assert (s1.invalidated_events, s1.invalidated_bytes) == (1, 200)
        assert s1.rejected_full == 1
        assert s1.closure_pending and s1.closed
        with pytest.raises(AttributeError):
            s1.pending_bytes = 0  # type: ignore[misc]

    def test_limits_property(self) -> None:
        limits = BufferLimits(max_pending_output_events=3)
        assert OutputBuffer(limits).limits is limits
