"""The product code passes ruff (lint and format) and mypy --strict (STYLE.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["proxy", "engine_launcher", "metrics"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _tool(module: str) -> None:
    if shutil.which(module) is None and _run(sys.executable, "-m", module, "--version").returncode:
        pytest.skip(f"{module} is not installed (it is in the test extra)")


def test_ruff_check() -> None:
    _tool("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", *PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    _tool("ruff")
    result = _run(sys.executable, "-m", "ruff", "format", "--check", *PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    _tool("mypy")
    result = _run(sys.executable, "-m", "mypy", "--strict", *PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr
