"""One session's resume state alone (proxy/core/resume_state.py; docs/design.md, Resume).

Whether the session resumes at all, the token (marked, rotated, checked in
constant time), held and its grace, and what a resume gets: the notice, then
what the journal kept after the cursor; or nothing at all on a gap.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.resume_state import ResumeState
from proxy.core.resume_token import TOKEN_MARK, ResumeTokens

GRACE = 30.0
BIG = 1 << 30
TOKENS = ResumeTokens(b"a test secret of 32 bytes, fixed")


def created(token: str | None = "engine-token", *, resume: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "session.created",
        "session": {"id": "duplex-1", "capabilities": {"supports_session_resume": resume}},
    }
    if token is not None:
        body["resume_token"] = token
    return body


def state_of(grace: float = GRACE, journal_bytes: int = BIG) -> ResumeState:
    state = ResumeState(grace, journal_bytes, 60.0, TOKENS)
    state.key_id = "key-1"
    return state


def offered(grace: float = GRACE, journal_bytes: int = BIG) -> ResumeState:
    state = state_of(grace, journal_bytes)
    state.on_session(created(), "duplex-1")
    return state


def first_token() -> str:
    """What the client got in ``session.created`` in place of the engine's token."""
    return TOKENS.issue("duplex-1", "key-1", "engine-token", 0)


def keep_all(_: str) -> bool:
    return True


def resumed(generation: int) -> str:
    return f"resumed {generation}"


class TestOffer:
    def test_resumable_when_the_engine_offers_it(self) -> None:
        state = offered()
        assert state.resumable
        assert state.journal is not None
        assert state.token_matches(first_token())
        assert not state.token_matches("engine-token"), (
            "the engine's own token is never the client's"
        )

    @pytest.mark.parametrize(
        ("body", "grace"),
        [
            (created(resume=False), GRACE),
            (created(None), GRACE),
            (created(""), GRACE),
            (created(), 0.0),  # holding is off
        ],
    )
    def test_not_resumable(self, body: dict[str, Any], grace: float) -> None:
        state = state_of(grace)
        state.on_session(body, "duplex-1")
        assert not state.resumable
        assert state.journal is None
        assert not state.token_matches("")

    def test_a_resumed_engine_session_keeps_its_offer(self) -> None:
        """The engine's ``session.resumed`` carries a token and no capabilities."""
        state = offered()
        token = state.on_session(
            {"type": "session.resumed", "resume_token": "engine-2"}, "duplex-1"
        )
        assert state.resumable
        assert token is not None and token.startswith("engine-2" + TOKEN_MARK)
        assert state.token_matches(token)


class TestToken:
    def test_the_sidecars_token_is_the_engines_marked_and_bound(self) -> None:
        state = offered()
        token = state.next_token()
        assert token.startswith("engine-token" + TOKEN_MARK)
        assert state.engine_token == "engine-token"
        parts = TOKENS.verify(token, "duplex-1", "key-1")
        assert parts is not None
        assert TOKENS.verify(token, "duplex-1", "key-2") is None, "bound to the key"

    def test_rotated_on_every_resume_and_the_spent_one_is_refused(self) -> None:
        state = offered()
        first = state.next_token()
        assert state.reattach(0, 0.0, first, keep_all, resumed)
        assert state.token_matches(first)
        assert not state.token_matches(first_token()), "the token of session.created is spent"
        second = state.next_token()
        assert second != first
        assert state.reattach(0, 0.0, second, keep_all, resumed)
        assert state.token_matches(second)
        assert not state.token_matches(first), "a spent token"


class TestHeld:
    def test_held_from_the_drop_until_the_grace_runs_out(self) -> None:
        state = offered()
        state.detach(10.0)
        assert state.held
        assert state.grace_at == 10.0 + GRACE
        assert not state.grace_over(10.0 + GRACE - 0.001)
        assert state.held
        assert state.grace_over(10.0 + GRACE)
        assert not state.held
        assert state.grace_at is None
        assert state.take_report() == (0, True)
        assert state.take_report() == (0, False), "reported once"

    def test_a_resume_ends_holding(self) -> None:
        state = offered()
        state.detach(0.0)
        assert state.reattach(0, 1.0, state.next_token(), keep_all, resumed)
        assert not state.held
        assert state.grace_at is None
        assert not state.grace_over(BIG)

    def test_release(self) -> None:
        state = offered()
        state.detach(0.0)
        state.release()
        assert not state.held
        assert state.grace_at is None


class TestReattach:
    def _journaled(self, n: int, journal_bytes: int = BIG) -> tuple[ResumeState, list[str]]:
        state = offered(journal_bytes=journal_bytes)
        assert state.journal is not None
        texts = [f'{{"type":"x","server_event_seq":{seq}}}' for seq in range(1, n + 1)]
        for seq, text in enumerate(texts, start=1):
            state.journal.record(seq, text, "r1" if seq % 2 else None, 0.0, BIG)
        return state, texts

    def test_the_notice_then_what_came_after_the_cursor(self) -> None:
        state, texts = self._journaled(6)
        state.detach(0.0)
        assert state.reattach(3, 1.0, state.next_token(), keep_all, resumed)
        assert list(state.replay) == ["resumed 1", *texts[3:]]
        assert state.generation == 1
        assert state.take_report() == (3, False)

    def test_audio_the_filter_refuses_is_not_replayed(self) -> None:
        state, texts = self._journaled(6)
        assert state.reattach(0, 1.0, state.next_token(), lambda rid: rid != "r1", resumed)
        assert list(state.replay) == ["resumed 1", texts[1], texts[3], texts[5]]

    def test_a_gap_changes_nothing(self) -> None:
        state, _ = self._journaled(6)
        assert state.journal is not None
        state.journal.ack(4)
        state.detach(0.0)
        token = state.next_token()
        assert not state.reattach(2, 1.0, token, keep_all, resumed)
        assert state.held, "still held for a resume from a later cursor"
        assert state.generation == 0
        assert not state.replay
        assert not state.token_matches(token)
        assert state.token_matches(first_token())
        assert state.take_report() == (0, False)

    def test_a_client_ack_trims_the_journal(self) -> None:
        state, _ = self._journaled(4)
        state.ack({"type": "session.event_ack", "server_event_seq": 3})
        assert state.journal is not None
        assert len(state.journal) == 1
        state.ack({"type": "session.event_ack", "server_event_seq": "4"})  # not a seq
        state.ack(None)
        assert len(state.journal) == 1
