"""The registry's process-wide output cap: it marks the largest session to shed,
once, and never applies the shed itself (docs/design.md, Process-wide output cap);
resume journals count with the pending output and give way first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics
from proxy.session.registry import SessionRegistry


@dataclass
class _View:
    closing: bool = False


@dataclass
class _Relay:
    """Records the shed; applying it (closing the buffer) is up to the test, as the
    relay does at its loop's next step."""

    key: str
    view: _View = field(default_factory=_View)
    sheds: int = 0

    def shed(self) -> None:
        self.sheds += 1


def _registry(cap: int) -> tuple[SessionRegistry, CollectorRegistry]:
    prometheus = CollectorRegistry()
    metrics = SidecarMetrics(prometheus, process_metrics=False)
    return SessionRegistry(metrics, max_total_pending_output_bytes=cap), prometheus


def _process_total(prometheus: CollectorRegistry) -> float:
    value = prometheus.get_sample_value("omni_sidecar_overflows_total", {"policy": "process_total"})
    return value or 0.0


def _add(registry: SessionRegistry, *relays: Any) -> None:
    for relay in relays:
        registry.add(relay)


def test_over_the_cap_the_largest_is_marked_once_until_its_relay_applies_it() -> None:
    registry, prometheus = _registry(cap=100)
    a, b = _Relay("a"), _Relay("b")
    _add(registry, a, b)
    registry.update_pending("a", 80, 8)
    registry.update_pending("b", 30, 3)  # 110 > 100: a, the largest, is marked
    assert (a.sheds, b.sheds) == (1, 0)
    # More output before a's relay applied the shed: a is not marked again, and its
    # bytes, about to be freed, do not make b the largest to shed.
    registry.update_pending("b", 40, 4)
    registry.update_pending("a", 90, 9)
    assert (a.sheds, b.sheds) == (1, 0)
    assert _process_total(prometheus) == 1


def test_once_applied_the_next_over_the_cap_sheds_the_next_largest() -> None:
    registry, prometheus = _registry(cap=100)
    a, b = _Relay("a"), _Relay("b")
    _add(registry, a, b)
    registry.update_pending("a", 80, 8)
    registry.update_pending("b", 30, 3)
    a.view.closing = True  # the relay applied the shed: a's buffer is closed
    registry.update_pending("a", 75, 3)  # its closing sequence still pends: 105 > 100
    assert (a.sheds, b.sheds) == (1, 1)
    assert _process_total(prometheus) == 2


def test_while_one_shed_waits_a_session_over_the_cap_alone_is_marked_too() -> None:
    registry, prometheus = _registry(cap=100)
    a, b = _Relay("a"), _Relay("b")
    _add(registry, a, b)
    registry.update_pending("a", 200, 2)  # a marked
    registry.update_pending("b", 150, 1)  # without a, still over: b, never a again
    assert (a.sheds, b.sheds) == (1, 1)
    assert _process_total(prometheus) == 2


# -- resume journals count with the pending output (docs/design.md, Memory) -------------------


@dataclass
class _JournalRelay(_Relay):
    """A session with a resume journal the registry may trim."""

    journal: int = 0

    def trim_journal(self, excess: int) -> int:
        freed = min(excess, self.journal)
        self.journal -= freed
        return freed


def test_journals_count_with_pending_output_and_give_way_before_a_session_is_shed() -> None:
    registry, _ = _registry(cap=1000)
    small, large = _JournalRelay("a", journal=300), _JournalRelay("b", journal=500)
    _add(registry, small, large)
    registry.update_pending("a", 100, 1, small.journal)
    registry.update_pending("b", 0, 0, large.journal)
    assert registry.total_journal_bytes == 800
    assert (small.journal, large.journal) == (300, 500), "under the cap: nothing trimmed"
    registry.update_pending("b", 400, 3, large.journal)  # 100 + 400 + 800: 300 over
    assert large.journal == 200, "the largest journal gives way first"
    assert small.journal == 300
    assert registry.total_journal_bytes == 500
    assert registry.total_pending_bytes + registry.total_journal_bytes <= 1000
    assert small.sheds == large.sheds == 0, "no session shed for a journal"


def test_a_session_is_shed_when_the_journals_are_not_enough() -> None:
    registry, prometheus = _registry(cap=1000)
    relay = _JournalRelay("a", journal=100)
    _add(registry, relay)
    registry.update_pending("a", 1200, 5, relay.journal)
    assert relay.journal == 0
    assert registry.total_journal_bytes == 0
    assert relay.sheds == 1
    assert _process_total(prometheus) == 1
