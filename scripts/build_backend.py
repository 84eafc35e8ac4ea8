"""The install's build backend: setuptools, compiling the core with mypyc when it can.

``pip install .``, ``pip install -e .`` and ``make setup`` load it (pyproject.toml:
``build-backend``, ``backend-path = ["scripts"]``); it is setuptools' own backend
with this module's ``setup()`` in place of a ``setup.py`` at the top level, and
``python scripts/build_backend.py build_ext --inplace`` runs the same build by
hand. With a C compiler and the Python headers, the modules named in
``COMPILED_MODULES`` (``proxy/native.py``) become extension modules, one
shared library for all of them (``proxy/_native__mypyc``); an editable
install puts them next to their sources. Without a compiler, or with
``OMNI_SIDECAR_PURE_BUILD=1``, the install is pure Python and says why;
``serve`` says so again at start (docs/design.md, Performance).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import shutil
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from setuptools import Distribution, build_meta, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

ROOT = Path(__file__).resolve().parent.parent
#: Set (to anything but "" or "0") to install pure Python even where a compiler exists.
PURE_ENV = "OMNI_SIDECAR_PURE_BUILD"
#: The one shared library the compiled modules live in (``proxy/_native__mypyc...so``).
GROUP = "proxy._native"
#: proxy/native.py's SOURCES_MANIFEST (read without importing proxy).
SOURCES_MANIFEST = "_native_sources.txt"


def compiled_modules() -> tuple[str, ...]:
    """``COMPILED_MODULES`` of ``proxy/native.py``, read without importing ``proxy``."""
    tree = ast.parse((ROOT / "proxy" / "native.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "COMPILED_MODULES":
            assert node.value is not None
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("proxy/native.py has no COMPILED_MODULES")


def manifest() -> str:
    """Each compiled module and the sha256 of its source, as ``proxy/native.py`` checks."""
    lines = []
    for name in compiled_modules():
        source = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        lines.append(f"{name} {hashlib.sha256(source.read_bytes()).hexdigest()}\n")
    return "".join(lines)


def why_pure(environ: Any = os.environ) -> str | None:
    """Why this build is pure Python, or None when it compiles."""
    if environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV} is set"
    try:
        import mypyc.build  # noqa: F401  (the build requirement mypy ships it)
    except ImportError:
        return "mypyc is not installed (a build without build isolation needs mypy)"
    compiler = environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    program = shlex.split(compiler)[0] if compiler.strip() else "cc"
    if shutil.which(program, path=environ.get("PATH")) is None:
        return f"no C compiler ({program} not found)"
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").is_file():
        return f"no Python headers ({include}/Python.h not found)"
    return None


def _say(message: str) -> None:
    print(f"omni-sidecar build: {message}", file=sys.stderr, flush=True)


class CompiledDistribution(Distribution):
    """A distribution with extension modules exactly when this build compiles."""

    def has_ext_modules(self) -> bool:
        return WHY_PURE is None


class BuildCompiled(build_ext):
    """``build_ext`` that asks mypyc for the extensions only when it runs.

    So reading the metadata never type-checks or generates C, and a failed
    compile falls back to the pure build instead of failing the install.
    """

    def finalize_options(self) -> None:
        if WHY_PURE is None and not self.distribution.ext_modules:
            from mypyc.build import mypycify

            sources = [name.replace(".", "/") + ".py" for name in compiled_modules()]
            here = os.getcwd()
            os.chdir(ROOT)  # mypyc names the modules by their paths from here
            target = ROOT / "build" / "mypyc"
            try:
                # multi_file: one C file per module instead of one of 18 MB, so the
                # compiler runs on all cores (build_extension) and each file is
                # small: 62 s on 2 cores against 127 s, the same µs per event.
                self.distribution.ext_modules = mypycify(
                    sources,
                    opt_level="3",
                    group_name=GROUP,
                    target_dir=str(target),
                    multi_file=True,
                )
            finally:
                os.chdir(here)
            # With a dotted group name mypyc writes the group's headers one level
            # down (build/mypyc/proxy/) from the C files that include them.
            header_dir = str(target / GROUP.rpartition(".")[0].replace(".", "/"))
            for extension in self.distribution.ext_modules:
                extension.include_dirs.append(header_dir)
        super().finalize_options()

    def build_extension(self, ext: Any) -> None:
        """Compile an extension's C files on every core, then link as usual."""
        jobs = min(len(ext.sources), os.cpu_count() or 1)
        if jobs < 2:
            super().build_extension(ext)
            return
        compile_serially = self.compiler.compile

        def compile_in_parallel(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
            with ThreadPoolExecutor(jobs) as pool:  # each thread waits on its compiler
                batches = pool.map(lambda one: compile_serially([one], *args, **kwargs), sources)
                return [name for objects in batches for name in objects]

        self.compiler.compile = compile_in_parallel
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile  # the class's method again

    def run(self) -> None:
        if WHY_PURE is not None:
            return
        _say(f"compiling {len(compiled_modules())} modules with mypyc (about a minute)")
        try:
            super().run()
        except (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError) as exc:
            # A compiler that fails: the pure build still works.
            _say(f"compiling failed ({exc}); installing pure Python")
            self.extensions = []
            return
        # The import's stale-build guard compares each source with what was compiled
        # (proxy/native.py): the manifest goes next to the shared library.
        library = Path(self.get_ext_fullpath(GROUP + "__mypyc"))
        (library.parent / SOURCES_MANIFEST).write_text(manifest(), encoding="utf-8")
        _say("compiled")


class SourceDistribution(sdist):
    """``sdist`` that carries this backend: an install from the archive needs it."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        backend = Path(__file__).resolve().relative_to(ROOT).as_posix()
        super().make_release_tree(base_dir, [*files, backend])


WHY_PURE = why_pure()


def run_setup() -> None:
    """What a ``setup.py`` would do: setuptools' ``setup()`` with the compiled build."""
    if WHY_PURE is not None:
        _say(f"pure Python: {WHY_PURE}")
    setup(
        distclass=CompiledDistribution,
        cmdclass={"build_ext": BuildCompiled, "sdist": SourceDistribution},
    )


class _Backend(build_meta._BuildMetaBackend):
    """setuptools' PEP 517 backend; where it would run ``setup.py``, ``run_setup()``."""

    def run_setup(self, setup_script: str = "setup.py") -> None:
        try:
            run_setup()
        except SystemExit as exc:  # as setuptools treats a setup script's exit
            if exc.code:
                raise


_BACKEND = _Backend()
get_requires_for_build_wheel = _BACKEND.get_requires_for_build_wheel
get_requires_for_build_sdist = _BACKEND.get_requires_for_build_sdist
get_requires_for_build_editable = _BACKEND.get_requires_for_build_editable
prepare_metadata_for_build_wheel = _BACKEND.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _BACKEND.prepare_metadata_for_build_editable
build_wheel = _BACKEND.build_wheel
build_sdist = _BACKEND.build_sdist
build_editable = _BACKEND.build_editable

if __name__ == "__main__":
    run_setup()
