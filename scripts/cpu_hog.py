"""Keep every core busy for a bounded time, to run the test suite under load.

``python scripts/cpu_hog.py --seconds 900 -- make pytest`` starts one busy
process per core (``--procs`` to change), runs the command, and stops the busy
processes when the command ends (each also stops by itself after
``--seconds``, so none outlives a killed parent). The exit status is the
command's. ``make test-loaded`` runs the whole suite this way.

Only processes this script started are ever signalled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100_000):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seconds", type=float, default=900.0)
    parser.add_argument("--spin", type=float, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.spin is not None:
        _spin(ns.spin)
        return 0
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("give the command to run after --")
    hogs = [
        subprocess.Popen([sys.executable, __file__, "--spin", str(ns.seconds)])
        for _ in range(ns.procs)
    ]
    try:
        return subprocess.call(command)
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
