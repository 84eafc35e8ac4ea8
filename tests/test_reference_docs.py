"""docs/configuration.md and docs/metrics.md are generated, complete and current.

Both are rendered from the declarations (the settings' fields, the metric
families of a fresh registry), so they cannot drift as long as the committed
files are the generated output: the first two tests say how to regenerate.
The others check completeness against sources of their own (the settings
table, the /metrics exposition, the label enums), so a renderer that skipped
something would fail too, not only a stale file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from metrics import SidecarMetrics, definitions
from metrics.reference import METRICS_MARKDOWN_COMMAND as METRICS_COMMAND
from metrics.reference import metrics_markdown
from proxy.settings import SETTINGS, configuration_markdown
from proxy.settings.render import SETTINGS_MARKDOWN_COMMAND as SETTINGS_COMMAND

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs/configuration.md"
METRICS = ROOT / "docs/metrics.md"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_configuration_reference_is_the_generated_one() -> None:
    assert _read(CONFIGURATION) == configuration_markdown(), (
        f"docs/configuration.md is stale; regenerate it with: {SETTINGS_COMMAND}"
    )


def test_metrics_reference_is_the_generated_one() -> None:
    assert _read(METRICS) == metrics_markdown(), (
        f"docs/metrics.md is stale; regenerate it with: {METRICS_COMMAND}"
    )


@pytest.mark.parametrize(
    ("path", "command"), [(CONFIGURATION, SETTINGS_COMMAND), (METRICS, METRICS_COMMAND)]
)
def test_each_file_says_it_is_generated_and_by_what(path: Path, command: str) -> None:
    first = _read(path).split("-->", 1)[0]
    assert command in " ".join(first.split()) and "do not edit" in first


@pytest.mark.parametrize(
    ("module", "path"),
    [("proxy.settings", CONFIGURATION), ("metrics", METRICS)],
)
def test_the_regenerate_command_prints_the_file(module: str, path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == _read(path)


def _table_rows(text: str) -> dict[str, str]:
    """First cell (a backticked name) → the whole row, for every table row."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_every_setting_has_a_row_with_its_env_var_flag_and_reload() -> None:
    rows = _table_rows(_read(CONFIGURATION))
    assert len(SETTINGS) > 60
    missing = [spec.key for spec in SETTINGS if spec.key not in rows]
    assert not missing, f"docs/configuration.md has no row for: {missing}"
    for spec in SETTINGS:
        row = rows[spec.key]
        assert f"`{spec.env}`" in row, spec.key
        assert f"`{spec.flag}" in row, spec.key
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert ("yes" if spec.doc.live else "no") in cells, spec.key
    assert not set(rows) - {spec.key for spec in SETTINGS}, "rows for unknown settings"


def _exposed_names() -> list[str]:
    """Every omni_sidecar_* family on /metrics, read from the text exposition."""
    registry = CollectorRegistry()
    SidecarMetrics(registry, process_metrics=False)
    types = dict(
        re.findall(r"^# TYPE (\S+) (\S+)$", generate_latest(registry).decode(), re.MULTILINE)
    )
    names = [name for name in types if name.startswith("omni_sidecar_")]
    # prometheus_client's _created series of counters and histograms are not families of ours.
    bases = {re.sub(r"_total$", "", name) for name in names}
    return [n for n in names if not (n.endswith("_created") and n[: -len("_created")] in bases)]


def test_every_metric_has_a_row() -> None:
    rows = _table_rows(_read(METRICS))
    names = _exposed_names()
    assert len(names) > 40
    missing = [name for name in names if name not in rows]
    assert not missing, f"docs/metrics.md has no row for: {missing}"
    assert not set(rows) - set(names), "rows for metrics /metrics does not expose"


def _label_enums() -> dict[str, tuple[str, ...]]:
    return {
        name: value
        for name, value in vars(definitions).items()
        if name.isupper()
        and name != "STANDARD_PREFIXES"
        and isinstance(value, tuple)
        and value
        and all(isinstance(item, str) for item in value)
    }


def test_every_label_value_appears() -> None:
    text = _read(METRICS)
    enums = _label_enums()
    assert {"DROP_REASONS", "ENGINE_VERSIONS", "CORE_BUILDS", "ENGINE_REPLICAS"} <= set(enums)
    missing = [
        f"{enum}: {value}"
        for enum, values in enums.items()
        for value in values
        if not value.isdigit() and f"`{value}`" not in text
    ]
    assert not missing, "docs/metrics.md does not list:\n" + "\n".join(missing)
    first, last = definitions.ENGINE_REPLICAS[0], definitions.ENGINE_REPLICAS[-1]
    assert f"`{first}` … `{last}`" in text, "the engine label's range"
    assert f"`{definitions.UNNAMED_KEY}`" in text
