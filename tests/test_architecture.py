"""Dependency rules (docs/design.md, Dependency direction and Code rules (1)), checked on the AST.

* ``proxy.core`` does no I/O: it imports nothing that does (nor any ``proxy``
  module outside ``proxy.core``); time and randomness are arguments.
* ``engine_launcher`` never imports ``proxy``.
* ``metrics`` imports neither ``proxy`` nor ``engine_launcher``.
* ``opentelemetry`` is imported by ``proxy/tracing.py`` alone, and that module
  only from inside a function (docs/design.md, Tracing): with tracing off
  neither is loaded.
* ``redis`` is imported only inside functions, by ``proxy/quota.py`` (and by
  ``proxy/server.py``'s check that the extra is installed): without
  ``quota_redis_url`` it is never loaded (docs/design.md, Quotas).

Every import statement counts, wherever it is (function bodies, ``if
TYPE_CHECKING`` blocks); relative imports are resolved against the module's
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CORE_FORBIDDEN = frozenset(
    {
        "asyncio",
        "aiohttp",
        "prometheus_client",
        "socket",
        "time",
        "threading",
        "subprocess",
        "os",
        "random",
        "uvloop",
        "selectors",
        "opentelemetry",
    }
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module imported by the file at ``path`` under ``root``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                keep = len(base_parts) - (node.level - 1)
                assert keep > 0, f"{path}: relative import beyond the top-level package"
                base = ".".join(base_parts[:keep])
                target = f"{base}.{node.module}" if node.module else base
            else:
                assert node.module is not None
                target = node.module
            found.add(target)
            # `from pkg import mod` may import a submodule
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            found.add("__import__")
    return found


def top(module: str) -> str:
    return module.split(".", 1)[0]


def python_files(package: str) -> list[Path]:
    directory = ROOT / package
    files = sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)
    assert files, f"no modules found under {directory}"
    return files


def _ids(files: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in files]


CORE_FILES = python_files("proxy/core")
LAUNCHER_FILES = python_files("engine_launcher")
METRICS_FILES = python_files("metrics")


def test_core_modules_are_all_found() -> None:
    names = {p.stem for p in CORE_FILES}
    assert {"events", "buffer", "ledger", "notices", "session"} <= names


@pytest.mark.parametrize("path", CORE_FILES, ids=_ids(CORE_FILES))
def test_core_imports_nothing_that_does_io(path: Path) -> None:
    imports = imported_modules(path)
    bad = sorted(m for m in imports if top(m) in CORE_FORBIDDEN)
    assert not bad, f"{module_name(path)} imports {bad}"
    assert "__import__" not in imports
    assert not any(top(m) == "importlib" for m in imports)


@pytest.mark.parametrize("path", CORE_FILES, ids=_ids(CORE_FILES))
def test_core_imports_no_proxy_module_outside_core(path: Path) -> None:
    outside = sorted(
        m
        for m in imported_modules(path)
        if top(m) == "proxy" and not (m == "proxy.core" or m.startswith("proxy.core."))
    )
    assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=_ids(LAUNCHER_FILES))
def test_launcher_never_imports_proxy(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if top(m) == "proxy")
    assert not bad, f"{module_name(path)} imports {bad}"


@pytest.mark.parametrize("path", METRICS_FILES, ids=_ids(METRICS_FILES))
def test_metrics_imports_neither_proxy_nor_launcher(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if top(m) in ("proxy", "engine_launcher"))
    assert not bad, f"{module_name(path)} imports {bad}"


PRODUCT_FILES = python_files("proxy") + LAUNCHER_FILES + METRICS_FILES
TRACING_MODULE = "proxy.tracing"


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_only_the_tracing_module_imports_opentelemetry(path: Path) -> None:
    if module_name(path) == TRACING_MODULE:
        return
    bad = sorted(m for m in imported_modules(path) if top(m) == "opentelemetry")
    assert not bad, f"{module_name(path)} imports {bad}; only {TRACING_MODULE} may"


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_the_tracing_module_is_imported_only_inside_functions(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = module_name(path)
    # Statements run at import time: a function body may import it, nothing else.
    at_import = [
        node
        for node in tree.body
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    for node in at_import:
        for inner in ast.walk(node):
            names: list[str] = []
            if isinstance(inner, ast.ImportFrom) and inner.module:
                names = [inner.module] + [f"{inner.module}.{a.name}" for a in inner.names]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            assert TRACING_MODULE not in names, f"{module} imports {TRACING_MODULE} at import time"


REDIS_IMPORTERS = frozenset({"proxy.quota", "proxy.server"})


def _imports_outside_functions(tree: ast.AST) -> list[str]:
    """Modules imported by statements that run when the module (or a class) loads."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                found.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append(child.module)
            visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_redis_is_imported_only_inside_the_quota_functions(path: Path) -> None:
    module = module_name(path)
    uses = sorted(m for m in imported_modules(path) if top(m) == "redis")
    if module not in REDIS_IMPORTERS:
        assert not uses, f"{module} imports {uses}; only {sorted(REDIS_IMPORTERS)} may"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    at_load = [m for m in _imports_outside_functions(tree) if top(m) == "redis"]
    assert not at_load, f"{module} imports {at_load} at import time"


# -- the checker itself ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("import time", "proxy/core/x.py", {"time"}),
        ("import os.path as p", "proxy/core/x.py", {"os.path"}),
        ("from asyncio import sleep", "proxy/core/x.py", {"asyncio", "asyncio.sleep"}),
        ("def f():\n    import socket\n", "proxy/core/x.py", {"socket"}),
        ("from . import buffer", "proxy/core/x.py", {"proxy.core", "proxy.core.buffer"}),
        ("from .. import relay", "proxy/core/x.py", {"proxy", "proxy.relay"}),
        ("from ..config import X", "proxy/core/x.py", {"proxy.config", "proxy.config.X"}),
        ("from . import x", "proxy/core/__init__.py", {"proxy.core", "proxy.core.x"}),
        ("__import__('os')", "proxy/core/x.py", {"__import__"}),
    ],
)
def test_checker_sees_imports(source: str, where: str, expected: set[str], tmp_path: Path) -> None:
    # laid out like the real tree, so relative imports resolve the same way
    target = tmp_path / where
    target.parent.mkdir(parents=True)
    target.write_text(source, encoding="utf-8")
    assert imported_modules(target, tmp_path) == expected
