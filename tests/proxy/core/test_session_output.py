"""The session's output drain (proxy/core/session_output.py): what a resume's replay
takes of each room, and in what order (docs/design.md, Resume)."""

from __future__ import annotations

import dataclasses
import json

from tests.proxy.core.helpers import SessionPair, audio_payload, dumps, make_settings


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
    assert pair.core.client_ended(pair.now, dropped=True)
    done = {"type": "response.output_audio.done", "response_id": "resp_1", "item_id": "item_1"}
    pair.upstream(_numbered(7, done))  # live, queued while held
    token = pair.core.next_resume_token()
    assert pair.core.reattach(1, pair.now, token=token)  # it saw only session.created
    written: list[dict[str, object]] = []
    room = len(_audio(2)) + 100  # one audio event per room, with space left over
    for _ in range(20):
        out = pair.core.drain(pair.now, room)
        if not out.to_client:
            break
        written += [json.loads(entry.event.text) for entry in out.to_client]
        pair.core.written(out.to_client, pair.now)
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
    assert pair.core.client_ended(pair.now, dropped=True)
    assert not pair.core.output_waiting
    assert pair.core.reattach(1, pair.now, token=pair.core.next_resume_token())
    assert pair.core.pending_events == 0 and pair.core.output_waiting
    assert [d.type for d in pair.deliver()] == ["session.resumed"]
    assert not pair.core.output_waiting
