"""OutputBuffer against a list model (hypothesis state machine).

Random offers of audio (several responses), other response events, errors,
``response.done`` and unbound events; takes, releases, invalidations and a
close. After every step: both budgets hold, the reserve holds only
``error``/``response.done``, the queue equals the model (FIFO, nothing of
another response dropped), and the held event's validity is what the model
says. The closure comes out exactly once and last.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from proxy.core.buffer import BufferLimits, Entry, Offer, OutputBuffer
from proxy.core.events import EventKind, UpstreamEvent
from proxy.core.notices import compact_session_closed, session_closed
from tests.proxy.core.helpers import sized_event

LIMITS = BufferLimits(
    max_pending_output_bytes=800,
    max_pending_output_events=5,
    output_reserve_bytes=400,
    output_reserve_events=2,
    max_close_notice_bytes=300,
)
RESPONSES = ["r1", "r2", "r3"]
RESERVE_KINDS = {EventKind.ERROR, EventKind.RESPONSE_DONE}
SIZES = st.sampled_from([100, 130, 170, 250])


@dataclass
class Item:
    event: UpstreamEvent
    reserved: bool
    seq: int


class OutputBufferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf = OutputBuffer(LIMITS)
        self.model: list[Item] = []
        self.seq = 0
        self.closed = False
        self.closure: UpstreamEvent | None = None
        self.closure_delivered = False
        self.delivered: list[Entry] = []
        # response → offer seq at its latest invalidate: older audio never comes out
        self.invalidated_through: dict[str, int] = {}
        self.seq_of: dict[int, int] = {}  # id(event) → offer seq

    # -- model helpers -------------------------------------------------------------------

    def _usage(self, reserved: bool) -> tuple[int, int]:
        items = [i for i in self.model if i.reserved is reserved]
        return len(items), sum(i.event.size for i in items)

    def _expected_offer(self, ev: UpstreamEvent) -> Offer:
        if self.closed:
            return Offer.REJECTED_CLOSED
        n, b = self._usage(False)
        if n < LIMITS.max_pending_output_events and b + ev.size <= LIMITS.max_pending_output_bytes:
            return Offer.ACCEPTED
        rn, rb = self._usage(True)
        if (
            ev.kind in RESERVE_KINDS
            and rn < LIMITS.output_reserve_events
            and rb + ev.size <= LIMITS.output_reserve_bytes
        ):
            return Offer.ACCEPTED_RESERVE
        return Offer.REJECTED_FULL

    def _offer(self, ev: UpstreamEvent) -> None:
        expected = self._expected_offer(ev)
        if expected is Offer.ACCEPTED_RESERVE:
            # the reserve is used only when the ordinary budget cannot take it
            n, b = self._usage(False)
            assert n >= LIMITS.max_pending_output_events or (
                b + ev.size > LIMITS.max_pending_output_bytes
            )
        got = self.buf.offer(ev, float(self.seq))
        assert got is expected, (got, expected)
        self.seq_of[id(ev)] = self.seq
        if got.accepted:
            self.model.append(Item(ev, got is Offer.ACCEPTED_RESERVE, self.seq))

    # -- rules -----------------------------------------------------------------------------

    @rule(rid=st.sampled_from(RESPONSES), size=SIZES)
    def offer_audio(self, rid: str, size: int) -> None:
        self.seq += 1
        self._offer(sized_event("audio", size, rid, seq=self.seq))

    @rule(
        rid=st.sampled_from(RESPONSES), size=SIZES, kind=st.sampled_from(["transcript", "created"])
    )
    def offer_response_other(self, rid: str, size: int, kind: str) -> None:
        self.seq += 1
        self._offer(sized_event(kind, size, rid, seq=self.seq))

    @rule(size=SIZES)
    def offer_other(self, size: int) -> None:
        self.seq += 1
        self._offer(sized_event("other", size, seq=self.seq))

    @rule(size=SIZES)
    def offer_error(self, size: int) -> None:
        self.seq += 1
        self._offer(sized_event("error", size, seq=self.seq))

    @rule(rid=st.sampled_from(RESPONSES), size=SIZES)
    def offer_done(self, rid: str, size: int) -> None:
        self.seq += 1
        self._offer(sized_event("done", size, rid, seq=self.seq))

    @rule()
    def get(self) -> None:
        entry = self.buf.pop()
        if self.model:
            head = self.model.pop(0)
            assert entry is not None and entry.event is head.event
            assert entry.reserved is head.reserved
            assert not entry.closure
            if entry.reserved:
                assert entry.event.kind in RESERVE_KINDS, "the reserve holds only error and done"
        elif self.closed and not self.closure_delivered:
            assert entry is not None and entry.closure
            assert entry.event is self.closure
            self.closure_delivered = True
        else:
            assert entry is None
            return
        ev = entry.event
        if ev.is_audio and ev.response_id in self.invalidated_through:
            assert self.seq_of[id(ev)] > self.invalidated_through[ev.response_id]
        assert not any(d.closure for d in self.delivered), "nothing after the closure"
        self.delivered.append(entry)

    @rule(rid=st.sampled_from([*RESPONSES, "r-none"]))
    def invalidate(self, rid: str) -> None:
        removed = [i for i in self.model if i.event.is_audio and i.event.response_id == rid]
        kept = [i for i in self.model if not (i.event.is_audio and i.event.response_id == rid)]
        got = self.buf.invalidate(rid)
        assert got == (len(removed), sum(i.event.size for i in removed))
        self.model = kept
        self.invalidated_through[rid] = self.seq

    @rule(oversized=st.booleans())
    def close(self, oversized: bool) -> None:
        detail = "d" * 400 if oversized else None
        notice = session_closed(f"event_close_{self.seq}", "duplex-1", "shutdown", detail=detail)
        compact = compact_session_closed(f"event_compact_{self.seq}", "duplex-1")
        first = self.buf.close(notice, compact=compact, now=0.0)
        assert first is (not self.closed)
        if not self.closed:
            self.closed = True
            self.closure = compact if oversized else notice

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def budgets_hold(self) -> None:
        stats = self.buf.statistics()
        assert stats.pending_events - stats.reserve_events <= LIMITS.max_pending_output_events
        assert stats.pending_bytes - stats.reserve_bytes <= LIMITS.max_pending_output_bytes
        assert stats.reserve_events <= LIMITS.output_reserve_events
        assert stats.reserve_bytes <= LIMITS.output_reserve_bytes
        n, b = self._usage(False)
        rn, rb = self._usage(True)
        assert (stats.pending_events, stats.pending_bytes) == (n + rn, b + rb)
        assert (stats.reserve_events, stats.reserve_bytes) == (rn, rb)
        assert stats.closed is self.closed
        assert stats.closure_pending is (self.closed and not self.closure_delivered)

    @invariant()
    def the_head_is_the_models(self) -> None:
        head = self.buf.peek()
        if self.model:
            assert head is not None and head.event is self.model[0].event
        elif self.closed and not self.closure_delivered:
            assert head is not None and head.closure and head.event is self.closure
        else:
            assert head is None
        assert self.buf.pending_events == len(self.model)

    def teardown(self) -> None:
        # drain: whatever is left comes out in model order, closure last and once;
        # bounded, so a buffer that never runs dry fails here instead of eating memory
        for _ in range(len(self.model) + 2):
            if not (self.model or (self.closed and not self.closure_delivered)):
                break
            self.get()
        else:
            raise AssertionError("the buffer kept producing events past what was put in")
        assert self.buf.pop() is None
        closures = [d for d in self.delivered if d.closure]
        assert len(closures) == (1 if self.closed else 0)
        if closures:
            assert self.delivered[-1].closure


OutputBufferMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestOutputBufferMachine = OutputBufferMachine.TestCase
