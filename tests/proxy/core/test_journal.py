"""The resume journal alone (proxy/core/journal.py; docs/design.md, Resume).

What it keeps, in what order, what it gives back for a cursor, when a cursor
is too old (a gap), and what it costs: counted as it is held, never more than
its bounds.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.journal import ENTRY_OVERHEAD_BYTES, ReplayJournal
from tests.proxy.core.helpers import audio, transcript_delta

BIG = 1 << 30


def cost(text: str) -> int:
    return sys.getsizeof(text) + ENTRY_OVERHEAD_BYTES


def filled(n: int, *, max_bytes: int = BIG, ttl: float = 60.0) -> tuple[ReplayJournal, list[str]]:
    journal = ReplayJournal(max_bytes, ttl)
    texts = [transcript_delta("r1", f"word {seq}", seq=seq) for seq in range(1, n + 1)]
    for seq, text in enumerate(texts, start=1):
        journal.record(seq, text, None, now=float(seq), room=BIG)
    return journal, texts


def everything(_: str) -> bool:
    return True


class TestReplay:
    def test_what_came_after_the_cursor_in_order(self) -> None:
        journal, texts = filled(5)
        assert journal.after(2, 5.0, everything) == texts[2:]
        assert journal.after(5, 5.0, everything) == []
        assert journal.after(0, 5.0, everything) == texts

    def test_a_seq_not_above_the_last_is_kept_once(self) -> None:
        """A replayed event is written again: the journal does not keep it twice."""
        journal, texts = filled(3)
        journal.record(2, texts[1], None, now=4.0, room=BIG)
        journal.record(3, texts[2], None, now=4.0, room=BIG)
        assert journal.after(0, 4.0, everything) == texts
        assert len(journal) == 3

    def test_audio_of_a_response_no_longer_kept_is_left_out(self) -> None:
        journal = ReplayJournal(BIG, 60.0)
        frames = [(1, audio("r1", seq=1), "r1"), (2, transcript_delta("r1"), None)]
        frames.append((3, audio("r2", seq=3), "r2"))
        for seq, text, audio_of in frames:
            journal.record(seq, text, audio_of, now=0.0, room=BIG)
        kept = journal.after(0, 0.0, lambda rid: rid != "r1")
        assert kept == [frames[1][1], frames[2][1]]


class TestGap:
    def test_a_cursor_before_what_was_pushed_out_is_a_gap(self) -> None:
        journal, texts = filled(10)
        limit = sum(cost(t) for t in texts[6:])
        journal.trim(limit)
        assert journal.after(5, 10.0, everything) is None
        assert journal.after(6, 10.0, everything) == texts[6:]

    def test_acknowledged_events_go(self) -> None:
        journal, texts = filled(5)
        journal.ack(3)
        assert len(journal) == 2
        assert journal.bytes == cost(texts[3]) + cost(texts[4])
        assert journal.after(3, 5.0, everything) == texts[3:]
        assert journal.after(2, 5.0, everything) is None

    def test_events_older_than_the_ttl_go(self) -> None:
        journal, texts = filled(5, ttl=2.5)  # written at 1..5
        assert journal.after(2, 5.0, everything) == texts[2:]  # 3, 4, 5 within 2.5 s
        assert journal.after(2, 6.0, everything) is None  # 3 is older than 2.5 s now
        assert journal.after(3, 6.0, everything) == texts[3:]


class TestBounds:
    def test_never_more_than_its_bytes_oldest_first(self) -> None:
        """``resume_journal_bytes`` holds after every record, and what goes is the oldest."""
        text = transcript_delta("r1", "x" * 100)
        journal = ReplayJournal(10 * cost(text), 60.0)
        for seq in range(1, 51):
            journal.record(seq, text, None, now=0.0, room=BIG)
            assert journal.bytes <= 10 * cost(text)
        assert len(journal) == 10
        assert journal.dropped_upto == 40
        assert journal.after(39, 0.0, everything) is None
        assert journal.after(40, 0.0, everything) == [text] * 10

    def test_never_more_than_the_room_the_session_budget_leaves(self) -> None:
        text = transcript_delta("r1", "x" * 100)
        journal = ReplayJournal(BIG, 60.0)
        for seq in range(1, 11):
            journal.record(seq, text, None, now=0.0, room=3 * cost(text))
        assert len(journal) == 3

    def test_trim_frees_what_it_says(self) -> None:
        journal, texts = filled(4)
        freed = journal.trim(cost(texts[3]))
        assert freed == sum(cost(t) for t in texts[:3])
        assert journal.bytes == cost(texts[3])

    @given(
        st.lists(
            st.tuples(st.sampled_from(["record", "ack", "trim"]), st.integers(0, 2000)),
            max_size=60,
        )
    )
    def test_counted_bytes_are_the_kept_events_cost(self, ops: list[tuple[str, int]]) -> None:
        journal = ReplayJournal(4000, 60.0)
        seq = 0
        for op, n in ops:
            if op == "record":
                seq += 1
                journal.record(seq, "x" * n, None, now=0.0, room=BIG)
            elif op == "ack":
                journal.ack(n % (seq + 1))
            else:
                journal.trim(n)
            assert journal.bytes == sum(
                cost(t) for t in journal.after(journal.dropped_upto, 0.0, everything) or []
            )
            assert journal.bytes <= 4000


def test_what_it_counts_is_at_least_what_it_holds() -> None:
    """Memory, not frame sizes: frames recorded and let go of everywhere else cost
    the process no more than the journal counts (tracemalloc, CPython)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        journal = ReplayJournal(256 * 1024, 60.0)
        for seq in range(1, 3001):
            # Small frames: the per-entry overhead matters most here.
            journal.record(seq, transcript_delta(f"resp_{seq}", "hi", seq=seq), None, 0.0, BIG)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert journal.bytes <= 256 * 1024
    assert held <= journal.bytes + 16 * 1024, (held, journal.bytes)
    assert held >= journal.bytes // 2, "counted far above what is held"
