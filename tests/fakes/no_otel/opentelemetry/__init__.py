"""Stands in for a missing OpenTelemetry install (tests/integration/test_tracing.py).

Put first on PYTHONPATH, this regular package shadows the installed namespace
package, and importing it fails as if ``omni-sidecar[otel]`` were not installed.
"""

raise ImportError("No module named 'opentelemetry' (test stand-in)", name="opentelemetry")
