"""omni-sidecar: a backpressure- and cancellation-aware proxy for realtime speech engines."""

# First, before anything imports omni_sidecar.core: refuse a compiled core older than its source.
from omni_sidecar import native as _native  # noqa: F401
