"""Benchmarks of omni-sidecar against a direct connection, nginx and a bare aiohttp relay.

Run ``python -m bench SCENARIO`` or ``python -m bench all``; see bench/README.md.
"""
