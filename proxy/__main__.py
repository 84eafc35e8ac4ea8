"""``python -m omni_sidecar``: the ``omni-sidecar`` command (``serve``, ``probe``, ``preflight``)."""

from __future__ import annotations

import sys

from proxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
