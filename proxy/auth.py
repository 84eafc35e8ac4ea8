"""Client authentication and origin checks, before the WebSocket upgrade.

Auth is off unless ``api_keys`` or ``api_keys_file`` is set. A client proves a
key with ``Authorization: Bearer KEY`` or, for browsers that cannot set
headers, by offering the subprotocol ``openai-insecure-api-key.KEY`` (the
connection is then accepted with the ``realtime`` subprotocol it also offered).
Keys are compared in constant time against every configured key, and never
logged. ``allowed_origins`` is checked only when the client sends ``Origin``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from proxy.errors import ConfigError

__all__ = ["KEY_SUBPROTOCOL_PREFIX", "AuthPolicy", "AuthResult", "load_api_keys"]

KEY_SUBPROTOCOL_PREFIX: Final = "openai-insecure-api-key."


def load_api_keys(keys: Iterable[str], keys_file: str | None) -> tuple[str, ...]:
    """Configured keys plus those in ``keys_file`` (one per line, ``#`` comments).

    Raises:
        ConfigError: the file cannot be read.
    """
    found = [k.strip() for k in keys if k.strip()]
    if keys_file:
        try:
            with open(keys_file, encoding="utf-8") as handle:
                for line in handle:
                    line = line.split("#", 1)[0].strip()
                    if line:
                        found.append(line)
        except OSError as exc:
            raise ConfigError("api_keys_file", f"cannot read: {exc.strerror}", keys_file) from None
        if not found:
            # An empty file must not silently turn authentication off.
            raise ConfigError("api_keys_file", "contains no keys", keys_file)
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True, slots=True)
class AuthResult:
    """``ok`` or the rejection (``reason`` is a metric label, ``status`` the HTTP code)."""

    ok: bool
    reason: str = ""
    status: int = 200
    message: str = ""


_OK: Final = AuthResult(True)


class AuthPolicy:
    """Decides whether a handshake may proceed.

    Args:
        api_keys: accepted keys; empty = auth off.
        allowed_origins: accepted ``Origin`` values; empty = any.
    """

    def __init__(self, api_keys: Iterable[str], allowed_origins: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in api_keys)
        self._origins = frozenset(o.rstrip("/") for o in allowed_origins)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _key_ok(self, candidate: str) -> bool:
        given = candidate.encode()
        ok = False
        for key in self._keys:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(given, key)
        return ok

    def check(self, headers: Mapping[str, str], offered_protocols: Iterable[str]) -> AuthResult:
        """Check origin, then credentials.

        Args:
            headers: the request headers (case-insensitive mapping).
            offered_protocols: subprotocols from ``Sec-WebSocket-Protocol``.
        """
        origin = headers.get("Origin")
        if origin is not None and self._origins and origin.rstrip("/") not in self._origins:
            return AuthResult(False, "forbidden_origin", 403, "origin not allowed")
        if not self._keys:
            return _OK
        auth = headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip() and self._key_ok(token.strip()):
            return _OK
        for protocol in offered_protocols:
            if protocol.startswith(KEY_SUBPROTOCOL_PREFIX) and self._key_ok(
                protocol[len(KEY_SUBPROTOCOL_PREFIX) :]
            ):
                return _OK
        return AuthResult(False, "unauthorized", 401, "missing or invalid API key")


def offered_subprotocols(header: str | None) -> list[str]:
    """Split ``Sec-WebSocket-Protocol``."""
    if not header:
        return []
    return [p.strip() for p in header.split(",") if p.strip()]
