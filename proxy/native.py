"""Which build of the I/O-free core this process runs, and the stale-build guard.

The core (``proxy/core``) runs as Python or, after ``make native``, compiled
by mypyc (extension modules next to the sources, imported first).
:data:`CORE_BUILD` says which: ``"mypyc"`` or ``"python"``. A compiled module
older than its source is refused when ``proxy`` is imported, with one line
naming both fixes, so nobody measures or ships code that is not the code
they read. (The check reads the package directory, so it lives here and not
in the I/O-free core.)
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["CORE_BUILD", "StaleNativeCore", "core_build"]


class StaleNativeCore(ImportError):
    """A compiled core module is older than its source."""


def core_build(here: str) -> str:
    """Which core the package directory ``here`` holds: "mypyc" or "python".

    Raises:
        StaleNativeCore: a compiled module is older than its source.
    """
    compiled: dict[str, float] = {}
    sources: dict[str, float] = {}
    with os.scandir(here) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith((".so", ".pyd")):
                module = name.split(".", 1)[0]
                if not module.endswith("__mypyc"):
                    compiled[module] = entry.stat().st_mtime
            elif name.endswith(".py") and name != "__init__.py":
                sources[name[:-3]] = entry.stat().st_mtime
    if not compiled:
        return "python"
    for module, built_at in compiled.items():
        if sources.get(module, 0.0) > built_at:
            raise StaleNativeCore(
                f"omni-sidecar: proxy/core/{module}.py changed after its compiled module was "
                "built; run `make native` again, or `make pure` to run the Python core"
            )
    return "mypyc"


#: Which core this process imports: "mypyc" (compiled) or "python".
CORE_BUILD: Final = core_build(os.path.join(os.path.dirname(os.path.abspath(__file__)), "core"))
