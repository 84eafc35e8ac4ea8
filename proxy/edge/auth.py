"""Client authentication and origin checks, before the WebSocket upgrade.

A key by ``Authorization: Bearer KEY`` or, for browsers, the subprotocol
``openai-insecure-api-key.KEY``; compared in constant time, never logged;
``allowed_origins`` checked only when the client sends ``Origin``
(docs/security.md, 2. Authentication). ``api_keys_file`` may give a key a name,
which labels its usage, and quotas: docs/design.md, Usage; Quotas.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from proxy.core.quota_rules import KeyQuota
from proxy.core.usage import KEY_NAME_PATTERN, UNNAMED_KEY
from proxy.errors import ConfigError

__all__ = [
    "KEY_SUBPROTOCOL_PREFIX",
    "AuthPolicy",
    "AuthResult",
    "load_api_keys",
    "load_key_file",
]

KEY_SUBPROTOCOL_PREFIX: Final = "openai-insecure-api-key."


def load_api_keys(keys: Iterable[str], keys_file: str | None) -> dict[str, str | None]:
    """Configured keys plus those in ``keys_file``, each with its name (None: unnamed).

    See :func:`load_key_file` for the file's format and errors.
    """
    return load_key_file(keys, keys_file)[0]


def load_key_file(
    keys: Iterable[str], keys_file: str | None
) -> tuple[dict[str, str | None], dict[str, KeyQuota]]:
    """Keys with their names, and the quotas of each named key.

    The file has one key per line, ``#`` comments, and optionally fields after
    the key: ``name=NAME`` (NAME: ``[A-Za-z0-9_.-]{1,64}``) and the quotas
    ``max_sessions=N``, ``sessions_per_minute=N``, ``audio_seconds_per_day=N``
    (non-negative numbers, 0 = no limit). A quota needs a name: quotas count
    per name, and keys that share a name share its quotas (their lines must
    then agree). Any other field is an error, never ignored. A key listed twice
    keeps its last line.

    Raises:
        ConfigError: the file cannot be read, holds no key, or a line is malformed
            (the message names the line number, never the key).
    """
    found: dict[str, str | None] = {k.strip(): None for k in keys if k.strip()}
    quotas: dict[str, KeyQuota] = {}
    if keys_file:
        try:
            with open(keys_file, encoding="utf-8") as handle:
                lines = handle.readlines()
        except OSError as exc:
            raise ConfigError("api_keys_file", f"cannot read: {exc.strerror}", keys_file) from None
        for number, line in enumerate(lines, start=1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            name, quota = _key_fields(parts[1:], number, keys_file)
            found[parts[0]] = name
            if name is None or quota is None:
                continue
            if quotas.get(name, quota) != quota:
                raise ConfigError(
                    "api_keys_file",
                    f"line {number}: name {name!r} already has other quotas",
                    keys_file,
                )
            quotas[name] = quota
        if not found:
            # An empty file must not silently turn authentication off.
            raise ConfigError("api_keys_file", "contains no keys", keys_file)
    return found, quotas


#: The quota fields of a key line and how each is read.
_QUOTA_FIELDS: Final = {
    "max_sessions": int,
    "sessions_per_minute": int,
    "audio_seconds_per_day": float,
}


def _key_fields(
    fields: list[str], number: int, keys_file: str
) -> tuple[str | None, KeyQuota | None]:
    """The ``name=`` and quotas of one key line (None when absent)."""
    name: str | None = None
    limits: dict[str, float] = {}
    for item in fields:
        field, sep, value = item.partition("=")
        if not sep or (field != "name" and field not in _QUOTA_FIELDS):
            raise ConfigError(
                "api_keys_file",
                f"line {number}: unknown field {field!r} (a key may be followed by "
                "name=NAME, max_sessions=N, sessions_per_minute=N, audio_seconds_per_day=N)",
                keys_file,
            )
        if field in limits or (field == "name" and name is not None):
            raise ConfigError("api_keys_file", f"line {number}: {field} given twice", keys_file)
        if field == "name":
            if not KEY_NAME_PATTERN.fullmatch(value):
                raise ConfigError(
                    "api_keys_file",
                    f"line {number}: a name is 1-64 of A-Z a-z 0-9 _ . -",
                    keys_file,
                )
            name = value
            continue
        try:
            limit = _QUOTA_FIELDS[field](value)
        except ValueError:
            limit = -1
        if not 0 <= limit < float("inf"):
            raise ConfigError(
                "api_keys_file", f"line {number}: {field} must be a number >= 0", keys_file
            )
        limits[field] = limit
    if not limits:
        return name, None
    if name is None:
        raise ConfigError(
            "api_keys_file",
            f"line {number}: a quota needs name=NAME (quotas count per key name)",
            keys_file,
        )
    return name, KeyQuota(**limits)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class AuthResult:
    """``ok`` or the rejection (``reason`` is a metric label, ``status`` the HTTP code)."""

    ok: bool
    reason: str = ""
    status: int = 200
    message: str = ""
    #: The accepted key's name, or ``unnamed`` (also when auth is off); never the key.
    key_name: str = UNNAMED_KEY
    #: Which key it was, as a digest ("" with auth off): a resume must present the same.
    key_id: str = ""


_OK: Final = AuthResult(True)


class AuthPolicy:
    """Decides whether a handshake may proceed.

    Args:
        api_keys: accepted keys, or keys with their names (``load_api_keys``); empty = auth off.
        allowed_origins: accepted ``Origin`` values; empty = any.
    """

    def __init__(
        self, api_keys: Mapping[str, str | None] | Iterable[str], allowed_origins: Iterable[str]
    ) -> None:
        named = api_keys if isinstance(api_keys, Mapping) else dict.fromkeys(api_keys)
        self._keys = tuple(k.encode() for k in named)
        self._results = tuple(
            AuthResult(True, key_name=name or UNNAMED_KEY, key_id=_key_id(key))
            for key, name in named.items()
        )
        self._origins = frozenset(o.rstrip("/") for o in allowed_origins)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def key_names(self) -> frozenset[str]:
        """Every ``key`` label value sessions can have (names plus ``unnamed``)."""
        return frozenset(r.key_name for r in self._results) | {UNNAMED_KEY}

    def _match(self, candidate: str) -> AuthResult | None:
        """The accepted result of the matching key, or None."""
        given = candidate.encode()
        matched: AuthResult | None = None
        # No early exit: time does not depend on which key matched.
        for key, result in zip(self._keys, self._results, strict=True):
            if hmac.compare_digest(given, key):
                matched = result
        return matched

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
        if scheme.lower() == "bearer" and token.strip():
            matched = self._match(token.strip())
            if matched is not None:
                return matched
        for protocol in offered_protocols:
            if protocol.startswith(KEY_SUBPROTOCOL_PREFIX):
                matched = self._match(protocol[len(KEY_SUBPROTOCOL_PREFIX) :])
                if matched is not None:
                    return matched
        return AuthResult(False, "unauthorized", 401, "missing or invalid API key")


def _key_id(key: str) -> str:
    """A key's identity for comparing two handshakes, never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def offered_subprotocols(header: str | None) -> list[str]:
    """Split ``Sec-WebSocket-Protocol``."""
    if not header:
        return []
    return [p.strip() for p in header.split(",") if p.strip()]
