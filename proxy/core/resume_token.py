"""The resume tokens a sidecar hands its clients (docs/design.md, Resume).

A client's token is ``<engine token>~<generation>.<mac>``: the engine's own
token (what the engine checks when a resume reaches it), how many times the
sidecar has reattached a client with that engine token, and an HMAC-SHA256 of
the session id, the API key's id, the engine token and the generation under
a secret every sidecar of a fleet shares (``resume_secret_file``). So any
sidecar, holding the session or not, tells a token issued for this key and
this session from any other, and only the engine token ever reaches the
engine. Sans-I/O: no clock, no randomness; the secret is passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = ["TOKEN_MARK", "ResumeForEngine", "ResumeTokens", "TokenParts"]

#: Separates the engine's token from the sidecar's part of the ones it issues.
TOKEN_MARK: Final = "~"
#: Bytes of the MAC kept in a token (128 bits: forging one is as hard as guessing it).
_MAC_BYTES: Final = 16
#: Longest generation accepted (digits): a session is reattached far fewer times.
_MAX_GENERATION_DIGITS: Final = 9


@dataclass(frozen=True, slots=True)
class TokenParts:
    """A verified token: the engine's token inside it and its generation."""

    engine_token: str
    generation: int


@dataclass(frozen=True, slots=True)
class ResumeForEngine:
    """A verified resume: its session, its token's parts, the frame for the engine."""

    session_id: str
    parts: TokenParts
    text: str


class ResumeTokens:
    """Issues and verifies tokens under one secret.

    Args:
        secret: the fleet's shared secret (the edge reads at least 16 bytes
            from ``resume_secret_file``, or makes a random one per process).
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def issue(self, session_id: str, key_id: str, engine_token: str, generation: int) -> str:
        """The token for ``generation`` of this session's ``engine_token``, bound to ``key_id``."""
        mac = self._mac(session_id, key_id, engine_token, generation)
        return f"{engine_token}{TOKEN_MARK}{generation}.{mac}"

    def verify(self, token: str, session_id: str, key_id: str) -> TokenParts | None:
        """The token's parts when this secret issued it for ``session_id`` and
        ``key_id``; None for anything else (forged, another key or session, unmarked)."""
        engine_token, marked, tail = token.rpartition(TOKEN_MARK)
        generation_text, dot, mac = tail.partition(".")
        if not (marked and dot and engine_token):
            return None
        if not (generation_text.isascii() and generation_text.isdigit()):
            return None
        if len(generation_text) > _MAX_GENERATION_DIGITS:
            return None
        generation = int(generation_text)
        if str(generation) != generation_text:
            return None  # one spelling per generation ("07" is not 7)
        expected = self._mac(session_id, key_id, engine_token, generation)
        if not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "surrogatepass")):
            return None
        return TokenParts(engine_token, generation)

    def engine_resume(self, body: dict[str, Any] | None, key_id: str) -> ResumeForEngine | None:
        """A client's ``session.resume`` (its parsed frame) as the engine must get it:
        the engine's own token in place of the client's, when the client's is bound to
        the named session and ``key_id``; None for any other (the one refusal).
        """
        body = body or {}
        session_id, token = body.get("session_id"), body.get("resume_token")
        cursor = body.get("last_received_server_event_seq", 0)
        if not (isinstance(session_id, str) and isinstance(token, str)) or type(cursor) is not int:
            return None
        parts = self.verify(token, session_id, key_id)
        if parts is None:
            return None
        engine_body = {**body, "resume_token": parts.engine_token}
        if cursor < 0:  # the engine refuses a negative cursor; read as 0 (none received)
            engine_body["last_received_server_event_seq"] = 0
        text = orjson.dumps(engine_body).decode()
        return ResumeForEngine(session_id, parts, text)

    def _mac(self, session_id: str, key_id: str, engine_token: str, generation: int) -> str:
        # Each field is length-prefixed, so no two field lists make the same message.
        message = b"".join(
            len(part).to_bytes(4, "big") + part
            for part in (
                b"omni-sidecar resume v1",
                session_id.encode("utf-8", "surrogatepass"),
                key_id.encode("utf-8", "surrogatepass"),
                engine_token.encode("utf-8", "surrogatepass"),
                str(generation).encode(),
            )
        )
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()[:_MAC_BYTES]
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
