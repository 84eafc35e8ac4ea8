"""omni-sidecar: a backpressure- and cancellation-aware proxy for realtime speech engines."""

# First, before anything imports proxy.core: refuse a compiled core older than its source.
from proxy import native as _native  # noqa: F401
