"""The ``omni-sidecar`` command's exit statuses, written once (docs/design.md, Exit statuses).

``serve``, ``preflight`` and ``drain`` exit with these; they live at the bottom of
the package direction so that ``engine_launcher.preflight`` and ``proxy`` share them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ENGINE_FAILED",
    "EXIT_LISTEN",
    "EXIT_OK",
    "EXIT_PREFLIGHT",
    "EXIT_STATUSES",
]

#: Stopped on request, or every check passed.
EXIT_OK: Final = 0
#: The engine failed for good: restart budget spent, or it never became ready.
EXIT_ENGINE_FAILED: Final = 1
#: A setting is invalid (unknown key, bad value, a value the core rejects).
EXIT_CONFIG: Final = 2
#: A cheap preflight check failed before the engine was started.
EXIT_PREFLIGHT: Final = 3
#: The listen or admin address is in use, not permitted or not available, or a
#: socket systemd passed cannot be served on (docs/design.md, Socket activation).
EXIT_LISTEN: Final = 4

#: Every status and its meaning, as ``serve --help`` and docs/operations.md list them.
EXIT_STATUSES: Final[dict[int, str]] = {
    EXIT_OK: "stopped on request (SIGTERM, SIGINT)",
    EXIT_ENGINE_FAILED: "the engine failed for good (restart budget spent, or never ready)",
    EXIT_CONFIG: "configuration error",
    EXIT_PREFLIGHT: "a preflight check failed",
    EXIT_LISTEN: "listen or admin address in use, not permitted or not available, "
    "or a socket systemd passed cannot be served on",
}
