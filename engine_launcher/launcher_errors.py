"""The engine launcher's exception root, :class:`LauncherError`, and its subclasses.

The launcher never imports the proxy, so it has a root of its own; the tree,
and how an invalid ``EngineConfig`` value becomes the proxy's ``ConfigError``:
docs/design.md, Code rules (4).
"""

from __future__ import annotations

__all__ = ["EngineStartError", "LauncherError", "RestartBudgetExhausted"]


class LauncherError(Exception):
    """Root of every exception the ``engine_launcher`` layer raises on purpose."""


class EngineStartError(LauncherError):
    """The engine child could not be started or did not become ready in time.

    Args:
        message: What went wrong (exit status, timeout, missing executable).
        returncode: The child's exit status if it exited, else ``None``.
    """

    returncode: int | None

    def __init__(self, message: str, *, returncode: int | None = None) -> None:
        self.returncode = returncode
        super().__init__(message)


class RestartBudgetExhausted(LauncherError):
    """The engine was restarted too often within the restart window.

    The process should exit non-zero so that systemd restarts the unit
    (docs/design.md, Engine supervision).

    Args:
        message: A description for the log.
        restarts: How many restarts happened within the window.
        window: The window's length in seconds.
    """

    restarts: int
    window: float

    def __init__(self, message: str, *, restarts: int = 0, window: float = 0.0) -> None:
        self.restarts = restarts
        self.window = window
        super().__init__(message)
