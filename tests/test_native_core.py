"""Both builds stay tested: the compiled one (the default install) and pure Python.

The suite runs whichever build the checkout holds: after ``make setup`` with a C
compiler, the compiled one (``scripts/build_backend.py`` compiles ``COMPILED_MODULES`` with
mypyc). This file runs the core's and the session shell's tests once more on the
other build, in a copy of the tree (docs/development.md, The compiled build),
and checks the import guard that refuses a compiled module older than its
source (by digest) or a build that lacks some of its modules, and that the
build's own environment holds every package the compile type-checks against.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from proxy.native import (
    COMPILED_MODULES,
    CORE_BUILD,
    RUN_PURE_ENV,
    SOURCES_MANIFEST,
    StaleNativeCore,
    core_build,
    source_digest,
)
from tests.conftest import build_backend_files

ROOT = Path(__file__).resolve().parent.parent
_SO = ".cpython-311-x86_64-linux-gnu.so"
#: What runs on the other build: the core's tests and those of the per-event shell.
OTHER_BUILD_TESTS = ("tests/proxy/core", "tests/proxy/session")
MODULES = ("proxy.core.buffer", "proxy.session.relay")


def _tree(root: Path, compiled: tuple[str, ...], manifest: bool = True) -> None:
    """Sources of MODULES, extensions of ``compiled``, and the build's manifest of them."""
    lines = []
    for name in MODULES:
        source = root / (name.replace(".", "/") + ".py")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"# {name}\n")
        lines.append(f"{name} {source_digest(str(source))}\n")
    for name in compiled:
        (root / (name.replace(".", "/") + _SO)).write_bytes(b"")
    if manifest:
        (root / "proxy" / SOURCES_MANIFEST).write_text("".join(lines))


def test_a_tree_without_compiled_modules_is_the_pure_build(tmp_path: Path) -> None:
    _tree(tmp_path, (), manifest=False)
    assert core_build(str(tmp_path), MODULES) == "python"


def test_every_module_compiled_from_its_source_is_the_compiled_build(tmp_path: Path) -> None:
    _tree(tmp_path, MODULES)
    # mypyc's shared runtime library has no source of its own.
    (tmp_path / "proxy" / f"_native__mypyc{_SO}").write_bytes(b"")
    # File times say nothing (an install writes files in any order): a source
    # newer than its extension is still the source that was compiled.
    source = tmp_path / "proxy" / "core" / "buffer.py"
    os.utime(source, (time.time() + 60, time.time() + 60))
    assert core_build(str(tmp_path), MODULES) == "mypyc"


def test_a_source_edited_after_the_build_is_refused_with_the_fix(tmp_path: Path) -> None:
    _tree(tmp_path, MODULES)
    relay = tmp_path / "proxy" / "session" / "relay.py"
    relay.write_text(relay.read_text() + "x = 1\n")
    with pytest.raises(
        StaleNativeCore,
        match=rf"proxy/session/relay\.py changed .*make native.*{RUN_PURE_ENV}=1 to run the sources",
    ):
        core_build(str(tmp_path), MODULES)


def test_a_build_without_its_manifest_is_refused(tmp_path: Path) -> None:
    _tree(tmp_path, MODULES, manifest=False)
    with pytest.raises(StaleNativeCore, match=r"proxy/core/buffer\.py changed"):
        core_build(str(tmp_path), MODULES)


def test_a_build_missing_some_of_its_modules_is_refused(tmp_path: Path) -> None:
    _tree(tmp_path, ("proxy.core.buffer",))
    with pytest.raises(StaleNativeCore, match=r"lacks 1 of its modules \(proxy\.session\.relay"):
        core_build(str(tmp_path), MODULES)


def test_the_compiled_list_names_modules_that_exist() -> None:
    for name in COMPILED_MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_the_source_archive_carries_the_build_backend(tmp_path: Path) -> None:
    """An install from the sdist runs the backend pyproject.toml names, so it is in it."""
    backend = build_backend_files(ROOT / "pyproject.toml")
    tree = tmp_path / "tree"
    _copy_tree(tree)
    code = "import sys, build_backend as b; print(b.build_sdist(sys.argv[1]))"
    made = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree / "scripts"), "OMNI_SIDECAR_PURE_BUILD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    archive = tmp_path / "dist" / made.stdout.split()[-1]
    with tarfile.open(archive) as sdist:
        inside = {name.partition("/")[2] for name in sdist.getnames()}
    assert set(backend) <= inside, sorted(inside)


#: The one async context manager compiled code may use: its exit never suspends.
NON_SUSPENDING_ASYNC_WITH = ("asyncio.timeout",)


def _suspends_while_handling(module: str) -> list[str]:
    """Where compiled ``module`` could suspend while it handles an exception.

    A mypyc coroutine that suspends there leaves the exception set as the
    thread's current one, where later compiled code of any session raises it
    again (docs/design.md, Performance): an ``await`` in ``except`` or
    ``finally``, or an ``async with`` whose exit awaits (a TaskGroup's).
    """
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncWith):
            for item in node.items:
                call = item.context_expr
                name = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
                if name not in NON_SUSPENDING_ASYNC_WITH:
                    found.append(f"{module}:{node.lineno}: async with {ast.unparse(call)}")
        if isinstance(node, ast.Try):
            handlers = [node.finalbody, *(handler.body for handler in node.handlers)]
            for statement in (s for body in handlers for s in body):
                for inner in ast.walk(statement):
                    if isinstance(inner, ast.Await | ast.AsyncWith | ast.AsyncFor):
                        found.append(f"{module}:{inner.lineno}: awaits in except/finally")
    return found


def test_no_compiled_coroutine_suspends_while_it_handles_an_exception() -> None:
    found = [where for module in COMPILED_MODULES for where in _suspends_while_handling(module)]
    assert not found, "move it to an interpreted module (proxy/session/lifetime.py):\n" + (
        "\n".join(found)
    )


#: The product's packages: mypy follows their imports from a compiled module.
FIRST_PARTY = ("proxy", "engine_launcher", "metrics")


def _third_party_reached_by_the_compile() -> dict[str, str]:
    """Each third-party import mypy meets from COMPILED_MODULES -> a module importing it.

    mypyc type-checks the compiled modules and every first-party module they
    import (TYPE_CHECKING blocks and function bodies included), so a package
    imported anywhere on that walk must be installed in the build's environment.
    """
    reached: dict[str, str] = {}
    seen: set[str] = set()
    todo = list(COMPILED_MODULES)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        base = ROOT.joinpath(*name.split("."))
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if not source.is_file():
            continue  # a name imported from a module, not a module
        package = name if source.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*parts, module] if module else parts)
                imported = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for dotted in imported:
                top = dotted.split(".")[0]
                if top in FIRST_PARTY:
                    todo.append(dotted)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    reached.setdefault(top, name)
    return reached


def _normalised(distribution: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _by_name(requirements: list[str]) -> dict[str, str]:
    """Requirement strings keyed by their normalised distribution name."""
    return {
        _normalised(re.split(r"[<>=!~;\[ ]", text, maxsplit=1)[0]): text for text in requirements
    }


def test_the_build_environment_holds_every_package_the_compile_checks_against() -> None:
    """pip builds in a fresh environment: without aiohttp there, mypyc's type check
    fails and so does every install (what a clean CI checkout once showed)."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        project = tomllib.load(handle)
    build = _by_name(project["build-system"]["requires"])
    runtime = _by_name(project["project"]["dependencies"])
    distributions = packages_distributions()
    reached = _third_party_reached_by_the_compile()
    assert {"aiohttp", "orjson"} <= reached.keys(), reached  # the walk finds what it must
    for top, importer in sorted(reached.items()):
        (distribution,) = {_normalised(d) for d in distributions[top]}
        if distribution == "mypy-extensions":
            assert "mypy" in build  # mypy depends on it
            continue
        assert distribution in build, (
            f"{importer} imports {top}: add {runtime.get(distribution, distribution)!r} "
            "to [build-system] requires in pyproject.toml"
        )
        assert build[distribution] == runtime[distribution], (
            f"{distribution}: the build requires {build[distribution]!r}, "
            f"the install {runtime[distribution]!r}"
        )


def _copy_tree(tree: Path) -> None:
    """The checkout's product and tests without extension modules or caches."""
    skip = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", SOURCES_MANIFEST)
    for name in ("proxy", "engine_launcher", "metrics", "tests"):
        shutil.copytree(ROOT / name, tree / name, ignore=skip)
    for name in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        *build_backend_files(ROOT / "pyproject.toml"),
    ):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)


@pytest.mark.timeout(900)
def test_the_other_build_passes_the_core_and_shell_tests(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _copy_tree(tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("OMNI_SIDECAR_PURE_BUILD", None)
    env.pop(RUN_PURE_ENV, None)

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

    if CORE_BUILD == "mypyc":
        expected = "python"
    else:
        if shutil.which("cc") is None:
            pytest.skip("no C compiler to build the compiled build with (.ci/run installs gcc)")
        expected = "mypyc"
        build = run("scripts/build_backend.py", "-q", "build_ext", "--inplace", timeout=600)
        assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    which = run("-c", "import proxy.native as n; print(n.CORE_BUILD, n.__file__)")
    assert which.stdout.split() == [expected, str(tree / "proxy" / "native.py")], (
        which.stdout + which.stderr
    )
    tests = run(
        "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
        *OTHER_BUILD_TESTS, timeout=600,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    print(f"\n{expected} build: {tests.stdout.strip().splitlines()[-1]}")


#: A test file of a compiled module, run after that module was edited.
EDITED_MODULE_TESTS = "tests/proxy/session/test_registry.py"


def test_an_edited_compiled_module_runs_its_tests_without_a_rebuild(tmp_path: Path) -> None:
    """The edit-test loop: a compiled module edited after the build is refused (naming
    the fix), and with OMNI_SIDECAR_PURE=1 its source runs, extensions skipped, with
    no rebuild. A compiled checkout copies its real extensions; a pure one stands
    in files no loader could load, so a source that runs proves they were skipped."""
    tree = tmp_path / "tree"
    _copy_tree(tree)
    for name in COMPILED_MODULES:
        extension = name.replace(".", "/") + _SO
        if CORE_BUILD == "mypyc":
            shutil.copy2(ROOT / extension, tree / extension)
        else:
            (tree / extension).write_bytes(b"not an extension module")
    if CORE_BUILD == "mypyc":
        for shared in (ROOT / "proxy").glob("_native__mypyc*"):
            shutil.copy2(shared, tree / "proxy" / shared.name)
        shutil.copy2(ROOT / "proxy" / SOURCES_MANIFEST, tree / "proxy" / SOURCES_MANIFEST)
    relay = tree / "proxy" / "session" / "relay.py"
    relay.write_text(relay.read_text() + "\nEDITED = True\n")  # a compiled module, edited
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("OMNI_SIDECAR_PURE_BUILD", None)
    env.pop(RUN_PURE_ENV, None)

    def run(*args: str, pure: bool) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tree,
            env={**env, RUN_PURE_ENV: "1"} if pure else env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    probe = "import proxy.native as n, proxy.session.relay as r; print(n.CORE_BUILD, r.__file__, r.EDITED)"
    refused = run("-c", probe, pure=False)
    assert refused.returncode != 0
    assert "StaleNativeCore" in refused.stderr and f"{RUN_PURE_ENV}=1" in refused.stderr, (
        refused.stderr[-2000:]
    )
    sources = run("-c", probe, pure=True)
    assert sources.stdout.split() == ["python", str(relay), "True"], sources.stderr[-2000:]
    tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", EDITED_MODULE_TESTS, pure=True)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
