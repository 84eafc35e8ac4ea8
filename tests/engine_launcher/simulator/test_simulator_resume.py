"""Resume in the simulator: detach, grace, the replay journal, tokens, takeover.

The journal and the session core are driven without sockets first (time is an
argument there); then simulator children over real loopback sockets, where a
client drops its TCP connection without a close and resumes on a new one, and
the tests assert what the clients read: ``session.resumed``, exactly the
events after the cursor, the errors and close codes, the slot a detached
session keeps. docs/engine-protocol.md, Resume; docs/design.md, Simulator.
"""

from __future__ import annotations

import json
from typing import Any, Final

import pytest

from engine_launcher.simulator.audio import make_audio_bank
from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig, parse_args
from engine_launcher.simulator.handlers import HANDLERS
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.replay_journal import (
    EngineJournal,
    JournalLimits,
    Replay,
    ReplayProblem,
)
from engine_launcher.simulator.session_resume import (
    EngineResumeRequest,
    Refusal,
    ResumeCredential,
    Resumed,
    ResyncRequired,
)
from tests.aiohttp_private import abort
from tests.conftest import DEADLINE, TIMEOUT_FACTOR, wait_until
from tests.integration.helpers import (
    AUDIO_DELTA,
    Client,
    SimulatorChild,
    connect,
    pcm16_b64,
    sim_metric,
)

Event = dict[str, Any]

APPEND: Final = {"type": "input_audio_buffer.append", "audio": pcm16_b64(100)}
ASK: Final = (APPEND, {"type": "input_audio_buffer.commit"}, {"type": "response.create"})
#: 10 chunks of 100 ms, one every 100 ms (x the timing factor): a reply lasts a second.
PACED: Final = (
    "--chunk-ms", "100", "--response-seconds", "1", "--realtime-factor", f"{TIMEOUT_FACTOR:g}",
)  # fmt: skip
FAST_REAP: Final = ("--reaper-interval", f"{0.05 * TIMEOUT_FACTOR:g}")


# ------------------------------------------------------------------- the journal


def test_journal_acks_age_and_gaps() -> None:
    journal = EngineJournal(JournalLimits(max_bytes=1000, ttl_s=10))
    for seq in range(1, 6):
        assert journal.fits(10, now=seq)
        journal.record(seq, f"frame{seq}", 10, now=seq)
    assert journal.replay_after(2, now=6) == Replay(["frame3", "frame4", "frame5"])
    assert journal.replay_after(5, now=6) == Replay([])
    assert journal.replay_after(6, now=6) is ReplayProblem.AHEAD
    # An ack drops everything up to it: a cursor from before it cannot be bridged.
    assert journal.acknowledge(3) and (journal.frames, journal.bytes) == (2, 20)
    assert journal.replay_after(2, now=6) is ReplayProblem.GAP
    assert journal.replay_after(3, now=6) == Replay(["frame4", "frame5"])
    assert not journal.acknowledge(9)  # never sent: nothing done
    # Age: frame 4 was recorded at t=4, so at t=14 it is gone.
    assert journal.replay_after(4, now=14.5) == Replay(["frame5"])
    assert journal.replay_after(3, now=14.5) is ReplayProblem.GAP


def test_journal_overflow_is_for_good_and_frees_what_it_held() -> None:
    journal = EngineJournal(JournalLimits(max_bytes=25, ttl_s=10))
    for seq in (1, 2):
        assert journal.fits(10, now=0)
        journal.record(seq, "x", 10, now=0)
    assert not journal.fits(10, now=0)
    assert journal.overflowed and journal.bytes == 0 and journal.frames == 0
    assert not journal.fits(1, now=0)  # even a small one: journaling stopped
    assert journal.replay_after(2, now=0) is ReplayProblem.GAP


def test_the_credential_keeps_a_digest_and_remembers_the_replaced_token() -> None:
    credential = ResumeCredential("first-token")
    held = [getattr(credential, name) for name in ResumeCredential.__slots__]
    assert all(isinstance(value, bytes | None) for value in held)  # no plaintext kept
    assert credential.verify("first-token") and not credential.verify("first-tokem")
    credential.rotate("second-token")
    assert credential.verify("second-token") and not credential.verify("first-token")
    assert credential.was_replaced("first-token") and not credential.was_replaced("other")
    assert not ResumeCredential.verify_unknown("first-token")


# ------------------------------------------------------------- the session core


def _core(**flags: Any) -> DuplexSession:
    config = SimulatorConfig(chunk_ms=100, response_seconds=1, **flags)
    return DuplexSession(config, make_audio_bank(100, 8000), SimulatorStats(), handlers=HANDLERS)


def _take(s: DuplexSession, now: float = 0.0) -> tuple[list[Event], list[CloseFrame]]:
    frames = s.events_to_send(now)
    closes = [f for f in frames if isinstance(f, CloseFrame)]
    return [json.loads(f) for f in frames if isinstance(f, str)], closes


def _send(s: DuplexSession, *events: Event) -> None:
    for event in events:
        s.receive_text(json.dumps(event))


def _opened(**flags: Any) -> tuple[DuplexSession, str]:
    """An open session and its resume token."""
    s = _core(**flags)
    _send(s, {"type": "session.update", "session": {}})
    (created, updated), _ = _take(s)
    assert "server_event_seq" not in created and updated["server_event_seq"] == 1
    return s, created["resume_token"]


def _seqs(events: list[Event]) -> list[int]:
    return [e["server_event_seq"] for e in events if "server_event_seq" in e]


def test_session_created_carries_the_credentials_only_when_resumable() -> None:
    s, token = _opened()
    assert len(token) >= 43 and s.attachment_generation == 1
    off = _core(session_resume=False)
    _send(off, {"type": "session.update", "session": {}})
    (created, _), _ = _take(off)
    assert "resume_token" not in created and "attachment_generation" not in created
    assert created["session"]["capabilities"]["supports_session_resume"] is False
    # Dropped, it ends at once: its session.closed goes to nobody, then the close.
    assert not off.detach(now=1.0)
    events, closes = _take(off)
    assert [e["type"] for e in events] == ["session.closed"] and closes == [
        CloseFrame(1000, "disconnect")
    ]


def test_resume_replays_exactly_what_follows_the_cursor_then_live_events() -> None:
    s, token = _opened()
    _send(s, *ASK)
    (rid,) = s.responses_to_start()
    for _ in range(3):
        s.produce_chunk(rid)
    sent, _ = _take(s, now=1.0)  # all of it went onto the socket...
    cursor = _seqs(sent)[len(sent) // 2]  # ...but the client read only up to here
    assert s.detach(now=2.0)
    for _ in range(3):
        s.produce_chunk(rid)  # still generating while detached
    unseen, _ = _take(s, now=3.0)  # journaled, sent to nobody
    s.produce_chunk(rid)  # queued, not taken yet when the resume comes
    outcome = s.resume(EngineResumeRequest(s.session_id, token, cursor), now=4.0)
    assert outcome == Resumed(replaced=None)
    resumed, *after = _take(s, now=4.0)[0]
    assert resumed["type"] == "session.resumed" and "server_event_seq" not in resumed
    assert resumed["session_id"] == s.session_id and resumed["attachment_generation"] == 2
    assert resumed["resume_token"] not in (token, "") and resumed["session"]["id"] == s.session_id
    last = _seqs(unseen)[-1]
    replay, live = after[: last - cursor], after[last - cursor :]
    assert replay == [e for e in sent + unseen if e.get("server_event_seq", 0) > cursor]
    # The replay, then what was queued, then live events: one run of seqs.
    s.produce_chunk(rid)
    live += _take(s, now=5.0)[0]
    assert _seqs(replay + live) == list(range(cursor + 1, last + 1 + len(live)))
    # The token rotated: the old one lost the race, a made-up one names nothing.
    old = s.resume(EngineResumeRequest(s.session_id, token, 0), now=5.0)
    assert isinstance(old, Refusal) and old.code == "session_resume_conflict"
    forged = s.resume(EngineResumeRequest(s.session_id, "forged", 0), now=5.0)
    assert forged == Refusal("session_resume_expired", "unknown or expired duplex session")
    # The new token takes the session over from the attached socket.
    again = s.resume(EngineResumeRequest(s.session_id, resumed["resume_token"], last), now=5.0)
    assert again == Resumed(replaced=2)


def test_an_ack_trims_the_journal_and_an_older_cursor_needs_a_resync() -> None:
    s, token = _opened()
    _send(s, *ASK)
    (rid,) = s.responses_to_start()
    s.produce_chunk(rid)
    seqs = _seqs(_take(s)[0])
    acked = seqs[-3]
    _send(s, {"type": "session.event_ack", "server_event_seq": acked})
    assert _take(s) == ([], [])  # no answer
    assert s.detach(now=1.0)
    behind = s.resume(EngineResumeRequest(s.session_id, token, acked - 1), now=1.0)
    assert behind == ResyncRequired(s.session_id, "journal_gap")
    assert isinstance(s.resume(EngineResumeRequest(s.session_id, token, acked), now=1.0), Resumed)
    # An ack of something never sent, or of nothing, is an error outside the journal.
    _send(s, {"type": "session.event_ack", "server_event_seq": 10_000, "event_id": "evt_a"})
    _send(s, {"type": "session.event_ack", "server_event_seq": -1})
    errors = [e for e in _take(s)[0] if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["invalid_event_ack"] * 2
    assert errors[0]["error"]["event_id"] == "evt_a"
    assert all("server_event_seq" not in e for e in errors)


def test_journal_frames_age_out_after_the_replay_ttl() -> None:
    s, token = _opened(replay_ttl=10.0)
    _send(s, *ASK)
    _take(s, now=0.0)
    assert s.detach(now=1.0)
    outcome = s.resume(EngineResumeRequest(s.session_id, token, 0), now=10.5)
    assert outcome == ResyncRequired(s.session_id, "journal_gap")


def test_journal_overflow_sends_resync_required_once_then_numbers_nothing() -> None:
    s, token = _opened(replay_max_bytes=4000)
    _send(s, *ASK)
    (rid,) = s.responses_to_start()
    for _ in range(10):
        s.produce_chunk(rid)  # 10 x ~2.2 KB of audio
    events, _ = _take(s)
    notices = [e for e in events if e["type"] == "session.resync_required"]
    assert notices == [
        {"type": "session.resync_required", "session_id": s.session_id,
         "reason": "journal_overflow", "event_id": notices[0]["event_id"]}
    ]  # fmt: skip
    at = events.index(notices[0])
    assert _seqs(events[:at]) == list(range(2, at + 2))  # 1 was session.updated
    assert _seqs(events[at:]) == [] and len(events) - at > 5
    assert s.detach(now=1.0)
    assert s.resume(EngineResumeRequest(s.session_id, token, at), now=1.0) == ResyncRequired(
        s.session_id, "journal_gap"
    )


def test_the_frame_that_overflowed_the_journal_is_sent_right_after_the_notice() -> None:
    """Overflowing the journal costs the frame its number, never the frame: the client
    gets the same frames as with room in the journal, the notice inserted just before
    the one that overflowed (docs/engine-protocol.md, Resume)."""

    def frames(replay_max_bytes: int) -> list[Event]:
        s, _ = _opened(replay_max_bytes=replay_max_bytes)
        _send(s, *ASK)
        (rid,) = s.responses_to_start()
        for _ in range(10):
            s.produce_chunk(rid)
        return _take(s)[0]

    roomy = frames(1 << 24)
    overflowed = frames(8000)  # past the first audio delta, before the response ends
    at = next(i for i, e in enumerate(overflowed) if e["type"] == "session.resync_required")
    assert 0 < at < len(overflowed) - 1
    assert "server_event_seq" not in overflowed[at + 1]
    rest = overflowed[:at] + overflowed[at + 1 :]
    assert [e["type"] for e in rest] == [e["type"] for e in roomy]
    assert _seqs(rest) == _seqs(roomy)[: len(_seqs(rest))], "numbered up to the overflow"


def test_grace_expiry_and_what_a_detached_session_ends_with() -> None:
    s, token = _opened(disconnect_grace=30.0)
    assert s.detach(now=100.0)
    assert not s.grace_over(129.9) and s.grace_over(130.0)
    late = s.resume(EngineResumeRequest(s.session_id, token, 1), now=130.0)
    assert late == Refusal("session_resume_expired", "unknown or expired duplex session")
    s.expire()
    events, closes = _take(s)
    assert [(e["type"], e["reason"]) for e in events] == [
        ("session.expired", "disconnect_grace_expired")
    ]
    assert events[0]["server_event_seq"] == 2 and closes == [
        CloseFrame(1000, "disconnect_grace_expired")
    ]


@pytest.mark.parametrize(
    ("version", "journaled"), [("0.30", True), ("0.31", False), ("0.32", False)]
)
def test_audio_of_a_cancelled_response_in_the_journal_per_release(
    version: str, journaled: bool
) -> None:
    s, token = _opened(engine_version=version, late_audio_chunks=2)
    _send(s, *ASK)
    (rid,) = s.responses_to_start()
    for _ in range(3):
        s.produce_chunk(rid)  # queued, not yet taken by the pump
    _send(s, {"type": "response.cancel"})
    assert s.detach(now=1.0)
    _take(s, now=1.0)
    outcome = s.resume(EngineResumeRequest(s.session_id, token, 1), now=2.0)
    assert isinstance(outcome, Resumed)
    replay = _take(s, now=2.0)[0][1:]
    audio = [e for e in replay if e["type"] == AUDIO_DELTA and e["response_id"] == rid]
    # 0.30 journals everything it produced, late audio included (3 + 2); 0.31+
    # removed the queued audio before numbering it, so none is journaled.
    assert len(audio) == (5 if journaled else 0)
    assert [e["response"]["status"] for e in replay if e["type"] == "response.done"] == [
        "cancelled"
    ]
    assert _seqs(replay) == list(range(2, 2 + len(_seqs(replay))))


def test_resume_flags_parse_and_validate() -> None:
    config = parse_args([])
    assert (config.session_resume, config.disconnect_grace, config.reaper_interval) == (
        True,
        30.0,
        5.0,
    )
    assert (config.replay_ttl, config.replay_max_bytes) == (60.0, 8 * 1024 * 1024)
    config = parse_args(["--no-session-resume", "--disconnect-grace", "0.5",
                         "--reaper-interval", "0.1", "--replay-ttl", "2",
                         "--replay-max-bytes", "1000"])  # fmt: skip
    assert not config.resumable and config.journal_limits == JournalLimits(max_bytes=1000, ttl_s=2)
    assert not SimulatorConfig(session_mode="realtime", engine_version="0.31").resumable
    for bad in (["--reaper-interval", "0"], ["--replay-ttl", "0"], ["--replay-max-bytes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# --------------------------------------------------------------- over sockets


async def _open(c: Client) -> Event:
    await c.send({"type": "session.update", "session": {}})
    created = await c.recv_until("session.created")
    await c.recv_until("session.updated")
    return created


async def _detached(sim: SimulatorChild, count: int) -> None:
    async def seen() -> bool:
        return await sim_metric(sim, "vllm_omni_sim_sessions_detached") == count

    await wait_until(seen, what=f"{count} detached session(s)")


def _resume_event(session_id: str, token: str, cursor: int) -> Event:
    return {
        "type": "session.resume",
        "session_id": session_id,
        "resume_token": token,
        "last_received_server_event_seq": cursor,
    }


async def test_a_dropped_socket_resumes_with_every_event_after_its_cursor(
    simulator: Any,
) -> None:
    sim = await simulator(*PACED)
    async with connect(sim.ws_url + "?autostart=0") as first:
        created = await _open(first)
        for event in ASK:
            await first.send(event)
        await first.recv_until(lambda e: e["type"] == AUDIO_DELTA)
        await first.recv_until(lambda e: e["type"] == AUDIO_DELTA)
        cursor = first.events[-1]["server_event_seq"]
        abort(first.ws)  # no close frame, no session.close
    await _detached(sim, 1)
    session_id, token = created["session"]["id"], created["resume_token"]
    async with connect(sim.ws_url + "?autostart=0") as second:
        await second.send(_resume_event(session_id, token, cursor))
        await second.recv_until("rate_limits.updated")  # the reply, to its end
        await second.send({"type": "session.heartbeat"})
        ack = await second.recv_until("session.heartbeat_ack")
        resumed, *rest = second.events
        assert await sim_metric(sim, "vllm_omni_sim_resumes_total") == 1
        assert await sim_metric(sim, "vllm_omni_sim_sessions_detached") == 0
    assert resumed["type"] == "session.resumed" and "server_event_seq" not in resumed
    assert resumed["attachment_generation"] == 2 and resumed["resume_token"] != token
    seqs = [e["server_event_seq"] for e in rest]
    assert seqs == list(range(cursor + 1, ack["server_event_seq"] + 1))  # none twice, none missing
    assert [e["type"] for e in rest].count("response.done") == 1


async def test_acked_events_are_gone_from_the_journal(simulator: Any) -> None:
    sim = await simulator(*PACED)
    async with connect(sim.ws_url + "?autostart=0") as first:
        created = await _open(first)
        for event in ASK:
            await first.send(event)
        await first.recv_until(lambda e: e["type"] == AUDIO_DELTA)
        acked = first.events[-1]["server_event_seq"]
        await first.send({"type": "session.event_ack", "server_event_seq": acked})
        await first.send({"type": "session.heartbeat"})  # the ack was read before it
        await first.recv_until("session.heartbeat_ack")
        abort(first.ws)
    await _detached(sim, 1)
    session_id, token = created["session"]["id"], created["resume_token"]
    async with connect(sim.ws_url + "?autostart=0") as behind:
        await behind.send(_resume_event(session_id, token, acked - 1))
        events = await behind.recv_until_closed()
    assert [(e["type"], e.get("reason")) for e in events] == [
        ("session.resync_required", "journal_gap")
    ]
    assert events[0]["session_id"] == session_id and behind.close_code == 1000
    # The refusal changed nothing: from the acked seq the replay is complete.
    async with connect(sim.ws_url + "?autostart=0") as second:
        await second.send(_resume_event(session_id, token, acked))
        await second.recv_until("rate_limits.updated")
    seqs = [e["server_event_seq"] for e in second.events[1:]]
    assert seqs == list(range(acked + 1, acked + 1 + len(seqs)))


async def test_journal_overflow_is_announced_once(simulator: Any) -> None:
    sim = await simulator("--realtime-factor", "0", "--chunk-ms", "100", "--response-seconds",
                          "3", "--replay-max-bytes", "20000")  # fmt: skip
    async with connect(sim.ws_url + "?autostart=0") as c:
        created = await _open(c)
        for event in ASK:
            await c.send(event)
        await c.recv_until("rate_limits.updated")
        await c.send({"type": "session.heartbeat"})
        await c.recv_until("session.heartbeat_ack")
        abort(c.ws)
    notices = [e for e in c.events if e["type"] == "session.resync_required"]
    assert [e["reason"] for e in notices] == ["journal_overflow"]
    at = c.events.index(notices[0])
    assert all("server_event_seq" not in e for e in c.events[at:])
    assert await sim_metric(sim, "vllm_omni_sim_journal_overflows_total") == 1
    await _detached(sim, 1)
    async with connect(sim.ws_url + "?autostart=0") as late:
        await late.send(_resume_event(created["session"]["id"], created["resume_token"], 1))
        events = await late.recv_until_closed()
    assert [(e["type"], e.get("reason")) for e in events] == [
        ("session.resync_required", "journal_gap")
    ]


async def test_a_detached_session_keeps_its_slot_until_the_grace_runs_out(
    simulator: Any,
) -> None:
    grace = 2.0 * TIMEOUT_FACTOR
    sim = await simulator("--max-sessions", "1", "--disconnect-grace", f"{grace:g}", *FAST_REAP)
    async with connect(sim.ws_url + "?autostart=0") as first:
        created = await _open(first)
        abort(first.ws)
    await _detached(sim, 1)
    async with connect(sim.ws_url + "?autostart=0") as refused:
        await refused.send({"type": "session.update", "session": {}})
        events = await refused.recv_until_closed()
    assert [e["error"]["code"] for e in events] == ["resource_exhausted"]
    assert await sim_metric(sim, "vllm_omni_sim_sessions_detached") == 1  # still in its grace

    async def expired() -> bool:
        return await sim_metric(sim, "vllm_omni_sim_sessions_expired_total") == 1

    await wait_until(expired, timeout=grace + DEADLINE, what="the grace to run out")
    async with connect(sim.ws_url + "?autostart=0") as admitted:
        assert (await _open(admitted))["type"] == "session.created"
        async with connect(sim.ws_url + "?autostart=0") as late:
            await late.send(_resume_event(created["session"]["id"], created["resume_token"], 1))
            events = await late.recv_until_closed()
    assert [e["error"]["code"] for e in events] == ["session_resume_expired"]


async def test_a_forged_token_and_an_unknown_id_are_answered_alike(simulator: Any) -> None:
    sim = await simulator()
    async with connect(sim.ws_url + "?autostart=0") as owner:
        created = await _open(owner)
        answers = []
        for session_id, token in (
            (created["session"]["id"], "forged-" + created["resume_token"][7:]),
            ("duplex-" + "0" * 32, created["resume_token"]),
        ):
            async with connect(sim.ws_url + "?autostart=0") as guess:
                await guess.send(_resume_event(session_id, token, 0))
                events = await guess.recv_until_closed()
            answers.append(([{**e, "event_id": None} for e in events], guess.close_code))
        # The owner's session did not notice.
        await owner.send({"type": "session.heartbeat"})
        assert (await owner.recv_until("session.heartbeat_ack"))["server_event_seq"] == 2
    assert answers[0] == answers[1]
    (error,), code = answers[0]
    assert error["error"]["code"] == "session_resume_expired" and code == 1000
    assert error["error"]["type"] == "invalid_request_error"
    assert "server_event_seq" not in error


async def test_a_second_socket_takes_the_session_over(simulator: Any) -> None:
    sim = await simulator()
    async with connect(sim.ws_url + "?autostart=0") as first:
        created = await _open(first)
        async with connect(sim.ws_url + "?autostart=0") as second:
            await second.send(_resume_event(created["session"]["id"], created["resume_token"], 1))
            resumed = await second.recv_until("session.resumed")
            replaced = await first.recv_until_closed()
            assert [e["type"] for e in replaced] == ["session.replaced"]
            assert replaced[0]["attachment_generation"] == 1
            assert replaced[0]["session_id"] == created["session"]["id"]
            assert first.close_code == 1000
            assert resumed["attachment_generation"] == 2
            await second.send({"type": "session.heartbeat"})
            ack = await second.recv_until("session.heartbeat_ack")
            assert ack["server_event_seq"] == 2
    assert await sim_metric(sim, "vllm_omni_sim_resumes_total") == 1


async def test_malformed_and_mid_session_resumes_are_refused(simulator: Any) -> None:
    sim = await simulator()
    async with connect(sim.ws_url + "?autostart=0") as c:
        await c.send({"type": "session.resume", "session_id": "duplex-x", "event_id": "evt_1"})
        events = await c.recv_until_closed()
    assert [e["error"]["code"] for e in events] == ["invalid_session_resume"]
    assert c.close_code == 1000
    async with connect(sim.ws_url + "?autostart=0") as c:
        created = await _open(c)
        await c.send(
            {**_resume_event(created["session"]["id"], created["resume_token"], 0),
             "event_id": "evt_2"}
        )  # fmt: skip
        error = await c.recv_until("error")
        assert error["error"]["code"] == "unsupported_session_resume"
        assert error["error"]["event_id"] == "evt_2" and "server_event_seq" not in error
        await c.send({"type": "session.heartbeat"})
        assert (await c.recv_until("session.heartbeat_ack"))["server_event_seq"] == 2


async def test_without_resume_support_a_drop_ends_the_session(simulator: Any) -> None:
    sim = await simulator("--no-session-resume", "--max-sessions", "1")
    async with connect(sim.ws_url + "?autostart=0") as first:
        created = await _open(first)
        assert "resume_token" not in created
        assert created["session"]["capabilities"]["supports_session_resume"] is False
        async with connect(sim.ws_url + "?autostart=0") as other:
            await other.send(_resume_event(created["session"]["id"], "any", 0))
            events = await other.recv_until_closed()
        assert [e["error"]["code"] for e in events] == ["unsupported_session_resume"]
        abort(first.ws)

    async def no_socket() -> bool:
        return await sim_metric(sim, "vllm_omni_sim_sessions_active") == 0

    await wait_until(no_socket, what="the dropped session to end")
    assert await sim_metric(sim, "vllm_omni_sim_sessions_detached") == 0
    async with connect(sim.ws_url + "?autostart=0") as next_one:
        assert (await _open(next_one))["type"] == "session.created"  # the slot is free
