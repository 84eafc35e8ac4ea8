"""The admin listener: metrics, health, readiness details and the operator console.

``app`` builds the aiohttp application; ``console`` builds the JSON views and
serves the page (docs/console.md).
"""
