"""The proxy's exception tree.

Every exception the ``proxy`` package raises on purpose derives from
:class:`ProxyError`. Exceptions carry data (the key, the side, the close code)
so the boundary that catches them can act without parsing messages, and some
also inherit a builtin so callers may catch them either way (as aiohttp does
with ``InvalidURL(ClientError, ValueError)``)::

    ProxyError
    ├── ConfigError(ProxyError, ValueError)         key, source
    ├── ProtocolViolation                           side, close_code, reason
    ├── InvalidState(ProxyError, RuntimeError)      state
    ├── UpstreamUnavailable(ProxyError, ConnectionError)
    └── SessionClosed                               code, reason, initiator

Overflow is expected under load and is therefore not an exception (see
``OutputBuffer.offer()``). The launcher has its own root,
``engine_launcher.launcher_errors.LauncherError``.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "CLOSE_POLICY_VIOLATION",
    "ConfigError",
    "Initiator",
    "InvalidState",
    "ProtocolViolation",
    "ProxyError",
    "SessionClosed",
    "Side",
    "UpstreamUnavailable",
]

Side = Literal["client", "upstream"]
"""Which peer a fact is about: the one that connects to us, or the engine."""

Initiator = Literal["client", "upstream", "proxy"]
"""Who started a close: one of the two sides, or the proxy itself."""

CLOSE_POLICY_VIOLATION: Final = 1008
"""RFC 6455 §7.4.1: 1008 is the generic "policy violation" close code."""


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


class ProtocolViolation(ProxyError):
    """One side broke the realtime protocol or a limit the proxy enforces.

    Like h11's local/remote split, :attr:`side` says who is at fault; the top
    of the session task turns it into a close frame with :attr:`close_code`.

    Args:
        side: ``"client"`` or ``"upstream"``: the peer that broke the rule.
        reason: A short, human-readable reason; it may be sent as the close
            reason, so keep it under 123 bytes (RFC 6455 §5.5).
        close_code: The WebSocket close code to close the offending side with
            (1008 policy violation by default; 1009 for a too-large message).
    """

    side: Side
    reason: str
    close_code: int

    def __init__(
        self, side: Side, reason: str, *, close_code: int = CLOSE_POLICY_VIOLATION
    ) -> None:
        self.side = side
        self.reason = reason
        self.close_code = close_code
        super().__init__(f"{side} protocol violation ({close_code}): {reason}")


class InvalidState(ProxyError, RuntimeError):
    """A call was made in a state that does not allow it.

    Args:
        message: What was attempted; the message should name the state.
        state: The state the object was in, if the caller has it.
    """

    state: object

    def __init__(self, message: str, *, state: object = None) -> None:
        self.state = state
        super().__init__(message)


class UpstreamUnavailable(ProxyError, ConnectionError):
    """The engine cannot be reached or went away.

    Before the client's upgrade the relay answers 502; mid-session the session
    ends with ``engine_unavailable`` (docs/design.md, Admission and lifecycle).
    """


class SessionClosed(ProxyError):
    """The session is closed; like websockets' ``ConnectionClosed``.

    Args:
        code: The WebSocket close code the session ended with.
        reason: The close reason (for example ``output_backpressure``).
        initiator: Who started the close: ``"client"``, ``"upstream"`` or
            ``"proxy"``.
    """

    code: int
    reason: str
    initiator: Initiator

    def __init__(self, code: int, reason: str, initiator: Initiator) -> None:
        self.code = code
        self.reason = reason
        self.initiator = initiator
        super().__init__(f"session closed by {initiator} ({code}): {reason}")
