"""The proxy's exception root, :class:`ProxyError`, and the settings' :class:`ConfigError`.

The tree, what its exceptions carry and why: docs/design.md, Code rules (4).
"""

from __future__ import annotations

__all__ = ["ConfigError", "ProxyError"]


class ProxyError(Exception):
    """Root of every exception the ``proxy`` package raises on purpose."""


class ConfigError(ProxyError, ValueError):
    """A setting is unknown or has an invalid value.

    The message names both the key and where the value came from, for example
    ``max_sessions: invalid integer 'abc' (from env OMNI_SIDECAR_MAX_SESSIONS)``.

    Args:
        key: The setting's name; engine settings are written ``engine.<field>``.
        message: What is wrong with it, without the key or the source.
        source: Where the value came from: ``default``, ``file <path>``,
            ``env OMNI_SIDECAR_<KEY>`` or ``flag --<key>``.
    """

    key: str
    message: str
    source: str

    def __init__(self, key: str, message: str, source: str) -> None:
        self.key = key
        self.message = message
        self.source = source
        super().__init__(f"{key}: {message} (from {source})")

    def with_source(self, source: str) -> ConfigError:
        """Return a copy of this error that names another source.

        Args:
            source: The source to name instead of :attr:`source`.

        Returns:
            A new :class:`ConfigError` with the same key and message.
        """
        return ConfigError(self.key, self.message, source)
