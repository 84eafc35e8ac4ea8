"""Resume tokens bound to their session and key (proxy/core/resume_token.py;
docs/design.md, Resume): issued in place of the engine's in ``session.created``,
verified by any sidecar that shares the secret, and the only way a resume the
edge passes reaches the engine. Sans-I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.events import EventKind
from proxy.core.resume_token import TOKEN_MARK, ResumeTokens, TokenParts
from proxy.core.session_core import SessionCore, SessionState
from tests.proxy.core.helpers import dumps, make_settings

SECRET = b"fleet-secret-0123456789abcdef"
TOKENS = ResumeTokens(SECRET)
KEY, OTHER_KEY = "key-alpha", "key-beta"


class TestTokens:
    def test_a_token_verifies_for_its_session_and_key_only(self) -> None:
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 3)
        assert TOKENS.verify(token, "duplex-1", KEY) == TokenParts("engine-tok", 3)
        assert TOKENS.verify(token, "duplex-1", OTHER_KEY) is None
        assert TOKENS.verify(token, "duplex-2", KEY) is None
        assert ResumeTokens(b"another-secret-000000000").verify(token, "duplex-1", KEY) is None

    def test_the_engine_token_is_what_precedes_the_last_mark(self) -> None:
        token = TOKENS.issue("duplex-1", KEY, f"a{TOKEN_MARK}b", 0)
        assert TOKENS.verify(token, "duplex-1", KEY) == TokenParts(f"a{TOKEN_MARK}b", 0)

    def test_one_spelling_per_generation(self) -> None:
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 7)
        assert TOKENS.verify(token.replace("~7.", "~07."), "duplex-1", KEY) is None
        assert TOKENS.verify(token.replace("~7.", "~+7."), "duplex-1", KEY) is None

    def test_an_unmarked_token_is_never_passed_on(self) -> None:
        """The engine's own token, as a sidecar before this one handed it out."""
        assert TOKENS.verify("engine-tok", "duplex-1", KEY) is None
        assert TOKENS.verify("engine-tok~", "duplex-1", KEY) is None

    def test_the_engine_gets_its_own_token_and_never_the_sidecars_part(self) -> None:
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 2)
        resume = {"type": "session.resume", "session_id": "duplex-1", "resume_token": token}
        verified = TOKENS.engine_resume(resume, KEY)
        assert verified is not None and verified.parts == TokenParts("engine-tok", 2)
        assert json.loads(verified.text) == {**resume, "resume_token": "engine-tok"}
        assert TOKEN_MARK not in verified.text, "the sidecar's part never reaches the engine"

    def test_a_negative_cursor_reaches_the_engine_as_0(self) -> None:
        """The engine refuses a negative cursor (``invalid_session_resume``); the held
        path reads it as 0, and so does the engine."""
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 0)
        resume = {"type": "session.resume", "session_id": "duplex-1", "resume_token": token}
        verified = TOKENS.engine_resume({**resume, "last_received_server_event_seq": -5}, KEY)
        assert verified is not None
        assert json.loads(verified.text)["last_received_server_event_seq"] == 0

    @given(st.text(max_size=80))
    def test_nothing_else_verifies(self, token: str) -> None:
        assert TOKENS.verify(token, "duplex-1", KEY) is None


def _core(grace: float = 30.0, key_id: str = KEY) -> SessionCore:
    settings = dataclasses.replace(make_settings(), client_resume_grace=grace, resume_secret=SECRET)
    ids = itertools.count(1)
    return SessionCore(settings, new_event_id=lambda: f"event_{next(ids)}", key_id=key_id)


def _created(token: str = "engine-tok") -> str:
    return dumps(
        {
            "type": "session.created",
            "session": {"id": "duplex-1", "capabilities": {"supports_session_resume": True}},
            "attachment_generation": 1,
            "resume_token": token,
            "server_event_seq": 1,
        }
    )


def _written(core: SessionCore) -> list[dict[str, object]]:
    drain = core.drain(0.0, 1 << 20)
    return [json.loads(entry.event.text) for entry in drain.to_client]


class TestTheCore:
    def test_the_client_gets_a_bound_token_and_the_frame_otherwise_as_the_engine_wrote_it(
        self,
    ) -> None:
        core = _core()
        text = _created()
        event = core.receive_upstream(text, 0.0)
        assert event.kind is EventKind.SESSION_CREATED
        assert event.text is text, "the shell counts what the engine sent"
        (entry,) = core.drain(0.0, 1 << 20).to_client
        token = json.loads(entry.event.text)["resume_token"]
        assert isinstance(token, str) and token != "engine-tok"
        assert TOKENS.verify(token, "duplex-1", KEY) == TokenParts("engine-tok", 0)
        assert entry.event.text == text.replace('"engine-tok"', json.dumps(token))
        assert core.resume_token_matches(token), "the holder checks exactly this one"

    def test_even_a_session_not_held_here_hands_out_a_bound_token(self) -> None:
        """Without a grace nothing is held, but a resume elsewhere must still be this key's."""
        core = _core(grace=0.0)
        core.receive_upstream(_created(), 0.0)
        (created,) = _written(core)
        token = created["resume_token"]
        assert isinstance(token, str)
        assert TOKENS.verify(token, "duplex-1", KEY) is not None

    def test_a_resume_that_reaches_a_session_is_refused_even_with_this_keys_token(self) -> None:
        """The edge reads every message the engine would take as a resume before any
        session starts (proxy/edge/session_open.py): one that reaches the core came some
        way the edge did not check (after a ping, past a query the engine reads
        otherwise), so it is refused, never passed on with the engine's token."""
        core = _core(grace=0.0)
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 2)
        resume = {"type": "session.resume", "session_id": "duplex-1", "resume_token": token}
        decision = core.receive_client(dumps(resume), 0.0)
        assert not decision.forward
        drain = core.drain(0.0, 1 << 20)
        assert not drain.to_upstream
        assert drain.report is not None and drain.report.resume_refused, "resumes_total{refused}"
        (refusal,) = [json.loads(e.event.text) for e in drain.to_client]
        assert refusal["error"]["code"] == "session_resume_expired"
        assert core.state is not SessionState.OPEN, "the connection ends"
        assert core.drain(0.0, 0).report is None, "reported once"

    def test_a_resume_on_an_open_session_gets_the_engines_answer_and_the_session_goes_on(
        self,
    ) -> None:
        core = _core()
        core.receive_upstream(_created(), 0.0)
        _written(core)
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 0)
        resume = {"type": "session.resume", "event_id": "c1", "session_id": "duplex-1"}
        decision = core.receive_client(dumps({**resume, "resume_token": token}), 0.0)
        assert not decision.forward
        drain = core.drain(0.0, 1 << 20)
        assert not drain.to_upstream, "neither token reaches the engine"
        assert drain.report is None or not drain.report.resume_refused, "answered, not refused"
        (error,) = [json.loads(e.event.text) for e in drain.to_client]
        assert error["error"]["code"] == "unsupported_session_resume"
        assert error["error"]["event_id"] == "c1"
        assert core.state is SessionState.OPEN

    def test_a_resume_under_another_key_is_refused_and_the_engine_hears_nothing(self) -> None:
        core = _core(grace=0.0, key_id=OTHER_KEY)
        token = TOKENS.issue("duplex-1", KEY, "engine-tok", 0)
        resume = {"type": "session.resume", "session_id": "duplex-1", "resume_token": token}
        spelled = dumps(resume).replace('"session.resume"', '"session\\u002eresume"')
        decision = core.receive_client(spelled, 0.0)
        assert not decision.forward
        drain = core.drain(0.0, 1 << 20)
        assert not drain.to_upstream
        (refusal,) = [json.loads(e.event.text) for e in drain.to_client]
        assert refusal["type"] == "error"
        assert refusal["error"]["code"] == "session_resume_expired"
        assert core.state is not SessionState.OPEN, "the connection ends"
