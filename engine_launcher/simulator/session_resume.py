"""Resume vocabulary of the simulator: the request, the credential and the outcomes.

``session.resume`` is parsed here; a session keeps only a SHA-256 digest of
its resume token and compares in constant time; what a resume attempt comes
to (refused, resync required, resumed) is a small value the shell acts on.
Sans-I/O. docs/design.md, Simulator (Resume); docs/engine-protocol.md, Resume.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "INVALID_EVENT_ACK",
    "INVALID_SESSION_RESUME",
    "SESSION_RESUME_CONFLICT",
    "SESSION_RESUME_EXPIRED",
    "UNKNOWN_SESSION",
    "UNSUPPORTED_SESSION_RESUME",
    "EngineResumeRequest",
    "Refusal",
    "ResumeCredential",
    "Resumed",
    "ResyncRequired",
    "parse_resume_request",
]

#: ``session.resume`` without a session id, a token or a cursor >= 0.
INVALID_SESSION_RESUME: Final = "invalid_session_resume"
#: No such session, its grace is over, or the token is not its token (one
#: answer for the three, so that a guess tells nothing).
SESSION_RESUME_EXPIRED: Final = "session_resume_expired"
#: The session's model does not resume, or ``session.resume`` came mid-connection.
UNSUPPORTED_SESSION_RESUME: Final = "unsupported_session_resume"
#: The token the last resume replaced (two resumes raced), or a cursor past the last seq.
SESSION_RESUME_CONFLICT: Final = "session_resume_conflict"
#: ``session.event_ack`` without a seq >= 0, or acknowledging a seq never sent.
INVALID_EVENT_ACK: Final = "invalid_event_ack"


@dataclass(frozen=True, slots=True)
class EngineResumeRequest:
    """A well-formed ``session.resume``."""

    session_id: str
    resume_token: str = field(repr=False)
    cursor: int


def parse_resume_request(event: Mapping[str, Any]) -> EngineResumeRequest | None:
    """The request in ``event``, or ``None`` when a field is missing or malformed.

    ``last_received_server_event_seq`` may be left out (0: nothing received yet).
    """
    session_id = event.get("session_id")
    token = event.get("resume_token")
    cursor = event.get("last_received_server_event_seq", 0)
    if (
        not isinstance(session_id, str)
        or not session_id
        or not isinstance(token, str)
        or not token
        or not isinstance(cursor, int)
        or isinstance(cursor, bool)
        or cursor < 0
    ):
        return None
    return EngineResumeRequest(session_id, token, cursor)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


# Compared against when no session has the id, so that an unknown id costs
# what a wrong token costs.
_NOBODY: Final = _digest("")


class ResumeCredential:
    """What a session keeps of its resume token: a digest, never the token.

    Args:
        token: the token handed out with ``session.created``.
    """

    __slots__ = ("_digest", "_previous")

    def __init__(self, token: str) -> None:
        self._digest = _digest(token)
        self._previous: bytes | None = None

    def verify(self, token: str) -> bool:
        """Whether ``token`` is the current token (constant-time comparison)."""
        return hmac.compare_digest(self._digest, _digest(token))

    def was_replaced(self, token: str) -> bool:
        """Whether ``token`` is the one the last rotation replaced."""
        if self._previous is None:
            return False
        return hmac.compare_digest(self._previous, _digest(token))

    def rotate(self, token: str) -> None:
        """Make ``token`` the current one (a resume issues a fresh token)."""
        self._previous, self._digest = self._digest, _digest(token)

    @staticmethod
    def verify_unknown(token: str) -> bool:
        """The check an unknown session id gets: as costly as :meth:`verify`, always ``False``."""
        hmac.compare_digest(_NOBODY, _digest(token))
        return False


@dataclass(frozen=True, slots=True)
class Refusal:
    """A resume refused with ``error {code, message}``, then close 1000."""

    code: str
    message: str


#: The one answer for an unknown id, an expired session and a wrong token: it
#: names no session, so it tells a guesser nothing.
UNKNOWN_SESSION: Final = Refusal(SESSION_RESUME_EXPIRED, "unknown or expired duplex session")


@dataclass(frozen=True, slots=True)
class ResyncRequired:
    """The journal cannot bridge the client's cursor: ``session.resync_required``, then close."""

    session_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Resumed:
    """The resume succeeded.

    Attributes:
        replaced: the attachment generation the resume took the session from,
            when another socket was still attached (it gets ``session.replaced``).
    """

    replaced: int | None
