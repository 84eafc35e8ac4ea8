"""A histogram for the per-event path: plain integer buckets, folded at scrape time.

``prometheus_client.Histogram.observe`` takes a lock and walks the bucket
list on every call; for a value observed once per relayed event (the output
queue delay) that is a measurable share of the sidecar's own CPU. The sidecar
runs on one event-loop thread, so :class:`FoldedHistogram` keeps one integer
per bucket and finds the bucket by bisection; :meth:`collect` turns them into
the same exposition a ``Histogram`` of that name would give (cumulative
``_bucket`` samples, ``_sum``, ``_count``, ``_created``).

Not thread-safe by design: observe it from the event loop only.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["FoldedHistogram", "prometheus_created_samples"]


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (``+Inf``, ``0.005``)."""
    return "+Inf" if bound == math.inf else repr(bound)


class FoldedHistogram(Collector):
    """A label-less histogram whose observe() is a bisect and an integer add.

    Args:
        name: the metric name without a suffix (``..._seconds``).
        documentation: the HELP text.
        buckets: upper bounds, ascending; ``+Inf`` is added when missing.
        registry: where to register (None: not registered).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("buckets must be in ascending order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self.bounds: tuple[float, ...] = tuple(bounds)
        #: Observations per bucket (not cumulative), one slot per bound.
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()
        if registry is not None:
            registry.register(self)

    def observe(self, value: float) -> None:
        """Count one observation (``value`` in the metric's base unit)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        family.add_metric([], buckets, self.sum)
        # As prometheus_client's own metrics do: no _created sample once
        # disable_created_metrics() was called (the sidecar calls it).
        if prometheus_created_samples():
            family.add_sample(self.name + "_created", {}, self.created)
        yield family


def prometheus_created_samples() -> bool:
    """Whether prometheus_client's metrics give ``_created`` samples now.

    ``disable_created_metrics()`` turns them off, and prometheus_client has no
    public reader for that switch: this is the metrics package's one reach into
    its internals (allowed by name in tests/test_architecture.py).
    """
    return bool(getattr(prometheus_metrics, "_use_created", True))
