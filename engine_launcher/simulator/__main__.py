"""``python -m engine_launcher.simulator``: run the vLLM-Omni engine simulator."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from engine_launcher.simulator.engine_server import run
from engine_launcher.simulator.flags import parse_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, configure logging to stdout, run; return the exit code.

    stdout like vLLM's own logger: the launcher logs a child's stdout at INFO
    and its stderr at WARNING and up, so stderr is left to real trouble
    (an uncaught traceback).
    """
    config = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
