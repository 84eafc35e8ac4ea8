"""The tree passes the same checks as ``make lint``, and CI leaves other processes alone.

``make lint`` runs ruff (lint and format) over the whole tree and ``mypy
--strict`` over the product (docs/design.md, Code rules (10)). The paths are
read from the Makefile, so the suite and ``make lint`` cannot drift apart.

``.ci/run`` and the tests never stop or signal a process they did not start
(issue 13, item 10): no kill-by-name command and no service stop anywhere in
them. A test that needs a service runs its own on a free port.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = ROOT / "Makefile"


def _make_variable(name: str) -> list[str]:
    match = re.search(rf"^{name} *:?= *(.+)$", MAKEFILE.read_text(encoding="utf-8"), re.MULTILINE)
    assert match, f"Makefile defines no {name}"
    return match.group(1).split()


LINT_PATHS = _make_variable("LINT_PATHS")
TYPED_PATHS = _make_variable("TYPED_PATHS")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def _tool(module: str) -> None:
    if shutil.which(module) is None and _run(sys.executable, "-m", module, "--version").returncode:
        pytest.skip(f"{module} is not installed (it is in the test extra)")


def test_lint_covers_the_whole_tree() -> None:
    assert set(LINT_PATHS) >= {"proxy", "engine_launcher", "metrics", "tests", "bench", "scripts"}
    assert set(TYPED_PATHS) >= {"proxy", "engine_launcher", "metrics"}


def test_ruff_check() -> None:
    _tool("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", *LINT_PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    _tool("ruff")
    result = _run(sys.executable, "-m", "ruff", "format", "--check", *LINT_PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    _tool("mypy")
    result = _run(sys.executable, "-m", "mypy", "--strict", *TYPED_PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


#: Commands that stop or signal processes by name or by service, whoever started them.
# Spelt in pieces so that this file does not contain the commands it forbids
# (a plain text search for them, as the project's pre-stop check does, stays clean).
_BY_NAME = "|".join(("p" + "kill", "kill" + "all"))
_SERVICE = "system" + "ctl"
FOREIGN_KILL = re.compile(
    rf"\b(?:{_BY_NAME})\b|\b{_SERVICE}\s+(?:stop|kill|restart|disable|mask)\b"
    r"|\bservice\s+\S+\s+stop\b"
)


def _scripts_and_tests() -> list[Path]:
    return [ROOT / ".ci" / "run", *sorted((ROOT / "tests").rglob("*.py"))]


def test_ci_and_tests_never_stop_foreign_processes() -> None:
    found = []
    for path in _scripts_and_tests():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        for match in FOREIGN_KILL.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not found, "stops or signals processes it did not start:\n" + "\n".join(found)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, re.MULTILINE), ".ci/run must call `make test`"
    assert "make test" in readme
