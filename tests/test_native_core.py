"""The mypyc-compiled core (make native): same behaviour, refused when stale.

The rest of the suite runs whichever core the checkout holds (a clean one:
Python). This file builds the compiled core in a copy of the working tree and
runs the tests of the core and of the proxy parts that call it (the session's
shell and the edge: ``tests/proxy/core``, ``session``, ``edge``) against it, so
both builds stay tested; and checks the import guard that refuses a compiled
module older than its source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.native import StaleNativeCore, core_build

ROOT = Path(__file__).resolve().parent.parent
_SO = ".cpython-311-x86_64-linux-gnu.so"
#: What runs against the compiled core: the core's tests and those of its callers' shells.
NATIVE_TESTS = ("tests/proxy/core", "tests/proxy/session", "tests/proxy/edge")


def _touch(path: Path, mtime: float) -> None:
    path.write_bytes(b"")
    os.utime(path, (mtime, mtime))


def test_a_directory_without_compiled_modules_is_the_python_core(tmp_path: Path) -> None:
    _touch(tmp_path / "session.py", 100.0)
    assert core_build(str(tmp_path)) == "python"


def test_compiled_modules_newer_than_their_sources_are_the_mypyc_core(tmp_path: Path) -> None:
    _touch(tmp_path / "session.py", 100.0)
    _touch(tmp_path / f"session{_SO}", 200.0)
    # mypyc's runtime part has no source of its own.
    _touch(tmp_path / f"session__mypyc{_SO}", 50.0)
    assert core_build(str(tmp_path)) == "mypyc"


def test_a_source_edited_after_the_build_is_refused_with_the_fix(tmp_path: Path) -> None:
    _touch(tmp_path / "buffer.py", 100.0)
    _touch(tmp_path / f"buffer{_SO}", 200.0)
    _touch(tmp_path / "session.py", 300.0)
    _touch(tmp_path / f"session{_SO}", 200.0)
    with pytest.raises(StaleNativeCore, match=r"proxy/core/session\.py changed .*make native"):
        core_build(str(tmp_path))


def _compiled(root: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in (root / "proxy" / "core").glob("*.so")}


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (.ci/run installs gcc)")
def test_the_compiled_core_passes_the_core_and_shell_tests(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for name in ("proxy", "engine_launcher", "metrics", "scripts"):
        shutil.copytree(
            ROOT / name, tree / name, ignore=shutil.ignore_patterns("*.so", "__pycache__")
        )
    # The whole test tree: the tests run import conftest.py, the child-process harness
    # and each other's helpers, wherever those live.
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(tree)}

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # --installed: the proxy package this interpreter imports (the copy, on PYTHONPATH),
    # as in a service venv after `pip install .`, not the checkout the script is in.
    script = str(ROOT / "scripts" / "native_core.py")
    checkout_before = _compiled(ROOT)
    build = run(script, "build", "--installed", timeout=400)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    assert run(script, "status", "--installed").stdout.strip() == "mypyc"
    assert _compiled(ROOT) == checkout_before, "the checkout the script lives in is untouched"
    where = run(
        "-c",
        "import proxy.core.session_core as s, proxy.core.buffer as b; print(s.__file__, b.__file__)",
    )
    assert where.stdout.count(".so") == 2, where.stdout + where.stderr
    tests = run(
        "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *NATIVE_TESTS, timeout=400
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    print(f"\ncompiled core: {tests.stdout.strip().splitlines()[-1]}")
