"""Is this request a complete, valid WebSocket opening handshake (RFC 6455 §4.2.1)?

Checked before auth, admission, a session slot or any engine connection
(docs/design.md, Admission and lifecycle): a request that asks for a
WebSocket but is not a valid one must cost the engine nothing. aiohttp's own checks run only inside
``WebSocketResponse.prepare()``, which the session reaches after it has
already connected to the engine, and they let ``POST`` and ``HTTP/1.0``
through.

Pure functions of the request line and headers: no I/O, testable without a
socket (``tests/proxy/edge/test_handshake.py``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "WEBSOCKET_VERSION",
    "HandshakeRefusal",
    "tokens",
    "validate_upgrade",
    "wants_websocket",
]

#: The only protocol version we speak; a 426 names it (RFC 6455 §4.4).
WEBSOCKET_VERSION: Final = "13"
#: ``Sec-WebSocket-Key`` is 16 random bytes, base64: always 24 characters.
_KEY_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class HandshakeRefusal:
    """Why a WebSocket handshake is refused, as the client and the operator see it.

    Attributes:
        status: 400, or 426 for a version we do not speak.
        reason: a short machine-readable code (the JSON body's ``code`` and the log line).
        message: one human sentence.
        headers: extra response headers (``Sec-WebSocket-Version`` on a 426).
    """

    status: int
    reason: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


def tokens(value: str | None) -> set[str]:
    """The lower-cased comma-separated tokens of a header like ``Connection``."""
    if not value:
        return set()
    return {part.strip().lower() for part in value.split(",") if part.strip()}


def wants_websocket(headers: Mapping[str, str]) -> bool:
    """The request asks for a WebSocket (``Upgrade`` names ``websocket``).

    Such a request must pass :func:`validate_upgrade` or be refused; any other
    request on a WebSocket path is plain HTTP and is reverse-proxied.
    """
    return "websocket" in tokens(headers.get("Upgrade"))


def validate_upgrade(
    method: str, version: tuple[int, int], headers: Mapping[str, str]
) -> HandshakeRefusal | None:
    """None when the handshake is complete and valid, else why not.

    Args:
        method: the request method.
        version: the HTTP version as (major, minor).
        headers: the request headers (case-insensitive lookup expected).
    """
    if method != "GET":
        return HandshakeRefusal(400, "bad_method", f"a WebSocket handshake is a GET, not {method}")
    if version < (1, 1):
        shown = f"HTTP/{version[0]}.{version[1]}"
        return HandshakeRefusal(400, "bad_http_version", f"a WebSocket needs HTTP/1.1, not {shown}")
    if "websocket" not in tokens(headers.get("Upgrade")):
        return HandshakeRefusal(400, "bad_upgrade", "the Upgrade header must name websocket")
    if "upgrade" not in tokens(headers.get("Connection")):
        return HandshakeRefusal(
            400, "bad_connection", "the Connection header must contain the upgrade token"
        )
    key = headers.get("Sec-WebSocket-Key", "").strip()
    try:
        decoded = base64.b64decode(key.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        decoded = b""
    if len(decoded) != _KEY_BYTES:
        return HandshakeRefusal(
            400, "bad_key", "Sec-WebSocket-Key must be 16 bytes, base64-encoded"
        )
    offered = headers.get("Sec-WebSocket-Version")
    if offered is None:
        return HandshakeRefusal(400, "bad_version", "Sec-WebSocket-Version is missing")
    if offered.strip() != WEBSOCKET_VERSION:
        return HandshakeRefusal(
            426,
            "bad_version",
            f"Sec-WebSocket-Version {offered.strip()!r} is not supported; use 13",
            {"Sec-WebSocket-Version": WEBSOCKET_VERSION},
        )
    return None
