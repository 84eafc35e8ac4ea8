"""Prometheus metrics of omni-sidecar, declared in one place (docs/design.md, Metrics).

Every metric is registered on an injected ``CollectorRegistry`` (never the
global one), so each test and each process has its own. Names carry base
units, counters end in ``_total``, and label values come only from the enums
below; all known label combinations are initialised to 0.
"""

from __future__ import annotations

from metrics.definitions import (
    DIRECTIONS,
    DROP_REASONS,
    ENGINE_RESTART_REASONS,
    ENGINE_STATES,
    EVENT_KINDS,
    OVERFLOW_POLICIES,
    REJECT_REASONS,
    SESSION_OUTCOMES,
    SidecarMetrics,
)

__all__ = [
    "DIRECTIONS",
    "DROP_REASONS",
    "ENGINE_RESTART_REASONS",
    "ENGINE_STATES",
    "EVENT_KINDS",
    "OVERFLOW_POLICIES",
    "REJECT_REASONS",
    "SESSION_OUTCOMES",
    "SidecarMetrics",
]
