"""``SessionOutput`` (proxy/core/session_output.py): the core's output half.

What a drain takes counts as written (the closure notice closes the session, and
the drain says how the client closes); timings start when a response is asked for
and end when its first audio is written; one deadline covers acks, pacing and
the resume grace; a resume's replay takes each room before what queued meanwhile
(docs/design.md, Resume).
"""

from __future__ import annotations

import dataclasses
import json

from proxy.core.lifecycle import EndReason, Fact, SessionState
from proxy.core.playback_state import AckMode, PlaybackSettings
from proxy.core.session_core import SessionCore
from tests.proxy.core.helpers import (
    SessionPair,
    audio,
    audio_payload,
    b_response_create,
    dumps,
    make_settings,
    response_created,
)


def _numbered(seq: int, body: dict[str, object]) -> str:
    return dumps({**body, "event_id": f"event_{seq}", "server_event_seq": seq})


def _audio(seq: int) -> str:
    body = {"type": "response.output_audio.delta", "response_id": "resp_1", "item_id": "item_1"}
    return _numbered(seq, {**body, "delta": audio_payload(400, seed=seq)})


def test_a_replay_longer_than_a_room_goes_out_whole_before_what_queued_meanwhile() -> None:
    """A resume's replay spans several rooms; an event that queued while the session
    was held goes after all of it, never into the room the replay did not fill
    (a client drops every seq at or below the last it saw, as DuplexClient does)."""
    pair = SessionPair(dataclasses.replace(make_settings(), client_resume_grace=30.0))
    created = {
        "type": "session.created",
        "session": {"id": "duplex-1", "capabilities": {"supports_session_resume": True}},
        "resume_token": "engine-token",
    }
    pair.upstream(_numbered(1, created), *(_audio(seq) for seq in range(2, 7)))
    assert [d.body.get("server_event_seq") for d in pair.deliver()] == [1, 2, 3, 4, 5, 6]
    assert pair.core.receive(Fact.CLIENT_DROPPED, pair.now)
    done = {"type": "response.output_audio.done", "response_id": "resp_1", "item_id": "item_1"}
    pair.upstream(_numbered(7, done))  # live, queued while held
    assert pair.resume(1) == (True, None)  # it saw only session.created
    written: list[dict[str, object]] = []
    room = len(_audio(2)) + 100  # one audio event per room, with space left over
    for _ in range(20):
        out = pair.core.drain(pair.now, room)
        if not out.to_client:
            break
        written += [json.loads(entry.event.text) for entry in out.to_client]
    assert written[0]["type"] == "session.resumed"
    assert [e["server_event_seq"] for e in written[1:]] == [2, 3, 4, 5, 6, 7]


def test_a_reattached_idle_session_has_output_waiting_with_nothing_queued() -> None:
    """``output_waiting`` (what the relay's delivery loop asks) counts the replay: an
    idle session's ``session.resumed`` must go out with nothing queued behind it."""
    pair = SessionPair(dataclasses.replace(make_settings(), client_resume_grace=30.0))
    created = {
        "type": "session.created",
        "session": {"id": "duplex-1", "capabilities": {"supports_session_resume": True}},
        "resume_token": "engine-token",
    }
    pair.upstream(_numbered(1, created))
    pair.deliver()
    assert pair.core.receive(Fact.CLIENT_DROPPED, pair.now)
    assert not pair.core.output_waiting
    assert pair.resume(1) == (True, None)
    assert pair.core.pending_events == 0 and pair.core.output_waiting
    assert [d.type for d in pair.deliver()] == ["session.resumed"]
    assert not pair.core.output_waiting


ROOM = 1 << 20


def _core(**settings: object) -> SessionCore:
    return SessionCore(
        dataclasses.replace(make_settings(), **settings), new_event_id=lambda: "event_proxy"
    )


def test_writing_the_closure_notice_closes_the_session() -> None:
    core = _core()
    core.receive(EndReason.SHUTDOWN, 0.0)
    assert core.state is SessionState.CLOSING
    drain = core.drain(0.0, ROOM)
    assert drain.to_client[-1].closure, "what a drain takes counts as written"
    assert core.state is SessionState.CLOSED
    assert drain.close == (1001, b"shutdown"), "and the client closes with the ending's frame"
    assert core.drain(0.0, ROOM).to_client == (), "the closure notice is written once"


def test_first_audio_is_timed_from_the_request_to_the_first_audio_written() -> None:
    core = _core()
    core.receive_client(b_response_create(), 1.0)
    core.receive_upstream(response_created("r1"), 1.2)
    core.receive_upstream(audio("r1", 400, seq=1), 1.3)
    report = core.drain(1.5, ROOM).report  # the drain that writes it reports it
    assert report is not None
    assert list(report.first_audio) == [0.5], "asked at 1.0, first audio written at 1.5"
    core.receive_upstream(audio("r1", 400, seq=2), 1.6)
    core.drain(1.6, ROOM)
    later = core.drain(1.8, 0).report
    assert later is None or not later.first_audio, "once per response"


def test_paced_audio_sets_the_one_deadline_and_the_timer_releases_it() -> None:
    core = _core(playback=PlaybackSettings(pacing=True, max_audio_lead=0.2, ack=AckMode.OFF))
    core.receive_upstream(response_created("r1"), 0.0)
    for seq in range(5):  # 0.1 s each
        core.receive_upstream(audio("r1", 6400, seq=seq), 0.0)
    drain = core.drain(0.0, ROOM)
    first = len(drain.to_client)
    deadline = drain.deadline
    assert deadline is not None and deadline > 0.0
    assert core.pending_events == 6 - first, "the rest waits for the client to play"
    core.receive(Fact.TIMER, deadline)
    assert core.drain(deadline, ROOM).to_client, "released at the deadline"


def test_without_pacing_acks_or_a_grace_there_is_no_deadline() -> None:
    core = _core()
    core.receive_upstream(response_created("r1"), 0.0)
    assert core.drain(0.0, ROOM).deadline is None
