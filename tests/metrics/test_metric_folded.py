"""FoldedHistogram: the exposition of a prometheus_client Histogram, for less per observe."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from metrics.definitions import QUEUE_DELAY_BUCKETS
from metrics.folded import FoldedHistogram

_CREATED = re.compile(r"^.*_created.*\n", re.MULTILINE)


def _exposition(registry: CollectorRegistry) -> str:
    return _CREATED.sub("", generate_latest(registry).decode())


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0.0],
        # On a bound (le is inclusive), between bounds, above the last one.
        [QUEUE_DELAY_BUCKETS[0], QUEUE_DELAY_BUCKETS[3], 0.00017, 0.3, 1e6, 0.0],
        [i / 997 for i in range(2000)],
    ],
)
def test_the_exposition_is_a_histograms(values: list[float]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("delay_seconds", "doc", buckets=QUEUE_DELAY_BUCKETS, registry=theirs)
    folded = FoldedHistogram("delay_seconds", "doc", QUEUE_DELAY_BUCKETS, registry=ours)
    for value in values:
        histogram.observe(value)
        folded.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert folded.count == len(values)


def test_created_follows_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import metrics as prometheus_metrics

    registry = CollectorRegistry()
    folded = FoldedHistogram("x_seconds", "doc", QUEUE_DELAY_BUCKETS, registry=registry)
    monkeypatch.setattr(prometheus_metrics, "_use_created", True)
    assert registry.get_sample_value("x_seconds_created") == pytest.approx(folded.created)
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)  # disable_created_metrics()
    assert registry.get_sample_value("x_seconds_created") is None


def test_buckets_must_ascend_and_end_in_inf() -> None:
    with pytest.raises(ValueError, match="ascending"):
        FoldedHistogram("x_seconds", "doc", (0.2, 0.1))
    assert FoldedHistogram("x_seconds", "doc", (0.1, math.inf)).bounds == (0.1, math.inf)
