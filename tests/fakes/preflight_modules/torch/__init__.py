"""Stand-in for ``torch``: only what engine_launcher.preflight touches."""

from . import cuda

__all__ = ["cuda"]
__version__ = "2.9.0+fake"
