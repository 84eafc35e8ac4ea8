"""``python -m proxy.settings``: print the generated example config or reference.

``--example`` prints ``configs/omni-sidecar.example.toml`` and ``--markdown``
prints ``docs/configuration.md``; tests check that both committed files are
this output, so after changing a declaration run::

    python -m proxy.settings --example > configs/omni-sidecar.example.toml
    python -m proxy.settings --markdown > docs/configuration.md
"""

from __future__ import annotations

import argparse
import sys

from proxy.settings.render import configuration_markdown, example_config

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Write the requested text to stdout; 2 (and the usage) when none is asked for."""
    parser = argparse.ArgumentParser(
        prog="python -m proxy.settings",
        description="Print the example config or the configuration reference, "
        "generated from the settings' declarations.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--example", action="store_true", help="print the example config")
    what.add_argument(
        "--markdown", action="store_true", help="print docs/configuration.md (Markdown)"
    )
    ns = parser.parse_args(argv)
    if ns.example:
        sys.stdout.write(example_config())
    elif ns.markdown:
        sys.stdout.write(configuration_markdown())
    else:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
