"""Which build this process runs, compiled or pure Python, and the stale-build guard.

``COMPILED_MODULES`` is what the install compiles with mypyc when a C compiler
is there (``setup.py`` reads it): the I/O-free core and the shell's per-event
modules. :data:`CORE_BUILD` says which build imports: ``"mypyc"`` or
``"python"``. A compiled module older than its source, or a build missing
some of its modules, is refused when ``proxy`` is imported, naming the fix, so
nobody measures or ships code that is not the code they read
(docs/design.md, Performance).
"""

from __future__ import annotations

import os
from typing import Final

__all__ = [
    "COMPILED_MODULES",
    "CORE_BUILD",
    "PURE_BUILD_ENV",
    "PURE_BUILD_HINT",
    "StaleNativeCore",
    "core_build",
]

#: The modules a compiled build compiles: the core whole, and what each relayed
#: event runs through in the shell (the profile's hot path).
COMPILED_MODULES: Final = (
    "proxy.core.buffer",
    "proxy.core.capabilities",
    "proxy.core.client_limits",
    "proxy.core.drain",
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

#: Set at install time (to anything but "" or "0") for the pure-Python build (setup.py).
PURE_BUILD_ENV: Final = "OMNI_SIDECAR_PURE_BUILD"

#: What to do about a pure-Python build (the start-up line and the refusals say it).
PURE_BUILD_HINT: Final = (
    "reinstall where a C compiler and the Python headers are present (make setup, "
    "pip install .) for the compiled build"
)


class StaleNativeCore(ImportError):
    """A compiled module is older than its source, or the compiled build is incomplete."""


def core_build(root: str, modules: tuple[str, ...] = COMPILED_MODULES) -> str:
    """Which build the package tree under ``root`` holds: "mypyc" or "python".

    Args:
        root: the directory that holds the ``proxy`` package.
        modules: the modules a compiled build has (dotted names under ``root``).

    Raises:
        StaleNativeCore: a compiled module is older than its source, or only
            some of ``modules`` are compiled.
    """
    by_dir: dict[str, list[str]] = {}
    for name in modules:
        package, _, module = name.rpartition(".")
        by_dir.setdefault(os.path.join(root, *package.split(".")), []).append(module)
    compiled: dict[str, float] = {}
    sources: dict[str, float] = {}
    for directory, names in by_dir.items():
        wanted = set(names)
        with os.scandir(directory) as entries:
            for entry in entries:
                stem, _, suffix = entry.name.partition(".")
                if stem not in wanted:
                    continue
                path = os.path.join(directory, stem)
                if suffix.endswith(("so", "pyd")):
                    compiled[path] = entry.stat().st_mtime
                elif suffix == "py":
                    sources[path] = entry.stat().st_mtime
    if not compiled:
        return "python"
    for path, built_at in compiled.items():
        if sources.get(path, 0.0) > built_at:
            where = os.path.relpath(path, root)
            raise StaleNativeCore(
                f"omni-sidecar: {where}.py changed after its compiled module was built; "
                "run `make native` (pip install -e .) again, or `make pure` to run it as Python"
            )
    if len(compiled) < len(modules):
        missing = sorted(set(sources) - set(compiled))
        raise StaleNativeCore(
            f"omni-sidecar: the compiled build lacks {len(missing)} of its modules "
            f"({os.path.relpath(missing[0], root) if missing else '?'}, ...); "
            "run `make native` (pip install -e .) again, or `make pure` to run it as Python"
        )
    return "mypyc"


#: Which build this process imports: "mypyc" (compiled) or "python".
CORE_BUILD: Final = core_build(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
