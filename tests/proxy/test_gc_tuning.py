"""serve() tunes the cyclic collector: long-lived objects frozen, young passes rarer."""

from __future__ import annotations

import subprocess
import sys

from proxy.startup import GC_YOUNG_THRESHOLD

_CHILD = (
    "import gc; before = gc.get_threshold(); from proxy.startup import tune_gc; tune_gc(); "
    "print(gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:], "
    "gc.get_freeze_count() > 1000)"
)


def test_tune_gc_freezes_what_exists_and_raises_the_young_threshold() -> None:
    # In a child: the collector's settings are process-wide.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out == [str(GC_YOUNG_THRESHOLD), "True", "True"]
    assert GC_YOUNG_THRESHOLD > 700, "fewer young-generation passes than CPython's default"
