"""Which build this process runs, compiled or pure Python, and the stale-build guard.

``COMPILED_MODULES`` is what the install compiles with mypyc when a C compiler
is there (``scripts/build_backend.py`` reads it): the I/O-free core and the shell's per-event
modules. :data:`CORE_BUILD` says which build imports: ``"mypyc"`` or
``"python"``. A compiled module whose source changed after the build (by
digest), or a build missing some of its modules, is refused when ``proxy`` is imported, naming the fix, so
nobody measures or ships code that is not the code they read
(docs/design.md, Performance). With ``OMNI_SIDECAR_PURE=1`` (:data:`RUN_PURE_ENV`)
the compiled modules are imported from their sources, extensions or not: the
edit-test loop needs no rebuild (docs/development.md, The compiled build).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Final

__all__ = [
    "COMPILED_MODULES",
    "CORE_BUILD",
    "PURE_BUILD_ENV",
    "PURE_BUILD_HINT",
    "PURE_BUILD_WHY",
    "RUN_PURE_ENV",
    "SOURCES_MANIFEST",
    "StaleNativeCore",
    "core_build",
    "run_sources",
    "source_digest",
]

#: The modules a compiled build compiles: the core whole (its audio modules
#: aside: numpy and libsoxr do their work, docs/design.md, Audio formats), and
#: what each relayed event runs through in the shell (the profile's hot path).
COMPILED_MODULES: Final = (
    "proxy.core.buffer",
    "proxy.core.capabilities",
    "proxy.core.client_limits",
    "proxy.core.drain",
    "proxy.core.engine_releases",
    "proxy.core.events",
    "proxy.core.input_audio",
    "proxy.core.journal",
    "proxy.core.ledger",
    "proxy.core.lifecycle",
    "proxy.core.notices",
    "proxy.core.playback",
    "proxy.core.playback_state",
    "proxy.core.quota_rules",
    "proxy.core.ratelimit",
    "proxy.core.response_requests",
    "proxy.core.resume_state",
    "proxy.core.resume_token",
    "proxy.core.session_core",
    "proxy.core.session_output",
    "proxy.core.session_settings",
    "proxy.core.telemetry",
    "proxy.core.usage",
    "proxy.core.view",
    "proxy.session.client_reader",
    "proxy.session.client_side",
    "proxy.session.frames",
    "proxy.session.limits",
    "proxy.session.observer",
    "proxy.session.relay",
    "proxy.session.tasks",
    "proxy.session.timers",
    "proxy.session.upstream_side",
    "proxy.session.writer",
    "proxy.session.upstream_link.frame_outbox",
    "proxy.session.upstream_link.picows_link",
)

#: Set at install time (to anything but "" or "0") for the pure-Python build (the build backend).
PURE_BUILD_ENV: Final = "OMNI_SIDECAR_PURE_BUILD"

#: Set when running (to anything but "" or "0"): import the compiled modules' sources and
#: skip their extensions, stale or not (the development mode; CI never sets it).
RUN_PURE_ENV: Final = "OMNI_SIDECAR_PURE"

#: What to do about a pure-Python build (the start-up line and the refusals say it).
PURE_BUILD_HINT: Final = (
    "reinstall where a C compiler and the Python headers are present (make setup, "
    "pip install .) for the compiled build"
)


class StaleNativeCore(ImportError):
    """A compiled module's source changed after the build, or the build is incomplete."""


#: Written by the build next to the compiled modules' shared library: one line per
#: compiled module, ``<module> <sha256 of the source it was compiled from>``.
SOURCES_MANIFEST: Final = "_native_sources.txt"

_FIX: Final = (
    f"run `make native` (pip install -e .) to compile again, or set {RUN_PURE_ENV}=1 "
    "to run the sources as they are (no rebuild: the edit-test loop), or `make pure` "
    "to remove the extensions"
)


def source_digest(path: str) -> str:
    """The sha256 of a source file, as the build records it."""
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _source(root: str, module: str) -> str:
    return os.path.join(root, *module.split(".")) + ".py"


def _compiled(root: str, module: str) -> bool:
    package, _, stem = module.rpartition(".")
    directory = os.path.join(root, *package.split("."))
    with os.scandir(directory) as entries:
        return any(
            entry.name.startswith(stem + ".") and entry.name.endswith((".so", ".pyd"))
            for entry in entries
        )


def core_build(root: str, modules: tuple[str, ...] = COMPILED_MODULES) -> str:
    """Which build the package tree under ``root`` holds: "mypyc" or "python".

    A compiled build is each of ``modules`` compiled, and each source the same
    as the one the build compiled (by digest: an install does not keep file
    times in order, an edit after the build changes the digest).

    Args:
        root: the directory that holds the ``proxy`` package.
        modules: the modules a compiled build has (dotted names under ``root``).

    Raises:
        StaleNativeCore: a compiled module's source changed after the build,
            or only some of ``modules`` are compiled.
    """
    compiled = [name for name in modules if _compiled(root, name)]
    if not compiled:
        return "python"
    if len(compiled) < len(modules):
        missing = [name for name in modules if name not in compiled]
        raise StaleNativeCore(
            f"omni-sidecar: the compiled build lacks {len(missing)} of its modules "
            f"({missing[0]}, ...); {_FIX}"
        )
    try:
        with open(os.path.join(root, "proxy", SOURCES_MANIFEST), encoding="utf-8") as handle:
            built = dict(line.split(" ", 1) for line in handle.read().splitlines() if line)
    except OSError:
        built = {}
    for name in modules:
        if built.get(name) != source_digest(_source(root, name)):
            where = os.path.relpath(_source(root, name), root)
            raise StaleNativeCore(
                f"omni-sidecar: {where} changed after its compiled module was built; {_FIX}"
            )
    return "mypyc"


class _SourcesFirst(importlib.abc.MetaPathFinder):
    """Finds the named modules' ``.py`` sources, never their extension modules."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or not path:
            return None
        loaders = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, loaders).find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


def run_sources(modules: tuple[str, ...] = COMPILED_MODULES) -> None:
    """Import ``modules`` from their ``.py`` sources from now on, even where compiled.

    All of them or none: a compiled module calls the others as compiled. Called
    before any of them is imported (``import proxy`` does, with RUN_PURE_ENV set).
    """
    if not any(isinstance(finder, _SourcesFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst(frozenset(modules)))


def _wanted(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _this_build() -> str:
    if _wanted(RUN_PURE_ENV):
        run_sources()
        return "python"
    return core_build(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: Which build this process imports: "mypyc" (compiled) or "python".
CORE_BUILD: Final = _this_build()

#: Why this process runs pure Python (the start-up WARNING says it; "" when compiled).
PURE_BUILD_WHY: Final = (
    ""
    if CORE_BUILD == "mypyc"
    else f"{RUN_PURE_ENV}=1: the sources run, any extensions are skipped"
    if _wanted(RUN_PURE_ENV)
    else f"no C compiler at install, or {PURE_BUILD_ENV}=1"
)
