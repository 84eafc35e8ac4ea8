"""The Prometheus config, rules and Grafana dashboard in deploy/ match the metrics.

Every ``omni_sidecar_*`` name in a PromQL expression (or text) of the rules and
the dashboard must be a series a fresh registry exposes, with a suffix that
fits its type (``_bucket``/``_count``/``_sum`` on histograms, ``_total`` on
counters). Recorded series (``level:metric:operation``) used anywhere must be
defined in rules.yml. With ``promtool`` on PATH (Debian package
``prometheus``), the config and rules are checked, every dashboard query is
parsed, and the alerts are unit-tested with ``promtool test rules``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES_YML = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "omni-sidecar.json"

#: A raw metric name: not part of a recorded name like ``instance:omni_sidecar_x:rate5m``.
RAW_NAME = re.compile(r"(?<![\w:])omni_sidecar_[a-z_]+(?![\w:])")
RECORDED_NAME = re.compile(r"(?<![\w:])[a-z_]+:omni_sidecar_[a-z_]+:[a-z0-9_]+(?![\w:])")
_SUFFIX_TYPES = {
    "_bucket": "histogram",
    "_count": "histogram",
    "_sum": "histogram",
    "_total": "counter",
    "_info": "info",
}

REQUIRED_ALERTS = (
    "OmniSidecarEngineDown",
    "OmniSidecarEngineRestartLoop",
    "OmniSidecarOverflows",
    "OmniSidecarLateAudioAfterEviction",
    "OmniSidecarAdmissionRejections",
    "OmniSidecarFirstAudioSlow",
)

#: What the dashboard must show (docs/design.md, Metrics): a metric → why.
REQUIRED_PANELS = {
    "omni_sidecar_sessions_active": "sessions active",
    "omni_sidecar_sessions_started_total": "sessions started",
    "omni_sidecar_sessions_total": "sessions ended by outcome",
    "omni_sidecar_events_total": "events/s by direction",
    "omni_sidecar_bytes_total": "bytes/s by direction",
    "omni_sidecar_output_pending_bytes": "buffer fill (bytes)",
    "omni_sidecar_output_pending_events": "buffer fill (events)",
    "omni_sidecar_dropped_events_total": "drops by reason",
    "omni_sidecar_overflows_total": "overflows",
    "omni_sidecar_cancel_to_silence_seconds_bucket": "cancel to silence p50/p99",
    "omni_sidecar_first_audio_seconds_bucket": "first audio p50/p99",
    "omni_sidecar_output_queue_delay_seconds_bucket": "queue delay p99",
    "omni_sidecar_engine_state": "engine state",
    "omni_sidecar_engine_up": "engine up",
    "omni_sidecar_engine_restarts_total": "engine restarts",
    "omni_sidecar_usage_audio_seconds_total": "usage: audio seconds by key and direction",
    "omni_sidecar_usage_responses_total": "usage: responses by key and outcome",
    "omni_sidecar_quota_rejections_total": "quotas: rejections by key and quota",
    "omni_sidecar_quota_backend_down": "quotas: a sidecar counting alone (Redis down)",
}


@pytest.fixture(scope="module")
def families() -> dict[str, str]:
    """Family name → type, from a fresh registry."""
    registry = CollectorRegistry()
    SidecarMetrics(registry)
    return {family.name: family.type for family in registry.collect()}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return out


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _resolve(name: str, families: dict[str, str]) -> str | None:
    """Why ``name`` is not a series of the registry, or None when it is."""
    if families.get(name) == "gauge":
        return None
    for suffix, kind in _SUFFIX_TYPES.items():
        if name.endswith(suffix):
            base = name.removesuffix(suffix)
            if base not in families:
                return f"{name}: no metric {base}"
            if families[base] != kind:
                return f"{name}: {base} is a {families[base]}, not a {kind}"
            return None
    if name in families:
        return f"{name}: a {families[name]} has no series without a suffix"
    return f"{name}: no such metric"


def _recorded(rules: str) -> set[str]:
    return set(re.findall(r"^\s*- record:\s*(\S+)\s*$", rules, re.MULTILINE))


# -- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [RULES_YML, DASHBOARD], ids=lambda p: p.name)
def test_every_metric_name_exists(path: Path, families: dict[str, str]) -> None:
    names = set(RAW_NAME.findall(path.read_text()))
    assert names, f"no omni_sidecar_ names found in {path}"
    problems = [p for p in (_resolve(n, families) for n in sorted(names)) if p]
    assert not problems, problems


def test_resolve_rejects_wrong_suffixes(families: dict[str, str]) -> None:
    """The check itself: names PromQL would silently answer with nothing."""
    assert _resolve("omni_sidecar_engine_up_total", families)
    assert _resolve("omni_sidecar_overflows", families)
    assert _resolve("omni_sidecar_first_audio_seconds", families)
    assert _resolve("omni_sidecar_sessions_total_bucket", families)
    assert _resolve("omni_sidecar_engine_up", families) is None
    assert _resolve("omni_sidecar_first_audio_seconds_bucket", families) is None


@pytest.mark.parametrize("path", [RULES_YML, DASHBOARD], ids=lambda p: p.name)
def test_every_recorded_name_is_defined_and_names_a_metric(
    path: Path, families: dict[str, str]
) -> None:
    defined = _recorded(RULES_YML.read_text())
    for name in set(RECORDED_NAME.findall(path.read_text())):
        assert name in defined, f"{name} is used in {path.name} but not recorded in rules.yml"
        metric = name.split(":")[1]
        assert any(metric.startswith(f) for f in families), f"{name}: no metric {metric}"


def test_rules_define_the_alerts() -> None:
    alerts = re.findall(r"^\s*- alert:\s*(\S+)\s*$", RULES_YML.read_text(), re.MULTILINE)
    assert len(alerts) == len(set(alerts))
    assert set(REQUIRED_ALERTS) <= set(alerts)


def test_prometheus_config_scrapes_sidecar_and_engine() -> None:
    text = PROMETHEUS_YML.read_text()
    jobs = {}
    for block in re.split(r"\n\s*- job_name:\s*", text)[1:]:
        name, _, body = block.partition("\n")
        jobs[name.strip()] = body
    assert set(jobs) == {"omni-sidecar", "vllm-omni"}
    for job, target in (("omni-sidecar", "127.0.0.1:9464"), ("vllm-omni", "127.0.0.1:8091")):
        assert re.search(r"metrics_path:\s*/metrics\n", jobs[job]), job
        assert re.search(rf"targets:\s*\[\"{re.escape(target)}\"\]", jobs[job]), job
    assert re.search(r"rule_files:\s*\n\s*-\s*rules\.yml", text)


# -- dashboard structure ------------------------------------------------------------------------


def test_dashboard_uses_a_prometheus_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "omni-sidecar"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_panels_are_well_formed(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_covers_the_metrics(dashboard: dict[str, Any]) -> None:
    used = {name for expr in _exprs(dashboard) for name in RAW_NAME.findall(expr)}
    missing = {name: why for name, why in REQUIRED_PANELS.items() if name not in used}
    assert not missing, missing
    quantiles = {
        (m.group(1), m.group(2))
        for expr in _exprs(dashboard)
        for m in re.finditer(r"histogram_quantile\((0\.\d+),.*?(omni_sidecar_\w+)_bucket", expr)
    }
    for metric in ("cancel_to_silence_seconds", "first_audio_seconds"):
        assert ("0.5", f"omni_sidecar_{metric}") in quantiles
        assert ("0.99", f"omni_sidecar_{metric}") in quantiles
    assert ("0.99", "omni_sidecar_output_queue_delay_seconds") in quantiles


# -- promtool ---------------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian package: prometheus)"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_promtool_check_config() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(RULES_YML))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_dashboard_queries_parse(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """Each dashboard expression, with Grafana's variables filled in, is valid PromQL."""
    rules = []
    for i, expr in enumerate(_exprs(dashboard)):
        promql = (
            expr.replace("$__rate_interval", "1m")
            .replace("$__range", "1h")
            .replace("$instance", ".*")
        )
        rules.append({"record": f"dashboard:query_{i}:check", "expr": promql})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def _without_annotations(rules: str) -> str:
    """rules.yml minus its annotations blocks, so the unit test can ignore their wording."""
    out: list[str] = []
    skip_deeper_than: int | None = None
    for line in rules.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None:
            if not line.strip() or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if line.strip() == "annotations:":
            skip_deeper_than = indent
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    all_labels = {"job": "omni-sidecar", "instance": "a", **labels}
    rendered = ",".join(f'{k}="{v}"' for k, v in all_labels.items())
    return {"series": f"{name}{{{rendered}}}", "values": values}


def _alert(name: str, at: str, *firing: dict[str, str]) -> dict[str, Any]:
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [{"exp_labels": labels} for labels in firing],
    }


@needs_promtool
def test_alerts_fire_when_they_should(tmp_path: Path) -> None:
    """``promtool test rules``: each alert fires on its condition, not before nor on look-alikes."""
    rules = tmp_path / "rules.yml"
    rules.write_text(_without_annotations(RULES_YML.read_text()))
    crit = {"severity": "critical", "job": "omni-sidecar", "instance": "a"}
    warn = {"severity": "warning", "job": "omni-sidecar", "instance": "a"}
    bucket = "omni_sidecar_first_audio_seconds_bucket"
    tests = [
        {  # the engine is down for 2 minutes
            "interval": "1m",
            "input_series": [_series("omni_sidecar_engine_up", "1 1 0x10")],
            "alert_rule_test": [
                _alert("OmniSidecarEngineDown", "3m"),
                _alert("OmniSidecarEngineDown", "5m", crit),
            ],
        },
        {  # more than 3 restarts in 15 minutes, whatever the reason
            "interval": "1m",
            "input_series": [
                _series("omni_sidecar_engine_restarts_total", "0 1 2 2 2 2 2", reason="exited"),
                _series("omni_sidecar_engine_restarts_total", "0 0 0 1 2 2 2", reason="unhealthy"),
            ],
            "alert_rule_test": [
                _alert("OmniSidecarEngineRestartLoop", "2m"),
                _alert("OmniSidecarEngineRestartLoop", "5m", crit),
            ],
        },
        {  # overflows every minute for more than 10 minutes
            "interval": "1m",
            "input_series": [
                _series("omni_sidecar_overflows_total", "0+1x30", policy="close_session"),
                _series("omni_sidecar_overflows_total", "0x30", policy="fail_response"),
            ],
            "alert_rule_test": [
                _alert("OmniSidecarOverflows", "5m"),
                _alert("OmniSidecarOverflows", "15m", {**warn, "policy": "close_session"}),
            ],
        },
        {  # one cancelled delta leaked after its tombstone was evicted
            "interval": "1m",
            "input_series": [
                _series("omni_sidecar_late_audio_after_eviction_total", "0 0 0 1 1 1"),
            ],
            "alert_rule_test": [
                _alert("OmniSidecarLateAudioAfterEviction", "2m"),
                _alert("OmniSidecarLateAudioAfterEviction", "4m", warn),
            ],
        },
        {  # 1/s refused for capacity on a; unauthorized clients on b do not page anyone
            "interval": "1m",
            "input_series": [
                _series("omni_sidecar_sessions_rejected_total", "0+60x20", reason="capacity"),
                _series(
                    "omni_sidecar_sessions_rejected_total",
                    "0+600x20",
                    reason="unauthorized",
                    instance="b",
                ),
            ],
            "alert_rule_test": [
                _alert("OmniSidecarAdmissionRejections", "3m"),
                _alert("OmniSidecarAdmissionRejections", "10m", warn),
            ],
        },
        {  # every first audio between 3 and 5 s on a; all under 1 s on b
            "interval": "1m",
            "input_series": [
                _series(bucket, "0x30", le="1.0"),
                _series(bucket, "0x30", le="3.0"),
                _series(bucket, "0+10x30", le="5.0"),
                _series(bucket, "0+10x30", le="+Inf"),
                _series(bucket, "0+10x30", le="1.0", instance="b"),
                _series(bucket, "0+10x30", le="3.0", instance="b"),
                _series(bucket, "0+10x30", le="5.0", instance="b"),
                _series(bucket, "0+10x30", le="+Inf", instance="b"),
            ],
            "alert_rule_test": [
                _alert("OmniSidecarFirstAudioSlow", "8m"),
                _alert("OmniSidecarFirstAudioSlow", "20m", warn),
            ],
        },
        {  # the scrape itself fails
            "interval": "1m",
            "input_series": [{"series": 'up{job="omni-sidecar",instance="a"}', "values": "0x10"}],
            "alert_rule_test": [_alert("OmniSidecarDown", "5m", crit)],
        },
    ]
    spec = tmp_path / "rules_test.yml"
    spec.write_text(
        json.dumps({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests})
    )
    result = _promtool("test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_annotations_keeps_everything_else() -> None:
    text = (
        "- alert: A\n  expr: x > 0\n  annotations:\n    summary: s\n"
        "    description: >-\n      d\n  labels:\n    a: b\n"
    )
    assert _without_annotations(text) == "- alert: A\n  expr: x > 0\n  labels:\n    a: b\n"
