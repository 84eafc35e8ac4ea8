"""Lint a fresh metrics registry against docs/design.md, Metrics, and the naming rules.

Rules (https://prometheus.io/docs/practices/naming/): one ``omni_sidecar_``
prefix; base units
with the unit as the last word of the name (``_seconds``, ``_bytes``);
counters end in ``_total`` on exposition; label names from a short
allow-list; label values only from our own enums; every known series exported
at 0 before anything happened. The one exception: the standard ``process_*``
and ``python_*`` families of prometheus_client's own collectors, allow-listed
by name below (``STANDARD_FAMILIES``) so a new unprefixed family still fails.
"""

from __future__ import annotations

import itertools
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from metrics import SidecarMetrics
from metrics import definitions as d

PREFIX = "omni_sidecar_"
ALLOWED_LABELS = frozenset(
    {
        "direction",
        "kind",
        "reason",
        "outcome",
        "policy",
        "state",
        "version",
        "core",
        "result",
        "source",
        "engine",
        "code",
        "key",
        "quota",
        "front_door",
    }
)

#: The contract: family name (without ``_total``/``_info``) → (type, label → allowed values).
#: The design's metrics plus an attempts counter next to each failure counter
#: and the tombstone-eviction leak counter the alerts use.
SPEC: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "omni_sidecar_sessions_active": ("gauge", {}),
    "omni_sidecar_sessions": ("counter", {"outcome": d.SESSION_OUTCOMES}),
    "omni_sidecar_sessions_started": ("counter", {}),
    "omni_sidecar_sessions_rejected": ("counter", {"reason": d.REJECT_REASONS}),
    "omni_sidecar_events": ("counter", {"direction": d.DIRECTIONS, "kind": d.EVENT_KINDS}),
    "omni_sidecar_bytes": ("counter", {"direction": d.DIRECTIONS}),
    "omni_sidecar_dropped_events": ("counter", {"reason": d.DROP_REASONS}),
    "omni_sidecar_dropped_bytes": ("counter", {"reason": d.DROP_REASONS}),
    "omni_sidecar_overflows": ("counter", {"policy": d.OVERFLOW_POLICIES}),
    "omni_sidecar_output_pending_bytes": ("gauge", {}),
    "omni_sidecar_output_pending_events": ("gauge", {}),
    "omni_sidecar_output_queue_delay_seconds": ("histogram", {}),
    "omni_sidecar_cancel_to_silence_seconds": ("histogram", {}),
    "omni_sidecar_first_audio_seconds": ("histogram", {}),
    "omni_sidecar_upstream_connect_seconds": ("histogram", {}),
    "omni_sidecar_upstream_connects": ("counter", {}),
    "omni_sidecar_upstream_connect_failures": ("counter", {}),
    "omni_sidecar_late_audio_after_eviction": ("counter", {}),
    "omni_sidecar_engine_up": ("gauge", {}),
    "omni_sidecar_engine_state": ("gauge", {"state": d.ENGINE_STATES}),
    "omni_sidecar_engine_restarts": ("counter", {"reason": d.ENGINE_RESTART_REASONS}),
    "omni_sidecar_engine_start_seconds": ("gauge", {}),
    # A fresh registry has one replica: engine="0" (see test_engine_label_is_bounded).
    "omni_sidecar_engine_replica_up": ("gauge", {"engine": ("0",)}),
    "omni_sidecar_engine_replica_draining": ("gauge", {"engine": ("0",)}),
    "omni_sidecar_engine_replica_sessions": ("gauge", {"engine": ("0",)}),
    "omni_sidecar_engine_replica_restarts": ("counter", {"engine": ("0",)}),
    "omni_sidecar_config_reloads": ("counter", {"result": d.CONFIG_RELOAD_RESULTS}),
    "omni_sidecar_rejected_connections": ("counter", {"reason": d.CONNECTION_REJECT_REASONS}),
    "omni_sidecar_pending_handshakes": ("gauge", {}),
    "omni_sidecar_lingering_connections": ("gauge", {}),
    "omni_sidecar_lingering_closes": ("counter", {"outcome": d.LINGER_OUTCOMES}),
    "omni_sidecar_audio_delivered_seconds": ("counter", {}),
    "omni_sidecar_audio_lead_at_cancel_seconds": ("histogram", {}),
    "omni_sidecar_playback_acks": ("counter", {}),
    "omni_sidecar_truncations": ("counter", {"source": d.TRUNCATION_SOURCES}),
    "omni_sidecar_front_door_sessions": ("counter", {"front_door": d.FRONT_DOORS}),
    "omni_sidecar_twilio_clears": ("counter", {"source": d.CLEAR_SOURCES}),
    "omni_sidecar_paced_bound_releases": ("counter", {}),
    "omni_sidecar_build": ("info", {"version": (), "core": d.CORE_BUILDS}),
    # docs/design.md, Engine capabilities.
    "omni_sidecar_engine": (
        "info",
        {"version": d.ENGINE_VERSIONS, "source": d.CAPABILITY_SOURCES},
    ),
    "omni_sidecar_engine_ack_errors": ("counter", {"code": d.ACK_ERROR_CODES}),
    "omni_sidecar_engine_full": ("counter", {"kind": d.ENGINE_FULL_KINDS}),
    # docs/design.md, Resume.
    "omni_sidecar_sessions_detached": ("gauge", {}),
    "omni_sidecar_resumes": ("counter", {"result": d.RESUME_RESULTS}),
    "omni_sidecar_drain_sessions": ("counter", {"outcome": d.DRAIN_OUTCOMES}),
    "omni_sidecar_resume_grace_expired": ("counter", {}),
    "omni_sidecar_resume_waits": ("counter", {}),
    "omni_sidecar_resume_wait_evictions": ("counter", {}),
    "omni_sidecar_resume_waiting": ("gauge", {}),
    "omni_sidecar_session_slots_used": ("gauge", {}),
    "omni_sidecar_resume_replayed_events": ("counter", {}),
    "omni_sidecar_resume_spent_checks": ("counter", {}),
    "omni_sidecar_resume_spent_check_fallbacks": ("counter", {}),
    # docs/design.md, Usage: a fresh registry knows one key name, "unnamed";
    # the operator's key file adds its names (test_usage_key_label_is_the_files).
    "omni_sidecar_usage_sessions": ("counter", {"key": (d.UNNAMED_KEY,)}),
    "omni_sidecar_usage_session_seconds": ("counter", {"key": (d.UNNAMED_KEY,)}),
    "omni_sidecar_usage_audio_seconds": (
        "counter",
        {"key": (d.UNNAMED_KEY,), "direction": d.USAGE_DIRECTIONS},
    ),
    "omni_sidecar_usage_responses": (
        "counter",
        {"key": (d.UNNAMED_KEY,), "outcome": d.USAGE_RESPONSE_OUTCOMES},
    ),
    "omni_sidecar_usage_tokens": (
        "counter",
        {"key": (d.UNNAMED_KEY,), "kind": d.USAGE_TOKEN_KINDS},
    ),
    "omni_sidecar_usage_records_dropped": ("counter", {}),
    # docs/design.md, Quotas: by key name like the usage families.
    "omni_sidecar_quota_rejections": (
        "counter",
        {"key": (d.UNNAMED_KEY,), "quota": d.QUOTA_KINDS},
    ),
    "omni_sidecar_quota_sessions_ended": ("counter", {"key": (d.UNNAMED_KEY,)}),
    "omni_sidecar_quota_backend_down": ("gauge", {}),
    "omni_sidecar_quota_backend_errors": ("counter", {}),
    "omni_sidecar_quota_backend_reseeds": ("counter", {}),
    "omni_sidecar_client_protocol_violations": (
        "counter",
        {"reason": d.CLIENT_PROTOCOL_VIOLATIONS},
    ),
}

#: The original design's metrics, verbatim (exposition names, with their labels).
DESIGN_METRICS: dict[str, tuple[str, ...]] = {
    "sessions_active": (),
    "sessions_total": ("outcome",),
    "sessions_rejected_total": ("reason",),
    "events_total": ("direction", "kind"),
    "bytes_total": ("direction",),
    "dropped_events_total": ("reason",),
    "dropped_bytes_total": ("reason",),
    "overflows_total": ("policy",),
    "output_pending_bytes": (),
    "output_pending_events": (),
    "output_queue_delay_seconds": (),
    "cancel_to_silence_seconds": (),
    "first_audio_seconds": (),
    "upstream_connect_seconds": (),
    "upstream_connect_failures_total": (),
    "engine_up": (),
    "engine_state": ("state",),
    "engine_restarts_total": ("reason",),
    "engine_start_seconds": (),
    "build_info": ("core", "version"),
}

#: The original design's label enums, verbatim.
DESIGN_ENUMS: dict[str, tuple[str, ...]] = {
    "DIRECTIONS": ("client_to_upstream", "upstream_to_client"),
    "DROP_REASONS": (
        "cancelled_audio",
        "late_audio",
        "overflow",
        "failed_response",
        "invalid_client_frame",
        "invalid_upstream_frame",
    ),
    "SESSION_OUTCOMES": (
        "client_closed",
        "upstream_closed",
        "overflow",
        "engine_unavailable",
        "shutdown",
        "error",
    ),
    "REJECT_REASONS": (
        "unauthorized",
        "forbidden_origin",
        "capacity",
        "not_ready",
        "draining",
        "upstream_unavailable",
    ),
}

#: Words that make a name a duration or a size: it must then end in that unit.
_TIME_WORDS = re.compile(r"(^|_)(seconds|delay|latency|duration|time|start|age)(_|$)")
_SIZE_WORDS = re.compile(r"(^|_)(bytes|size)(_|$)")


#: prometheus_client's process, GC and platform collectors: (type, label names).
#: Exactly these, so an unprefixed family of our own still fails the prefix rule.
STANDARD_FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    "process_virtual_memory_bytes": ("gauge", frozenset()),
    "process_resident_memory_bytes": ("gauge", frozenset()),
    "process_start_time_seconds": ("gauge", frozenset()),
    "process_cpu_seconds": ("counter", frozenset()),
    "process_open_fds": ("gauge", frozenset()),
    "process_max_fds": ("gauge", frozenset()),
    "python_gc_objects_collected": ("counter", frozenset({"generation"})),
    "python_gc_objects_uncollectable": ("counter", frozenset({"generation"})),
    "python_gc_collections": ("counter", frozenset({"generation"})),
    "python_info": (
        "gauge",
        frozenset({"implementation", "major", "minor", "patchlevel", "version"}),
    ),
}


def _ours(registry: CollectorRegistry) -> list[Metric]:
    """Our own families: everything but the allow-listed standard ones."""
    return [f for f in registry.collect() if f.name not in STANDARD_FAMILIES]


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    SidecarMetrics(registry, version="1.2.3")
    return registry


def test_standard_process_families_are_registered(registry: CollectorRegistry) -> None:
    """Process RSS, CPU, fds, start time, GC and platform info (issue 13 item 6)."""
    families = {f.name: f for f in registry.collect() if f.name.startswith(d.STANDARD_PREFIXES)}
    assert {name: f.type for name, f in families.items()} == {
        name: kind for name, (kind, _labels) in STANDARD_FAMILIES.items()
    }
    for name, family in families.items():
        for sample in family.samples:
            assert set(sample.labels) == STANDARD_FAMILIES[name][1], sample.name


def test_process_metrics_can_be_left_out() -> None:
    registry = CollectorRegistry()
    SidecarMetrics(registry, process_metrics=False)
    assert not [f.name for f in registry.collect() if f.name.startswith(d.STANDARD_PREFIXES)]


@pytest.fixture(scope="module")
def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_every_family_is_in_the_spec_and_vice_versa(registry: CollectorRegistry) -> None:
    families = {f.name: f.type for f in _ours(registry)}
    assert families == {name: kind for name, (kind, _labels) in SPEC.items()}


def test_every_design_metric_is_exposed_with_its_labels(exposition: str) -> None:
    samples = {
        s.name: set(s.labels)
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }
    for short, labels in DESIGN_METRICS.items():
        name = PREFIX + short
        # Histograms expose _bucket/_count/_sum; everything else by its own name.
        exposed = name if name in samples else f"{name}_count"
        assert exposed in samples, f"design metric {name} is not exposed"
        assert samples[exposed] == set(labels), f"{name} labels"


#: Label values added after the original design's enums (listed in
#: docs/design.md, Metrics).
NOT_YET_IN_DESIGN: dict[str, tuple[str, ...]] = {
    "DROP_REASONS": (
        "input_backpressure",
        "session_closed",
        "client_rate_limited",
        "playback_answer",
    ),
    "SESSION_OUTCOMES": ("rate_limited", "handed_over"),
    "REJECT_REASONS": ("engine_capacity", "quota_exceeded", "bad_signature"),
}


def test_design_enums_match_the_definitions() -> None:
    for attr, values in DESIGN_ENUMS.items():
        assert getattr(d, attr) == values + NOT_YET_IN_DESIGN.get(attr, ()), attr


def test_core_enums_match_the_label_enums() -> None:
    """The core's enums are the label values; a drift would export a value no dashboard knows."""
    from engine_launcher.policy import EngineState
    from proxy.core.session_core import DropReason, Outcome, OverflowPolicy

    assert tuple(r.value for r in DropReason) == d.DROP_REASONS
    assert tuple(o.value for o in Outcome) == d.SESSION_OUTCOMES
    assert {p.value for p in OverflowPolicy} <= set(d.OVERFLOW_POLICIES)
    assert tuple(s.value for s in EngineState) == d.ENGINE_STATES
    from proxy.core.capabilities import CapabilitySource
    from proxy.core.playback import AckErrorCode

    # ENGINE_VERSIONS is EngineVersion's values, derived in metrics/vocabulary.py.
    assert tuple(s.value for s in CapabilitySource) == d.CAPABILITY_SOURCES
    assert tuple(c.value for c in AckErrorCode) == d.ACK_ERROR_CODES
    from proxy.core import usage

    assert tuple(v.value for v in usage.AudioDirection) == d.USAGE_DIRECTIONS
    assert tuple(v.value for v in usage.ResponseOutcome) == d.USAGE_RESPONSE_OUTCOMES
    assert usage.UNNAMED_KEY == d.UNNAMED_KEY
    from proxy.core import quota_rules as quota

    assert tuple(v.value for v in quota.QuotaKind) == d.QUOTA_KINDS
    from proxy import compat

    assert (compat.UNMASKED_FRAME,) == d.CLIENT_PROTOCOL_VIOLATIONS


def test_every_sample_has_the_prefix(exposition: str) -> None:
    standard = {sample for family in STANDARD_FAMILIES for sample in (family, f"{family}_total")}
    for line in exposition.splitlines():
        name = line.split()[2] if line.startswith("#") else re.split(r"[{ ]", line, maxsplit=1)[0]
        assert name.startswith(PREFIX) or name in standard, line


def test_counters_end_in_total_on_exposition(registry: CollectorRegistry) -> None:
    for family in _ours(registry):
        assert not family.name.endswith("_total"), f"{family.name}: _total is added on exposition"
        if family.type != "counter":
            continue
        for sample in family.samples:
            assert sample.name in (f"{family.name}_total", f"{family.name}_created"), sample.name


def test_only_counters_end_in_total_and_only_info_in_info(registry: CollectorRegistry) -> None:
    for family in _ours(registry):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                assert family.type == "counter", sample.name
            if sample.name.endswith("_info"):
                assert family.type == "info", sample.name


@pytest.mark.parametrize("name", sorted(SPEC))
def test_units_are_base_units_and_last(name: str) -> None:
    kind = SPEC[name][0]
    if kind == "histogram":
        assert name.endswith(("_seconds", "_bytes")), f"{name}: histograms need a base unit"
    if _TIME_WORDS.search(name.removeprefix(PREFIX)):
        assert name.endswith("_seconds"), f"{name} looks like a duration"
    if _SIZE_WORDS.search(name.removeprefix(PREFIX)):
        assert name.endswith("_bytes"), f"{name} looks like a size"
    for wrong in ("_milliseconds", "_ms", "_kib", "_mib", "_kb", "_mb", "_minutes", "_hours"):
        assert wrong + "_" not in name + "_", f"{name}: not a base unit"


def test_histogram_buckets_are_in_seconds_and_increasing() -> None:
    for buckets in (
        d.QUEUE_DELAY_BUCKETS,
        d.CANCEL_TO_SILENCE_BUCKETS,
        d.FIRST_AUDIO_BUCKETS,
        d.CONNECT_BUCKETS,
    ):
        assert list(buckets) == sorted(set(buckets))
        assert buckets[0] >= 0.0 and buckets[-1] <= 60.0  # seconds, not milliseconds


@pytest.mark.parametrize("name", ["FIRST_AUDIO_BUCKETS", "CANCEL_TO_SILENCE_BUCKETS"])
def test_latency_buckets_are_fine_from_50ms_to_2s(name: str) -> None:
    """A quantile read from these is at most one narrow step off between 0.05 and 2 s.

    With the old 1.0/1.5 steps a true 1.003 s p99 read 1.495 s (issue 13).
    """
    buckets = getattr(d, name)
    inside = [b for b in buckets if 0.05 <= b <= 2.0]
    for lower, upper in itertools.pairwise(inside):
        assert upper - lower <= 0.5 * lower + 1e-9, f"{name}: step {lower} -> {upper} too wide"
    upper_of_1003ms = min(b for b in buckets if b >= 1.003)
    assert upper_of_1003ms <= 1.1


def test_label_names_are_allowed_and_values_come_from_enums(registry: CollectorRegistry) -> None:
    for family in _ours(registry):
        _kind, labels = SPEC[family.name]
        for sample in family.samples:
            names = set(sample.labels) - {"le"}
            assert names <= ALLOWED_LABELS, f"{sample.name}: {names - ALLOWED_LABELS}"
            assert names == set(labels), f"{sample.name}: labels {names}"
            for label, value in sample.labels.items():
                if label == "le" or label == "version":
                    continue
                assert value in labels[label], f"{sample.name}{{{label}={value!r}}}"


def test_known_series_start_at_zero(registry: CollectorRegistry) -> None:
    for family in _ours(registry):
        kind, labels = SPEC[family.name]
        if kind == "info":
            continue
        if kind == "histogram":
            count = {s.name: s.value for s in family.samples if s.name.endswith("_count")}
            assert count == {f"{family.name}_count": 0.0}
            continue
        main = [s for s in family.samples if not s.name.endswith("_created")]
        combos = {tuple(sorted(s.labels.items())) for s in main}
        expected = {
            tuple(sorted(zip(labels, values)))
            for values in itertools.product(*(labels[name] for name in labels))
        }
        assert combos == expected, f"{family.name}: series not initialised"
        assert all(s.value == 0.0 for s in main), f"{family.name}: not 0 at start"


def test_build_info_carries_the_version_and_the_core_build(registry: CollectorRegistry) -> None:
    assert (
        registry.get_sample_value("omni_sidecar_build_info", {"version": "1.2.3", "core": "python"})
        == 1.0
    )
    compiled = CollectorRegistry()
    SidecarMetrics(compiled, version="1", core_build="mypyc", process_metrics=False)
    assert compiled.get_sample_value("omni_sidecar_build_info", {"version": "1", "core": "mypyc"})


def test_engine_info_takes_only_our_label_values(registry: CollectorRegistry) -> None:
    assert (
        registry.get_sample_value(
            "omni_sidecar_engine_info", {"version": "unknown", "source": "unknown"}
        )
        == 1.0
    )
    metrics = SidecarMetrics(CollectorRegistry(), process_metrics=False)
    metrics.set_engine_info("0.32", "preflight")
    assert (
        metrics.registry.get_sample_value(
            "omni_sidecar_engine_info", {"version": "0.32", "source": "preflight"}
        )
        == 1.0
    )
    assert (
        metrics.registry.get_sample_value(
            "omni_sidecar_engine_info", {"version": "unknown", "source": "unknown"}
        )
        is None
    ), "one series at a time"
    with pytest.raises(ValueError):
        metrics.set_engine_info("0.32.0rc1", "preflight")  # a wire/package string


def test_engine_state_is_one_hot() -> None:
    registry = CollectorRegistry()
    metrics = SidecarMetrics(registry)
    for state in d.ENGINE_STATES:
        metrics.set_engine_state(state)
        values = {
            s: registry.get_sample_value("omni_sidecar_engine_state", {"state": s})
            for s in d.ENGINE_STATES
        }
        assert values == {s: float(s == state) for s in d.ENGINE_STATES}
        assert registry.get_sample_value("omni_sidecar_engine_up") == float(state == "ready")


def test_two_registries_do_not_collide() -> None:
    """Every metric is registered on the injected registry, never the global one."""
    from prometheus_client import REGISTRY

    before = {f.name for f in REGISTRY.collect()}
    SidecarMetrics(CollectorRegistry())
    SidecarMetrics(CollectorRegistry())
    added = {f.name for f in REGISTRY.collect()} - before
    assert not any(name.startswith(PREFIX) for name in added)


def test_engine_label_is_bounded() -> None:
    """``engine`` is a replica index below engine_launcher's MAX_REPLICAS, one series each."""
    from proxy.settings import MAX_REPLICAS

    assert d.ENGINE_REPLICAS == tuple(str(i) for i in range(MAX_REPLICAS))
    registry = CollectorRegistry()
    SidecarMetrics(registry, replicas=3, process_metrics=False)
    values = {
        s.labels["engine"]
        for f in registry.collect()
        for s in f.samples
        if "engine" in s.labels and not s.name.endswith("_created")
    }
    assert values == {"0", "1", "2"}
    with pytest.raises(ValueError, match="replicas"):
        SidecarMetrics(CollectorRegistry(), replicas=MAX_REPLICAS + 1)


def test_usage_key_label_is_the_files() -> None:
    """Key names reach the ``key`` label only once declared (from the operator's file)."""
    metrics = SidecarMetrics(CollectorRegistry(), process_metrics=False)
    assert metrics.usage_key("alpha") == d.UNNAMED_KEY
    metrics.set_usage_keys(["alpha", "beta"])
    assert (metrics.usage_key("alpha"), metrics.usage_key("gamma")) == ("alpha", d.UNNAMED_KEY)
    for name in ("alpha", "beta", d.UNNAMED_KEY):
        assert (
            metrics.registry.get_sample_value(
                "omni_sidecar_usage_audio_seconds_total", {"key": name, "direction": "heard"}
            )
            == 0.0
        )
