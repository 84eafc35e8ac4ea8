"""A draining sidecar hands a session over (proxy/core/session_core.py, docs/design.md,
Start-up and shutdown).

Driven through the core's public API with ``SessionPair``: a session the engine
keeps for a resume, whose client resumes, is handed over at once; one with a
cancel whose terminal has not reached the client waits for it (the engine's
replay after the client's cursor would hold the cancel's late audio); a session
that cannot resume is not handed over. Handed over: nothing more reaches the
client, client frames still go upstream, no ``session.close`` ever does, and
the client's close is 1012.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from proxy.core.lifecycle import CLOSE_SERVICE_RESTART, Fact, Outcome, SessionPhase, SessionState
from proxy.core.resume_state import HandOver
from tests.proxy.core.helpers import (
    SessionPair,
    audio,
    b_audio_append,
    b_response_cancel,
    b_response_create,
    dumps,
    make_settings,
    response_created,
    response_done,
)


def _created(resumable: bool = True) -> str:
    session: dict[str, Any] = {"id": "duplex-abc"}
    if resumable:
        session["capabilities"] = {"supports_session_resume": True}
    return dumps(
        {
            "type": "session.created",
            "event_id": "event_sc",
            "session": session,
            "attachment_generation": 1,
            "resume_token": "engine-token",
        }
    )


def _pair(
    *, resumable: bool = True, client_resumes: bool = True, grace: float = 30.0
) -> SessionPair:
    p = SessionPair(settings=replace(make_settings(), client_resume_grace=grace))
    p.core.client_resumes = client_resumes
    p.upstream(_created(resumable))
    p.deliver()
    return p


def _handed_over(p: SessionPair) -> bool:
    """After a drain: a requested hand-over that may begin begins there."""
    p.collect_upstream()
    return p.core.phase is SessionPhase.HANDED_OVER


def _session_closes(p: SessionPair) -> list[dict[str, Any]]:
    return [f for f in p.upstream_sent if f.get("type") == "session.close"]


def test_a_resumable_session_is_handed_over_at_once() -> None:
    p = _pair()
    p.upstream(response_created("r1"), audio("r1", seq=0))
    assert p.core.request_hand_over() is HandOver.NOW
    assert _handed_over(p)
    assert _handed_over(p), "the next drain hands it over"
    # Nothing more for this client: the engine replays it on the next sidecar.
    p.upstream(audio("r1", seq=1), response_done("r1"))
    assert p.deliver() == []
    # The client's frames up to its close still reach the engine.
    assert p.client(b_audio_append()).forward
    assert p.forwarded == [b_audio_append()]
    p.core.receive(Fact.CLIENT_DROPPED, p.now)  # not held: it resumes elsewhere
    assert p.core.state is SessionState.CLOSED
    p.collect_upstream()
    assert _session_closes(p) == [], "the engine keeps the session for the resume"
    assert p.core.drain(p.now, 0).close == (CLOSE_SERVICE_RESTART, b"handed_over")
    assert p.core.outcome is Outcome.HANDED_OVER
    assert p.take_drops() == {}, "what the engine replays is not dropped"


def test_a_later_end_does_not_undo_the_hand_over() -> None:
    from proxy.core.lifecycle import EndReason

    p = _pair()
    p.core.request_hand_over()
    assert _handed_over(p), "the next drain hands it over"
    p.core.receive(EndReason.SHUTDOWN, p.now)  # the drain deadline passes meanwhile
    p.core.receive(Fact.ENGINE_LOST, p.now)
    p.core.receive(Fact.CLIENT_GONE, p.now)
    p.collect_upstream()
    assert p.core.drain(p.now, 0).close == (CLOSE_SERVICE_RESTART, b"handed_over")
    assert _session_closes(p) == []


@pytest.mark.parametrize("how", ["client_cancel", "engine_done_cancelled"])
def test_a_cancel_whose_terminal_has_not_reached_the_client_delays_the_hand_over(
    how: str,
) -> None:
    p = _pair()
    p.upstream(response_created("r1"), audio("r1", seq=0))
    p.deliver()
    if how == "client_cancel":
        p.client(b_response_cancel("r1"))
    else:
        p.upstream(audio("r1", seq=1))
    assert p.core.request_hand_over() in (HandOver.NOW, HandOver.CANCEL_SETTLING)
    if how == "engine_done_cancelled":
        # The engine cancels on its own: its response.done {cancelled} is queued, not written.
        p.upstream(response_done("r1", "cancelled"))
    assert p.core.request_hand_over() is HandOver.CANCEL_SETTLING
    assert not _handed_over(p)
    if how == "client_cancel":
        p.upstream(
            audio("r1", seq=2), response_done("r1", "cancelled")
        )  # late audio, then the done
    done = p.deliver()
    assert [d.type for d in done][-1] == "response.done"
    assert not any(d.is_audio for d in done), "late audio filtered as always"
    assert _handed_over(p), "the client has the cancel's terminal: hand over now"


def test_a_cancel_racing_a_create_delays_the_hand_over_until_the_response_exists() -> None:
    p = _pair()
    p.client(b_response_create())
    p.client(b_response_cancel())  # no response yet: the one asked for is born cancelled
    assert p.core.request_hand_over() is HandOver.CANCEL_SETTLING
    p.upstream(response_created("r1"), response_done("r1", "cancelled"))
    p.deliver()
    assert _handed_over(p)


@pytest.mark.parametrize(
    ("kwargs", "wait"),
    [
        ({"resumable": False}, HandOver.NOT_RESUMABLE),
        ({"grace": 0.0}, HandOver.NOT_RESUMABLE),
        ({"client_resumes": False}, HandOver.CLIENT_CANNOT_RESUME),
    ],
)
def test_a_session_that_cannot_resume_is_not_handed_over(
    kwargs: dict[str, Any], wait: HandOver
) -> None:
    p = _pair(**kwargs)
    assert p.core.request_hand_over() is wait
    assert not p.core.hand_over_requested and not _handed_over(p)


def test_a_held_session_is_handed_over_and_its_grace_stops() -> None:
    p = _pair(client_resumes=False)  # it dropped before it could say; held all the same
    assert p.core.receive(Fact.CLIENT_DROPPED, p.now), "held for a resume"
    assert p.core.request_hand_over() is HandOver.NOW
    assert _handed_over(p), "the next drain hands it over"
    assert p.deadline() is None, "no grace of its own: the engine's runs"


def test_a_client_that_resumed_here_resumes_after_a_hand_over_too() -> None:
    p = _pair(client_resumes=False)
    p.core.receive(Fact.CLIENT_DROPPED, p.now)
    assert p.resume(0) == (True, None)
    assert p.core.request_hand_over() is HandOver.NOW


def test_a_closing_session_is_not_handed_over() -> None:
    p = _pair()
    p.client('{"type":"session.close"}')
    assert p.core.request_hand_over() is HandOver.ENDING


def test_a_session_still_opening_is_handed_over_once_its_token_reached_the_client() -> None:
    # Its handshake raced the drain: the engine has not answered yet.
    p = SessionPair(settings=replace(make_settings(), client_resume_grace=30.0))
    p.core.client_resumes = True
    assert p.core.request_hand_over() is HandOver.OPENING
    assert p.core.hand_over_requested and not _handed_over(p)
    p.upstream(_created())
    # Queued, not written: a client without the engine's token could not resume.
    assert not _handed_over(p)
    assert [d.type for d in p.deliver()] == ["session.created"]
    assert _handed_over(p)


def test_a_new_engine_token_must_reach_the_client_before_the_hand_over() -> None:
    p = _pair()
    # A resume passed to the engine rotates its token: session.resumed carries the new one.
    p.upstream(
        _created()
        .replace("session.created", "session.resumed")
        .replace("engine-token", "engine-token-2")
    )
    assert p.core.request_hand_over() is HandOver.OPENING
    assert not _handed_over(p)
    p.deliver()
    assert _handed_over(p)


def test_a_session_the_engine_opened_without_resume_drains() -> None:
    p = SessionPair(settings=replace(make_settings(), client_resume_grace=30.0))
    p.core.client_resumes = True
    p.core.request_hand_over()
    p.upstream(_created(resumable=False))
    p.deliver()
    assert p.core.request_hand_over() is HandOver.NOT_RESUMABLE
    assert not _handed_over(p)
