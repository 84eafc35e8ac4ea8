"""A clone stands alone: every document the repository points to is in it.

A reader who follows a citation in a comment, a help text, a config file or the
README must land on a file of this checkout. Three checks, over the files git
tracks (so a stray local file cannot make them pass):

* no file cites a design input that lives outside the repository (the round-one
  design and style notes, the engine protocol notes, anything under a sibling
  ``shared`` directory), nor any other ``*.md`` path that does not exist;
* every relative Markdown link in ``README.md``, ``docs/*.md`` and the other
  tracked Markdown files resolves to a file of the repository (and, when it names an anchor in a Markdown file, to a
  heading of that file);
* every citation of the form "docs/design.md, Section" (or of
  docs/engine-protocol.md) names a real heading of that document, so that
  section titles can be cited from code and renaming one is caught.

The reference tables have one home each (every metric in docs/metrics.md, the
settings in docs/configuration.md, the exit statuses in docs/operations.md, the
verified clients and engines in docs/works_with.md), checked against the code;
the README stays a short front door whose key-settings table names real keys.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine_launcher.exit_statuses import EXIT_STATUSES
from metrics import SidecarMetrics, definitions

ROOT = Path(__file__).resolve().parent.parent


#: Files whose text is checked for references: code, docs, configs, deploy files.
SUFFIXES = frozenset({".py", ".md", ".toml", ".yaml", ".yml", ".service", ".json", ".mk", ".sh"})
NAMES = frozenset({"Makefile", "run"})

#: Documents that were never part of the repository. Spelled in pieces so that this
#: file does not cite them itself.
FORBIDDEN = (
    re.compile(r"\b" + "DESIGN" + r"\.md"),
    re.compile(r"\b" + "STYLE" + r"\.md"),
    re.compile(r"vllm_omni_" + r"realtime\.md"),
    re.compile(r"\.\./" + r"shared\b"),
    re.compile(r"\b" + "shared" + r"/reference\b"),
    # "reference §3.5": a section of the engine protocol notes kept outside the repo.
    re.compile(r"\breference " + "§"),
    # The benchmark and design anchor notes that sat beside the design input.
    re.compile(r"\b(?:perf_)?" + "anchors" + r"\.md"),
)

#: Markdown files that bench writes at run time into bench/results/ (NAME and
#: SCENARIO are placeholders for a scenario's name); citing them is not a dangling link.
GENERATED = frozenset({"summary.md", "soak.md", "churn.md", "NAME.md", "SCENARIO.md"})

#: A path-like token ending in .md (not part of a URL).
MD_PATH = re.compile(r"(?<![\w/.:-])((?:\.{1,2}/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")
#: [text](target) or [text](target "title"); images included.
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: "docs/design.md, Output buffer" or "docs/engine-protocol.md, Routes": a document of
#: docs/ cited by section heading (a comment may wrap and repeat its marker).
SECTION_CITATION = re.compile(r"\b(docs/(?:design|engine-protocol)\.md), +")


@cache
def tracked_files() -> tuple[Path, ...]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked file list is unknown")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    paths = []
    for name in listing.split("\0"):
        if not name or name.startswith(".venv") or name == "tests/test_docs.py":
            continue  # this file spells out the patterns it looks for
        path = ROOT / name
        if (path.suffix in SUFFIXES or path.name in NAMES) and path.is_file():
            paths.append(path)
    return tuple(paths)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _unwrapped(text: str) -> str:
    """Join wrapped comment lines so a citation split over two lines reads as one."""
    return re.sub(r"\s*\n\s*(?:#+:?|//|\*)?\s*", " ", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(path: Path) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"^(#{1,6}) +(.+)$", _text(path), re.MULTILINE)]


def _where(path: Path, text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"{path.relative_to(ROOT)}:{line}"


def _exists_in_repo(target: Path) -> bool:
    try:
        target.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return target.exists()


def test_the_files_checked_include_code_docs_and_configs() -> None:
    names = {str(p.relative_to(ROOT)) for p in tracked_files()}
    for expected in ("README.md", "docs/design.md", "Makefile", "pyproject.toml"):
        assert expected in names


def test_no_reference_to_documents_outside_the_repository() -> None:
    found = []
    for path in tracked_files():
        text = _text(path)
        for pattern in FORBIDDEN:
            found += [
                f"{_where(path, text, m.start())}: {m.group(0)!r}" for m in pattern.finditer(text)
            ]
    assert not found, "references to documents that are not in the repository:\n" + "\n".join(found)


def test_every_cited_markdown_path_exists() -> None:
    missing = []
    for path in tracked_files():
        text = _text(path)
        for match in MD_PATH.finditer(text):
            cited = match.group(1)
            if Path(cited).name in GENERATED:
                continue
            candidates = (path.parent / cited, ROOT / cited)
            if not any(_exists_in_repo(c) for c in candidates):
                missing.append(f"{_where(path, text, match.start())}: {cited}")
    assert not missing, "cited .md files that do not exist:\n" + "\n".join(missing)


def _markdown_docs() -> list[Path]:
    """README.md and docs/*.md, plus every other tracked Markdown file (bench, deploy)."""
    first = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return first + [p for p in tracked_files() if p.suffix == ".md" and p not in first]


def test_relative_markdown_links_resolve() -> None:
    broken = []
    for path in _markdown_docs():
        text = _text(path)
        for match in MD_LINK.finditer(text):
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = path if not file_part else path.parent / file_part
            where = _where(path, text, match.start())
            if not _exists_in_repo(resolved):
                broken.append(f"{where}: {target} (no such file in the repository)")
            elif (
                anchor
                and resolved.suffix == ".md"
                and anchor not in {_slug(h) for h in _headings(resolved)}
            ):
                broken.append(f"{where}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_section_citations_name_a_heading() -> None:
    headings = {
        doc: [h for h in _headings(ROOT / doc) if h]
        for doc in ("docs/design.md", "docs/engine-protocol.md")
    }
    wrong = []
    for path in tracked_files():
        text = _unwrapped(_text(path))
        for match in SECTION_CITATION.finditer(text):
            doc = match.group(1)
            cited = text[match.end() : match.end() + 80]
            if not any(cited.lower().startswith(h.lower()) for h in headings[doc]):
                wrong.append(f"{path.relative_to(ROOT)}: {doc}, {cited[:40]}...")
    assert not wrong, (
        "citations that name no section of the cited document (its headings are listed"
        " under ## in the file):\n" + "\n".join(wrong)
    )


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


def _exposed_metric_names() -> list[str]:
    registry = CollectorRegistry()
    SidecarMetrics(registry)
    names = []
    for family in registry.collect():
        if not family.name.startswith("omni_sidecar_"):
            continue  # the standard process_* / python_* families
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names.append(family.name + suffix)
    return names


#: The generated references' table headers (metrics/reference.py,
#: proxy/settings/render.py; tests/test_reference_docs.py keeps them current).
METRICS_HEADER = "| metric | type | labels (every value) | meaning |"
SETTINGS_HEADER = "| key | env / flag | type | default | reload | meaning |"

#: Each reference table's header row → the one document that holds it. Every other
#: page links to that home instead of carrying a copy that would drift.
TABLE_HOMES = {
    METRICS_HEADER: "docs/metrics.md",
    SETTINGS_HEADER: "docs/configuration.md",
    "| status | meaning | systemd |": "docs/operations.md",
    "| Client / engine | Version | What was verified | How (test) |": "docs/works_with.md",
}

#: The front door's length limit: what the sidecar is, how to run and install it,
#: the key settings and the links; everything else lives in docs/.
README_MAX_LINES = 150
#: The README's short table of the settings most deployments touch.
README_SETTINGS_HEADER = "| setting | default | what it does |"
README_SETTINGS_ROWS = 10


def test_metric_tables_list_every_metric_and_label_value() -> None:
    """The metric tables operators read match what /metrics exposes."""
    doc = "docs/metrics.md"
    text = _text(ROOT / doc)
    missing = [name for name in _exposed_metric_names() if f"`{name}`" not in text]
    missing += [
        f"{enum}: {value}"
        for enum, values in _label_enums().items()
        for value in values
        if not value.isdigit() and f"`{value}`" not in text  # replica indices: a range
    ]
    assert not missing, f"{doc} does not list:\n" + "\n".join(missing)


def test_each_reference_table_has_one_home() -> None:
    """A metric, setting, exit status or verified client is written in one table only."""
    misplaced = []
    for path in _markdown_docs():
        name = str(path.relative_to(ROOT))
        for line_number, line in enumerate(_text(path).splitlines(), start=1):
            home = TABLE_HOMES.get(line.strip())
            if home is not None and home != name:
                misplaced.append(f"{name}:{line_number}: {line.strip()} (belongs in {home})")
    homes_found = {
        header for header, home in TABLE_HOMES.items() if header in _text(ROOT / home).splitlines()
    }
    assert not misplaced, "reference tables outside their home (link to it):\n" + "\n".join(
        misplaced
    )
    assert homes_found == set(TABLE_HOMES), sorted(set(TABLE_HOMES) - homes_found)


def test_exit_status_table_matches_the_cli() -> None:
    table = _table(ROOT / "docs/operations.md", "| status | meaning | systemd |")
    documented = [int(row.split("|")[1]) for row in table]
    assert documented == sorted(EXIT_STATUSES), (
        f"docs/operations.md lists exit statuses {documented}; serve has {sorted(EXIT_STATUSES)}"
    )


@cache
def _setting_names() -> frozenset[str]:
    """Every key ``serve --print-config`` knows, set or commented out as unset."""
    code = "import sys; from proxy.cli import main; sys.exit(main(['serve', '--print-config']))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return frozenset(re.findall(r"^(?:# )?([a-z_][a-z0-9_.]*) = ", result.stdout, re.MULTILINE))


def _table(path: Path, header: str) -> list[str]:
    """The body rows of every Markdown table that starts with ``header`` in ``path``."""
    text = _text(path)
    assert header in text, f"{path.relative_to(ROOT)} has no table {header!r}"
    rows: list[str] = []
    for start in [m.start() for m in re.finditer(re.escape(header), text)]:
        table = text[start:]
        table = table[: table.index("\n\n")] if "\n\n" in table else table
        rows += table.splitlines()[2:]
    return rows


def _setting_keys(path: Path, header: str) -> list[str]:
    """The keys named in the first column of a settings table."""
    keys: list[str] = []
    for row in _table(path, header):
        previous = ""
        for name in re.findall(r"`([a-z_][a-z0-9_.]*)`", row.split("|")[1]):
            if name.startswith("_"):  # `max_pending_output_bytes` / `_events`
                name = previous[: previous.rindex("_")] + name
            keys.append(name)
            previous = name
    return keys


def test_settings_table_names_real_settings() -> None:
    known = _setting_names()
    keys = _setting_keys(ROOT / "docs/configuration.md", SETTINGS_HEADER)
    assert len(keys) > 30
    unknown = [key for key in keys if key not in known]
    assert not unknown, (
        f"docs/configuration.md's settings table names keys serve does not know: {unknown}"
    )


def test_readme_stays_a_short_front_door() -> None:
    lines = _text(ROOT / "README.md").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and move"
        " the rest to docs/ (one home per fact)"
    )


def test_readme_key_settings_are_real_settings() -> None:
    """The README's ten key settings exist, and the full settings table has each one."""
    known = _setting_names()
    rows = _table(ROOT / "README.md", README_SETTINGS_HEADER)
    keys = _setting_keys(ROOT / "README.md", README_SETTINGS_HEADER)
    assert len(rows) == README_SETTINGS_ROWS == len(keys), (
        f"README's key settings: {len(rows)} rows naming {keys}; want {README_SETTINGS_ROWS}"
        " rows of one key each"
    )
    unknown = [key for key in keys if key not in known]
    assert not unknown, f"README's key settings name keys serve does not know: {unknown}"
    full = set(_setting_keys(ROOT / "docs/configuration.md", SETTINGS_HEADER))
    absent = [key for key in keys if key not in full]
    assert not absent, f"README's key settings missing from docs/configuration.md: {absent}"


def _engine_capabilities_table() -> tuple[list[str], dict[str, list[str]]]:
    """docs/design.md, Engine capabilities: the header and each capability's cells."""
    section = _text(ROOT / "docs/design.md").split("\n## Engine capabilities\n", 1)[1]
    lines = [line for line in section.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:  # the |---| line does not start with "| "
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1 : len(header) - 1]
    return header, rows


def test_engine_capabilities_table_is_the_release_table() -> None:
    """A column per release of proxy/core/engine_releases.py, a row per capability, its values."""
    from proxy.core.engine_releases import CAPABILITIES, RELEASES

    header, rows = _engine_capabilities_table()
    assert header[1:-1] == [r.version.value for r in RELEASES]
    for name in CAPABILITIES:
        assert name in rows, f"docs/design.md, Engine capabilities has no row {name}"
        expected = ["yes" if getattr(r, name) else "no" for r in RELEASES]
        assert rows[name] == expected, name


# -- the module map (docs/design.md, Architecture) ---------------------------------------

#: The product's packages, whose every module the map names.
PRODUCT_PACKAGES = ("proxy", "engine_launcher", "metrics")
#: The line that opens the map's table in docs/design.md.
MODULE_MAP_LEAD = "Module map"
#: One row of the map: one module's path in backticks, then its one job.
MODULE_MAP_ROW = re.compile(r"^\| `([\w/.]+\.py)` \| (.+) \|$")


def _defines_something(path: Path) -> bool:
    """Whether a file holds a function or class of its own (not only names it re-exports)."""
    tree = ast.parse(_text(path), filename=str(path))
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for node in tree.body
    )


def product_modules(root: Path = ROOT) -> list[str]:
    """Every product module the map must name, as a path from the repository root.

    The rule: every ``.py`` file under ``proxy/``, ``engine_launcher/`` and
    ``metrics/``, except an ``__init__.py`` or ``__main__.py`` that defines no
    function or class (a package's list of re-exported names, a ``python -m`` shim).
    """
    found = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name in {"__init__.py", "__main__.py"} and not _defines_something(path):
                continue
            found.append(str(path.relative_to(root)))
    return found


def _module_map_lines(text: str) -> list[str]:
    """The map's table rows under its header and separator, from docs/design.md's text."""
    lines = text[text.index(MODULE_MAP_LEAD) :].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def module_map(text: str) -> dict[str, str]:
    """The map's rows, path → job."""
    matches = (MODULE_MAP_ROW.match(line) for line in _module_map_lines(text))
    return {m.group(1): m.group(2) for m in matches if m}


def module_map_problems(modules: list[str], rows: dict[str, str]) -> list[str]:
    problems = [
        f"{module} is not in the module map: add the row\n"
        f"    | `{module}` | <its one job, one line> |\n"
        f"  to the table under {MODULE_MAP_LEAD!r} in docs/design.md (Architecture)"
        for module in modules
        if module not in rows
    ]
    problems += [
        f"the module map names {path}, which is not a product module: remove or rename its row"
        for path in rows
        if path not in modules
    ]
    return problems


def test_the_module_map_names_every_product_module_once() -> None:
    text = _text(ROOT / "docs/design.md")
    rows = module_map(text)
    problems = module_map_problems(product_modules(), rows)
    problems += [
        f"a module map row is not one module and its job (| `path.py` | job |): {line}"
        for line in _module_map_lines(text)
        if not MODULE_MAP_ROW.match(line)
    ]
    assert not problems, "\n".join(problems)


def test_the_module_map_rule_sees_a_new_module_and_a_stale_row(tmp_path: Path) -> None:
    (tmp_path / "proxy" / "shim").mkdir(parents=True)
    (tmp_path / "engine_launcher").mkdir()
    (tmp_path / "metrics").mkdir()
    (tmp_path / "proxy" / "new_thing.py").write_text("def f() -> None: ...\n")
    (tmp_path / "proxy" / "shim" / "__init__.py").write_text('"""Names."""\nfrom x import y\n')
    (tmp_path / "proxy" / "__main__.py").write_text("def main() -> None: ...\n")
    modules = product_modules(tmp_path)
    assert modules == ["proxy/__main__.py", "proxy/new_thing.py"]
    text = "Module map (one row per module):\n\n| path | job |\n|---|---|\n| `proxy/__main__.py` | run |\n| `proxy/gone.py` | x |\n"
    problems = module_map_problems(modules, module_map(text))
    assert len(problems) == 2
    assert "| `proxy/new_thing.py` | <its one job, one line> |" in problems[0]
    assert "proxy/gone.py" in problems[1]
