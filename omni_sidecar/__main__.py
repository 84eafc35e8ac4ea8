"""``python -m omni_sidecar``: the ``omni-sidecar`` command (``serve``, ``probe``, ``preflight``)."""

from __future__ import annotations

import sys

from omni_sidecar.cli import main

if __name__ == "__main__":
    sys.exit(main())
