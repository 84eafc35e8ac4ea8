"""``python -m metrics --markdown``: print docs/metrics.md.

The reference is generated from the metric declarations
(:mod:`metrics.reference`); a test checks that the committed
file is this output, so after changing a metric run::

    python -m metrics --markdown > docs/metrics.md
"""

from __future__ import annotations

import argparse
import sys

from metrics.reference import metrics_markdown

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Write docs/metrics.md to stdout; 2 (and the usage) without ``--markdown``."""
    parser = argparse.ArgumentParser(
        prog="python -m metrics",
        description="Print the metrics reference, generated from the metric declarations.",
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/metrics.md")
    ns = parser.parse_args(argv)
    if not ns.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(metrics_markdown())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
