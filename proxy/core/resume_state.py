"""One session's resume state: token, grace and replay (docs/design.md, Resume).

The engine offers resume in ``session.created``; this holds its token (the
client's copy is bound to the session and its key, proxy/core/resume_token.py,
and only a digest of it is kept), when a dropped client's grace ends, the
journal of what was written and the replay a resume gets. Sans-I/O: the
session core feeds it engine bodies and ``now``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.core.journal import ReplayJournal
from proxy.core.resume_token import ResumeTokens

__all__ = ["HandOver", "ResumeState"]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class HandOver(enum.Enum):
    """Whether a draining sidecar can hand a session over now, or why not
    (docs/design.md, Start-up and shutdown). The value is what the drain's log says."""

    #: Leave the engine without ``session.close``; the client resumes elsewhere (1012).
    NOW = "now"
    #: A cancelled response's terminal has not reached the client yet: wait for it.
    CANCEL_SETTLING = "cancel settling"
    #: The engine has not said yet whether the session resumes, or its token has not
    #: reached the client yet (``session.created`` / ``session.resumed`` not written):
    #: handed over once it has, else it drains.
    OPENING = "opening"
    #: The engine does not offer resume for it, or ``client_resume_grace`` is 0.
    NOT_RESUMABLE = "not resumable"
    #: Its client did not say it resumes (no ``autostart=0``/``resume=1``, never resumed).
    CLIENT_CANNOT_RESUME = "client cannot resume"
    #: It is ending already (closing, or its client asked to close).
    ENDING = "ending"
    #: The engine is this sidecar's own child and stops with it (not ``external``).
    ENGINE_STOPS = "engine stops with the sidecar"
    #: No ``resume_secret_file``: no other sidecar could verify the client's token.
    NO_SHARED_SECRET = "no shared resume secret"


class ResumeState:
    """Whether and how a session resumes.

    Args:
        grace: ``client_resume_grace`` in seconds (0: never held).
        journal_bytes, journal_ttl: the journal's bounds
            (``resume_journal_bytes``, ``resume_journal_ttl``).
        tokens: issues the client's tokens (the fleet's secret).
    """

    def __init__(
        self, grace: float, journal_bytes: int, journal_ttl: float, tokens: ResumeTokens
    ) -> None:
        self._grace = grace
        self._tokens = tokens
        #: The id of the API key the session opened with ("" without auth): tokens are bound to it.
        self.key_id = ""
        #: Tokens issued for the current engine token (the next one's generation).
        self._issued = 0
        self._journal_bounds = (journal_bytes, journal_ttl)
        #: The engine offers resume for this session and the sidecar holds it on a drop.
        self.resumable = False
        #: The engine's own resume token, and a digest of the one a client must present.
        self._engine_token = ""
        self._session_id = ""
        self._token_digest = b""
        #: The engine's last ``session`` object (``session.resumed`` repeats it).
        self.session_object: dict[str, Any] | None = None
        self.generation = 0
        #: When the client dropped (None: attached, or it ended), and when its
        #: grace ends: the one home of "held" (``held``).
        self.detached_at: float | None = None
        self.grace_at: float | None = None
        #: What was written, by ``server_event_seq`` (None until the engine offers resume).
        self.journal: ReplayJournal | None = None
        #: ``session.resumed`` and the replayed frames' text, written before anything queued.
        self.replay: deque[str] = deque()
        #: Events replayed and graces that ran out, not yet reported.
        self.replayed = 0
        self.expired = False
        #: The client's first message was a ``session.resume``, passed to the engine.
        self.passed_upstream = False
        #: The engine's last token reached the client (its ``session.created`` or
        #: ``session.resumed`` was written): only then can it resume elsewhere.
        self.token_delivered = False

    def on_session(self, body: dict[str, Any], session_id: str | None) -> str | None:
        """``session.created`` / ``session.resumed`` from the engine.

        Returns:
            the token the client gets in place of the engine's (None: the frame
            carries no token to replace).
        """
        session = body.get("session")
        if isinstance(session, dict):
            self.session_object = session
            capabilities = session.get("capabilities")
            supported = (
                isinstance(capabilities, dict)
                and capabilities.get("supports_session_resume") is True
            )
        else:
            supported = self.resumable  # a resumed session keeps what it was
        generation = body.get("attachment_generation")
        if type(generation) is int:
            self.generation = generation
        token = body.get("resume_token")
        if not (isinstance(token, str) and token):
            return None
        if not supported or self._grace <= 0 or session_id is None:
            # Not held here, but the engine's token still never reaches the
            # client unbound: a resume elsewhere must be this key's.
            return self._tokens.issue(session_id or "", self.key_id, token, 0)
        self.resumable = True
        self.token_delivered = False  # until this very event is written
        self._engine_token = token
        self._session_id = session_id
        self._issued = 0
        client_token = self._tokens.issue(session_id, self.key_id, token, 0)
        self._token_digest = _digest(client_token)
        if self.journal is None:
            self.journal = ReplayJournal(*self._journal_bounds)
        return client_token

    def ack(self, body: dict[str, Any] | None) -> None:
        """``session.event_ack``: the client has everything up to its seq."""
        acked = (body or {}).get("server_event_seq")
        if self.journal is not None and type(acked) is int:
            self.journal.ack(acked)

    @property
    def held(self) -> bool:
        """The client dropped and the session waits for a resume."""
        return self.detached_at is not None

    def release(self) -> None:
        """No longer held (the session ends, or its client is back)."""
        self.detached_at = self.grace_at = None

    def detach(self, now: float) -> None:
        """The client dropped: held until ``now`` + grace."""
        self.detached_at = now
        self.grace_at = now + self._grace
        self.replay.clear()

    def grace_over(self, now: float) -> bool:
        """The grace ran out at ``now``: the session is no longer held."""
        if self.grace_at is None or now < self.grace_at:
            return False
        self.release()
        self.expired = True
        return True

    def token_matches(self, token: str) -> bool:
        """``token`` is the current one (constant time)."""
        return bool(self._token_digest) and hmac.compare_digest(_digest(token), self._token_digest)

    def next_token(self) -> str:
        """The token a client reattached now gets (the next generation's)."""
        return self._tokens.issue(
            self._session_id, self.key_id, self._engine_token, self._issued + 1
        )

    @property
    def engine_token(self) -> str:
        """The engine's own token for this session (what a resume elsewhere sends it)."""
        return self._engine_token

    @property
    def token_generation(self) -> int:
        """The generation of the client's current token."""
        return self._issued

    def reattach(
        self,
        cursor: int,
        now: float,
        token: str,
        keep: Callable[[str], bool],
        resumed: Callable[[int], str],
    ) -> bool:
        """A client resumed: the replay is ``resumed(generation)``, then what it missed.

        Args:
            cursor: the last ``server_event_seq`` the client received.
            token: the token its next resume will need.
            keep: whether audio of this response is still worth replaying
                (False once it was cancelled).
            resumed: the ``session.resumed`` text for an attachment generation.

        Returns:
            False when what was written after ``cursor`` is no longer kept
            (the client must resync); nothing changes then.
        """
        journal = self.journal
        missed = journal.after(cursor, now, keep) if journal is not None else []
        if missed is None:
            return False
        self.release()
        self.generation += 1
        self._issued += 1
        self._token_digest = _digest(token)
        self.replay = deque([resumed(self.generation), *missed])
        self.replayed += len(missed)
        return True

    def take_report(self) -> tuple[int, bool]:
        """(events replayed, a grace ran out) since the last report."""
        replayed, self.replayed = self.replayed, 0
        expired, self.expired = self.expired, False
        return replayed, expired
