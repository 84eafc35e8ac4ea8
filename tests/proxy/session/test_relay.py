"""The relay coordinator without sockets: fake client, fake engine link, manual clock.

Each test runs a real ``Relay`` (its three tasks, its writer and timers) on
fakes that record what a peer would observe, and drives time by hand, so the
keepalive, idle and close deadlines are checked at exact injected times and
the write-time re-check at an exact interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from websockets.frames import Opcode

from proxy.core.buffer import Entry
from proxy.core.drain import Drain
from proxy.core.events import UpstreamEvent
from proxy.core.lifecycle import SessionState
from proxy.core.playback import AckMode, PlaybackSettings
from proxy.core.resume_state import HandOver
from proxy.core.session_core import ACK_RIDE_WAIT, ClientDecision, OverflowPolicy, SessionSettings
from proxy.core.view import SessionView
from proxy.session.client_side import ClientSide
from proxy.session.limits import RelayLimits
from proxy.session.relay import Relay
from tests.conftest import DEADLINE, wait_until
from tests.proxy.core.helpers import (
    audio,
    b_response_cancel,
    make_settings,
    response_created,
    response_done,
    session_created,
    transcript_delta,
)
from tests.proxy.session.fakes import FakeClient, FakeProtocol, FakeUpstream, ManualScheduler

CLOSE_TIMEOUT = 5.0


class Observer:
    """Stands in for SessionObserver: counts what the relay reports."""

    def __init__(self) -> None:
        self.client_events = 0
        self.upstream_events = 0
        self.entries: list[Entry] = []
        self.ended = False
        self.tracer = None

    def watch(self, view: SessionView) -> None:
        pass

    def client_frame(self, size: int, decision: ClientDecision) -> None:
        self.client_events += 1

    def upstream_event(self, event: UpstreamEvent) -> None:
        self.upstream_events += 1

    def upstream_invalid(self, size: int) -> None:
        self.upstream_events += 1

    def delivered(self, entries: list[Entry], written_at: float) -> None:
        self.entries.extend(entries)

    def after_drain(self, out: Drain) -> None:
        pass

    def may_hold(self) -> bool:
        return True  # not draining

    def session_end(self) -> None:
        self.ended = True


class Session:
    """A Relay on fakes, running as a task."""

    def __init__(
        self,
        *,
        manual_soon: bool = False,
        core_settings: SessionSettings | None = None,
        answer_close: bool = True,
        **relay_kwargs: Any,
    ) -> None:
        #: End-of-tick writes, run by the test when ``manual_soon``.
        self.soon: list[Any] = []
        if manual_soon:
            relay_kwargs["call_soon"] = self.soon.append
        self.scheduler = ManualScheduler()
        self.protocol = FakeProtocol()
        self.client = FakeClient()
        self.upstream = FakeUpstream(answer_close=answer_close)
        self.observer = Observer()
        limit_values = {
            name: relay_kwargs.pop(name)
            for name in [f.name for f in dataclasses.fields(RelayLimits)]
            if name in relay_kwargs
        }
        limits = RelayLimits(
            close_timeout=CLOSE_TIMEOUT,
            drain_timeout=30.0,
            upstream_close_timeout=5.0,
            **limit_values,
        )
        side = ClientSide(
            self.client,
            self.protocol,
            self.upstream,  # type: ignore[arg-type]
            relay_kwargs.pop("client_push", None),
            write_buffer_bytes=limits.write_buffer_bytes,
        )
        self.relay = Relay(
            session_key="test",
            side=side,
            upstream=self.upstream,  # type: ignore[arg-type]
            settings=core_settings or make_settings(),
            observer=self.observer,  # type: ignore[arg-type]
            limits=limits,
            scheduler=self.scheduler,
            **relay_kwargs,
        )
        self.core = self.relay.core
        self.client.writer = self.relay.side.writer
        # A lost connection ends the client's reads, as aiohttp's reader does.
        self.transport.on_lost.append(self.client.lose)
        self.task: asyncio.Task[None] | None = None

    @property
    def transport(self):  # type: ignore[no-untyped-def]
        assert self.protocol.transport is not None
        return self.protocol.transport

    def texts(self) -> list[dict[str, Any]]:
        return [json.loads(f.data) for f in self.transport.frames() if f.opcode is Opcode.TEXT]

    def types(self) -> list[str]:
        return [t["type"] for t in self.texts()]

    async def settle(self) -> None:
        """Let every task run until nothing is ready (bounded)."""
        for _ in range(50):
            await asyncio.sleep(0)

    async def finished(self) -> None:
        assert self.task is not None
        async with asyncio.timeout(DEADLINE):
            await self.task


@pytest.fixture
async def session_factory() -> AsyncIterator[Any]:
    sessions: list[Session] = []

    async def start(**kwargs: Any) -> Session:
        s = Session(**kwargs)
        s.task = asyncio.create_task(s.relay.run())
        sessions.append(s)
        await s.settle()
        return s

    yield start
    for s in sessions:
        if s.task is not None and not s.task.done():
            s.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s.task


async def test_engine_events_reach_the_client_in_order_and_client_text_goes_upstream_verbatim(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.upstream.feed(session_created())
    s.upstream.feed(response_created("r1"))
    s.upstream.feed(audio("r1", seq=1))
    text = '{"type": "input_audio_buffer.append",  "audio": "AAAA"}'
    s.client.send(aiohttp.WSMsgType.TEXT, text)
    await wait_until(lambda: len(s.texts()) == 3, what="three events written")
    assert s.types() == ["session.created", "response.created", "response.output_audio.delta"]
    assert s.upstream.sent == [text]


async def test_a_cancel_before_the_end_of_tick_write_writes_no_audio_of_that_response(
    session_factory: Any,
) -> None:
    s = await session_factory(manual_soon=True)
    s.upstream.backlog.append(object())  # the engine has more frames parsed: batching
    s.upstream.feed(response_created("r1"))
    s.upstream.feed(audio("r1", seq=1))
    s.upstream.feed(audio("r1", seq=2))
    # The three events wait for the one end-of-tick write.
    await wait_until(lambda: s.upstream.inbox.empty(), what="engine frames read")
    await s.settle()
    assert s.core.buffer.pending_events == 3 and s.transport.calls == []
    s.client.send(aiohttp.WSMsgType.TEXT, b_response_cancel("r1"))
    await wait_until(lambda: bool(s.upstream.sent), what="the cancel forwarded")
    for flush in s.soon:  # the end of the tick comes after the cancel
        flush()
    await s.settle()
    assert s.types() == ["response.created"]
    assert b"output_audio.delta" not in s.transport.data


async def test_events_wait_in_the_core_while_the_client_does_not_read(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    s.upstream.feed(audio("r1", seq=1))
    await s.settle()
    assert s.transport.calls == []
    assert s.core.buffer.pending_events == 2
    s.protocol.resume()
    await wait_until(lambda: len(s.texts()) == 2, what="delivery after the drain")


async def test_more_than_one_room_queued_is_all_delivered_once_the_client_drains(
    session_factory: Any,
) -> None:
    # A drain takes one room's worth (client_write_buffer_bytes): the delivery
    # task goes on, room after room, while more is queued and the client reads.
    s = await session_factory(write_buffer_bytes=1000)
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    for seq in range(1, 11):
        s.upstream.feed(audio("r1", 400, seq=seq))
    await wait_until(lambda: s.core.buffer.pending_events == 11, what="events queued")
    s.protocol.resume()
    await wait_until(lambda: len(s.texts()) == 11, what="all eleven events delivered")
    assert len(s.transport.calls) >= 3, "several rooms, each one transport write"


async def test_a_burst_goes_out_in_one_write_at_the_end_of_the_tick(
    session_factory: Any,
) -> None:
    s = await session_factory(manual_soon=True)
    s.upstream.backlog.append(object())  # the engine has more frames parsed: batching
    s.upstream.feed(response_created("r1"))
    s.upstream.feed(audio("r1", seq=1))
    await wait_until(lambda: s.upstream.inbox.empty(), what="engine frames read")
    await s.settle()
    assert s.transport.calls == [], "nothing written while more engine frames wait"
    assert len(s.soon) == 1, "one end-of-tick write scheduled per burst"
    for flush in s.soon:
        flush()
    assert len(s.transport.calls) == 1, "the burst in one transport write"
    assert s.types() == ["response.created", "response.output_audio.delta"]


async def test_ping_flood_without_reading_gets_one_pong_after_the_drain(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    for i in range(500):
        s.client.send(aiohttp.WSMsgType.PING, str(i).encode())
    await wait_until(lambda: s.client.inbox.empty(), what="pings read")
    assert s.transport.calls == []
    s.protocol.resume()
    await wait_until(lambda: bool(s.transport.calls), what="the pong")
    pongs = [f.data for f in s.transport.frames() if f.opcode is Opcode.PONG]
    assert pongs == [b"499"]


async def test_keepalive_pings_then_drops_a_silent_client_at_two_intervals(
    session_factory: Any,
) -> None:
    s = await session_factory(heartbeat_interval=20.0)
    s.scheduler.advance(10.0)
    assert [f.opcode for f in s.transport.frames()] == [Opcode.PING]
    await s.settle()
    assert s.upstream.pings == 1
    s.upstream.feed(transcript_delta("r0"))  # the engine keeps talking
    await s.settle()
    s.scheduler.advance(29.999)
    assert not s.transport.aborted
    s.scheduler.advance(0.001)  # t = 40: the client was silent for two intervals
    assert s.transport.aborted
    await s.finished()


async def test_idle_client_gets_session_closed_and_close_1000_at_the_timeout(
    session_factory: Any,
) -> None:
    s = await session_factory(client_idle_timeout=30.0)
    s.scheduler.advance(29.9)
    await s.settle()
    assert s.types() == []
    s.scheduler.advance(0.1)
    await s.finished()
    closed = s.texts()[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "client_idle_timeout"
    assert s.relay.side.writer.close_code_sent == 1000
    frames = s.transport.frames()
    assert frames[-1].opcode is Opcode.CLOSE


async def test_close_deadline_aborts_a_client_that_never_reads_the_final_events(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    await s.settle()
    s.relay.shutdown()  # closing: session.closed queued behind response.created
    await s.settle()
    s.scheduler.advance(CLOSE_TIMEOUT - 0.001)
    await s.settle()
    assert not s.transport.aborted
    s.scheduler.advance(0.001)
    assert s.transport.aborted
    await s.finished()
    assert s.relay.side.writer.close_code_sent is None, "no close frame reached the client"


async def test_overflow_closes_with_1008_after_the_failure_sequence(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    for i in range(600):  # over the 512-event budget while the client does not read
        s.upstream.feed(audio("r1", seq=i))
    await wait_until(lambda: s.upstream.inbox.empty(), what="engine frames read")
    s.protocol.resume()
    await s.finished()
    types = s.types()
    assert types[-3:] == ["error", "response.done", "session.closed"]
    assert s.relay.side.writer.close_code_sent == 1008


async def test_a_shed_marked_inside_a_drain_sends_each_engine_command_once(
    session_factory: Any,
) -> None:
    """The registry marks the largest session from inside that session's drain (the
    observer's ``update_pending``): the engine gets what that drain carried, then the
    shed's ``response.cancel`` and ``session.close``, each once (docs/design.md,
    Process-wide output cap)."""
    s = await session_factory()
    s.protocol.pause()  # the client reads nothing: output pends
    relay = s.relay
    marked: list[Drain] = []

    def after_drain(out: Drain) -> None:
        if out.to_upstream and not marked:
            marked.append(out)
            relay.shed()  # what SessionRegistry._shed_largest does, mid-drain

    s.upstream.feed(response_created("r1"))
    for i in range(3):
        s.upstream.feed(audio("r1", seq=i))
    await wait_until(lambda: s.core.pending_events == 4, what="the engine's events pend")
    s.observer.after_drain = after_drain  # type: ignore[method-assign]
    append = '{"type":"input_audio_buffer.append","audio":"AAAA"}'
    s.client.send(aiohttp.WSMsgType.TEXT, append)  # its drain carries the append upstream
    await wait_until(lambda: len(s.upstream.sent) >= 3, what="the shed reached the engine")
    s.protocol.resume()
    await s.finished()
    assert marked, "the shed was marked inside a drain"
    sent = [json.loads(text)["type"] for text in s.upstream.sent]
    assert sent == ["input_audio_buffer.append", "response.cancel", "session.close"]
    assert s.types()[-3:] == ["error", "response.done", "session.closed"]
    assert relay.side.writer.close_code_sent == 1008


async def test_a_response_failed_by_an_engine_frame_is_cancelled_upstream_in_the_same_call(
    session_factory: Any,
) -> None:
    """What the core asks to send because of an engine frame is the link's answer to
    that frame: the engine hears ``response.cancel`` without any task having to run."""
    s = await session_factory(core_settings=make_settings(policy=OverflowPolicy.FAIL_RESPONSE))
    s.protocol.pause()
    assert list(s.relay.upstream_text(response_created("r1"))) == []
    answers = [list(s.relay.upstream_text(audio("r1", seq=i))) for i in range(600)]
    sent = [json.loads(text) for answer in answers for text in answer]
    assert sent == [{"type": "response.cancel", "response_id": "r1"}]
    assert answers.index(next(a for a in answers if a)) < 512, "at the overflowing frame"
    assert s.core.state.value == "open", "fail_response keeps the session"


async def test_engine_close_after_session_closed_ends_the_session_cleanly(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.upstream.feed(response_created("r1"))
    s.upstream.feed(response_done("r1"))
    s.upstream.feed('{"type":"session.closed","reason":"client_close"}')
    s.upstream.feed_close(1000)
    await s.finished()
    assert s.types() == ["response.created", "response.done", "session.closed"]
    assert s.relay.side.writer.close_code_sent == 1000
    assert s.observer.ended


async def test_pings_do_not_count_as_client_activity_for_the_idle_timeout(
    session_factory: Any,
) -> None:
    s = await session_factory(client_idle_timeout=30.0)
    for _ in range(2):  # pings at t = 10 and 20
        s.scheduler.advance(10.0)
        s.client.send(aiohttp.WSMsgType.PING, b"still here")
        await wait_until(lambda: s.client.inbox.empty(), what="ping read")
        await s.settle()
    s.scheduler.advance(10.0)  # t = 30: no event since t = 0
    await s.finished()
    assert s.texts()[-1]["reason"] == "client_idle_timeout"


async def test_engine_loss_gives_a_stalled_client_the_drain_timeout_not_the_close_timeout(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    await s.settle()
    s.relay.engine_unavailable()
    await s.settle()
    s.scheduler.advance(29.999)  # drain_timeout is 30 s, close_timeout 5 s
    await s.settle()
    assert not s.transport.aborted
    s.scheduler.advance(0.001)
    assert s.transport.aborted
    await s.finished()


async def test_input_the_engine_does_not_take_fails_the_session_with_1008(
    session_factory: Any,
) -> None:
    s = await session_factory(
        core_settings=dataclasses.replace(make_settings(), max_pending_input_bytes=1000)
    )
    s.upstream.pending_input = 990
    s.client.send(aiohttp.WSMsgType.TEXT, '{"type":"input_audio_buffer.append","audio":"AAAA"}')
    await s.finished()
    error = next(t for t in s.texts() if t["type"] == "error")
    assert error["error"]["code"] == "input_backpressure"
    assert s.relay.side.writer.close_code_sent == 1008
    assert s.upstream.sent == [] or all(
        '"input_audio_buffer.append"' not in t for t in s.upstream.sent
    )


async def test_pinging_without_reading_ends_in_the_overflow_sequence(session_factory: Any) -> None:
    s = await session_factory(core_settings=make_settings(max_events=64))
    s.protocol.pause()
    for i in range(200):
        s.client.send(aiohttp.WSMsgType.PING, str(i).encode())
    await wait_until(lambda: s.core.outcome is not None, what="the session closing")
    assert s.core.outcome is not None and s.core.outcome.value == "overflow"
    assert s.core.telemetry.overflows == 1
    s.scheduler.advance(CLOSE_TIMEOUT)  # the client never reads: dropped at the deadline
    await s.finished()
    assert s.transport.aborted
    assert s.transport.calls == [], "not one pong piled up for a client that does not read"


async def test_session_close_to_a_silent_engine_completes_at_upstream_close_timeout(
    session_factory: Any,
) -> None:
    s = await session_factory(answer_close=False)
    s.client.send(aiohttp.WSMsgType.TEXT, '{"type":"session.close"}')
    await wait_until(lambda: bool(s.upstream.sent), what="session.close forwarded")
    s.scheduler.advance(4.999)  # upstream_close_timeout = 5 s
    await s.settle()
    assert s.types() == []
    s.scheduler.advance(0.001)
    await s.finished()
    closed = s.texts()[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "upstream_timeout"
    assert s.relay.side.writer.close_code_sent == 1000


async def test_a_flooding_client_is_rate_limited_then_closed(session_factory: Any) -> None:
    settings = dataclasses.replace(
        make_settings(), max_client_frame_rate=10.0, client_frame_burst=20.0
    )
    s = await session_factory(core_settings=settings)
    text = '{"type":"input_audio_buffer.clear"}'
    for _ in range(100):
        s.client.send(aiohttp.WSMsgType.TEXT, text)
    await wait_until(lambda: s.client.inbox.empty(), what="frames read")
    await s.settle()
    assert len(s.upstream.sent) == 20, "the burst is forwarded, the rest dropped"
    assert [t["error"]["code"] for t in s.texts() if t["type"] == "error"] == [
        "client_rate_limited"
    ]
    for _ in range(4):  # the flood goes on for 2 s: closed with 1008
        s.scheduler.advance(0.5)
        for _ in range(50):
            s.client.send(aiohttp.WSMsgType.TEXT, text)
        await wait_until(
            lambda: s.client.inbox.empty() or s.core.outcome is not None, what="frames read"
        )
    await s.finished()
    assert s.texts()[-1]["reason"] == "client_rate_limited"
    assert s.relay.side.writer.close_code_sent == 1008
    # Cut off: its backlog is not read any more, and no close reply is awaited.
    assert s.transport.reading_paused and s.transport.closing and not s.transport.aborted
    assert s.client.close_calls == []


def _chunk(response_id: str, seq: int) -> str:
    """100 ms of pcm16 at 24 kHz."""
    return json.dumps(
        {
            "type": "response.output_audio.delta",
            "response_id": response_id,
            "item_id": f"item_{response_id}",
            "delta": "A" * 6400,
            "format": "pcm16",
            "sample_rate_hz": 24000,
            "seq": seq,
        }
    )


async def test_paced_audio_is_released_by_the_pace_timer_at_real_time(
    session_factory: Any,
) -> None:
    settings = dataclasses.replace(
        make_settings(), playback=PlaybackSettings(pacing=True, max_audio_lead=0.2)
    )
    s = await session_factory(core_settings=settings)
    s.upstream.feed(response_created("r1"))
    for i in range(10):
        s.upstream.feed(_chunk("r1", i))
    await wait_until(lambda: s.upstream.inbox.empty(), what="engine frames read")
    await s.settle()
    audio = [t for t in s.texts() if t["type"] == "response.output_audio.delta"]
    assert len(audio) == 3, "0.2 s of lead: the first chunk plus two"
    for second in (1, 2):
        s.scheduler.advance(0.1 - 0.001)
        await s.settle()
        assert len([t for t in s.texts() if "seq" in t]) == 2 + second
        s.scheduler.advance(0.001)
        await s.settle()
    assert [t["seq"] for t in s.texts() if "seq" in t] == list(range(5))


async def test_acks_go_upstream_on_the_playback_timer_and_answers_are_hidden(
    session_factory: Any,
) -> None:
    settings = dataclasses.replace(
        make_settings(), playback=PlaybackSettings(ack=AckMode.AUTO, ack_interval=0.25)
    )
    s = await session_factory(core_settings=settings)
    s.upstream.feed(response_created("r1"))
    for i in range(5):
        s.upstream.feed(_chunk("r1", i))
    await wait_until(lambda: len(s.texts()) == 6, what="audio delivered")
    s.scheduler.advance(0.25)
    await wait_until(lambda: len(s.upstream.sent) == 1, what="an ack")
    ack = json.loads(s.upstream.sent[0])
    assert (ack["type"], ack["played_ms"], ack["item_id"]) == ("playback.ack", 250, "item_r1")
    s.upstream.feed('{"type":"playback.acknowledged","event":{"played_ms":250}}')
    s.upstream.feed(transcript_delta("r1"))
    await wait_until(lambda: len(s.texts()) == 7, what="the transcript")
    assert "playback.acknowledged" not in s.types()


async def test_a_client_close_while_output_is_queued_ends_delivery_without_spinning(
    session_factory: Any,
) -> None:
    s = await session_factory()
    s.protocol.pause()
    s.upstream.feed(response_created("r1"))
    await wait_until(lambda: s.core.buffer.pending_events == 1, what="output queued")
    s.relay.side.writer.close(1000)  # aiohttp answering the client's own close frame
    s.protocol.resume()
    await s.finished()  # the delivery task stops: nothing can follow a close frame
    assert [f.opcode for f in s.transport.frames()] == [Opcode.CLOSE]


# -- playback acks: from the timer without a task switch, or riding along a client frame ----------

_APPEND = '{"type":"input_audio_buffer.append","audio":"AAAA"}'


def _acking(**playback: Any) -> SessionSettings:
    return dataclasses.replace(
        make_settings(),
        playback=PlaybackSettings(ack=AckMode.AUTO, ack_interval=0.25, **playback),
    )


def _sent_types(s: Session) -> list[str]:
    return [json.loads(t)["type"] for t in s.upstream.sent]


async def _play_one_second(s: Session) -> None:
    """The engine sends 1 s of audio; the client is written it at once (audio starts now)."""
    s.upstream.feed(response_created("r1"))
    for i in range(10):
        s.upstream.feed(_chunk("r1", i))
    await wait_until(lambda: len(s.texts()) == 11, what="audio delivered")


async def _client_sends(s: Session, text: str) -> None:
    s.client.send(aiohttp.WSMsgType.TEXT, text)
    await wait_until(lambda: s.client.inbox.empty(), what="the client frame read")
    await s.settle()


async def test_the_ack_timer_sends_the_ack_from_its_own_callback(
    session_factory: Any,
) -> None:
    s = await session_factory(core_settings=_acking())
    await _play_one_second(s)
    s.scheduler.advance(0.25)
    # No settle: the timer callback sent it, no task had to wake up for it.
    assert _sent_types(s) == ["playback.ack"]
    assert json.loads(s.upstream.sent[0])["played_ms"] == 250


async def test_a_due_ack_rides_along_right_behind_the_next_client_frame(
    session_factory: Any,
) -> None:
    s = await session_factory(core_settings=_acking())
    await _client_sends(s, _APPEND)  # the client streams: the ack timer is armed late
    await _play_one_second(s)
    s.scheduler.advance(0.25)  # an ack is due now; its timer waits another interval
    await s.settle()
    assert s.upstream.sent == [_APPEND]
    await _client_sends(s, _APPEND)
    assert _sent_types(s) == ["input_audio_buffer.append"] * 2 + ["playback.ack"]
    assert json.loads(s.upstream.sent[-1])["played_ms"] == 250
    s.scheduler.advance(0.2)  # until the next ack is due, the timer has nothing to send
    await s.settle()
    assert len(s.upstream.sent) == 3


async def test_while_the_client_streams_the_ack_timer_fires_an_interval_late(
    session_factory: Any,
) -> None:
    s = await session_factory(core_settings=_acking())
    await _client_sends(s, _APPEND)
    await _play_one_second(s)
    s.scheduler.advance(0.25)  # the exact due time: no ack yet, a ride may come
    assert s.upstream.sent == [_APPEND]
    wait = 0.25 * ACK_RIDE_WAIT
    s.scheduler.advance(wait - 0.001)
    assert s.upstream.sent == [_APPEND]
    s.scheduler.advance(0.001)  # none came: the timer sends it
    assert _sent_types(s) == ["input_audio_buffer.append", "playback.ack"]
    assert json.loads(s.upstream.sent[-1])["played_ms"] == round((0.25 + wait) * 1000)
    assert ACK_RIDE_WAIT >= 1.0, "a client streaming 250 ms chunks must always offer a ride"


async def test_no_ack_rides_along_before_an_interval_of_audio_has_played(
    session_factory: Any,
) -> None:
    s = await session_factory(core_settings=_acking())
    await _play_one_second(s)
    s.scheduler.advance(0.2)
    await _client_sends(s, _APPEND)
    assert s.upstream.sent == [_APPEND], "200 ms of audio is not an interval"
    s.scheduler.advance(0.05)  # the timer armed when the audio started: an interval later
    assert _sent_types(s) == ["input_audio_buffer.append", "playback.ack"]
    assert json.loads(s.upstream.sent[-1])["played_ms"] == 250


async def test_after_the_clients_own_ack_nothing_rides_along_in_auto_mode(
    session_factory: Any,
) -> None:
    s = await session_factory(core_settings=_acking())
    own = '{"type":"playback.ack","response_id":"r0","played_ms":0}'
    await _client_sends(s, own)
    await _play_one_second(s)
    for _ in range(4):
        s.scheduler.advance(0.3)
        await _client_sends(s, _APPEND)
    assert s.upstream.sent == [own] + [_APPEND] * 4


# -- client text frames pushed by the parser (compat.push_text) ---------------------------------


class Pusher:
    """Stands in for ``compat.push_text`` bound to the client: refuses to turn
    the push on while the client's queue still holds frames, like the real one."""

    def __init__(self) -> None:
        self.handler: Any = None
        self.client: FakeClient | None = None
        self.calls: list[bool] = []

    def __call__(self, handler: Any) -> bool:
        if handler is not None and self.client is not None and not self.client.inbox.empty():
            return False
        self.handler = handler
        self.calls.append(handler is not None)
        return True


async def _pushed_session(**kwargs: Any) -> tuple[Session, Pusher]:
    pusher = Pusher()
    s = Session(client_push=pusher, **kwargs)
    pusher.client = s.client
    return s, pusher


async def _end(s: Session) -> None:
    s.client.lose()
    await s.finished()


async def test_pushed_frames_start_only_after_the_queued_ones() -> None:
    s, pusher = await _pushed_session()
    s.client.send(aiohttp.WSMsgType.TEXT, '{"type":"x.first"}')  # queued before the relay runs
    s.task = asyncio.create_task(s.relay.run())
    await wait_until(lambda: pusher.handler is not None, what="the push turned on")
    assert [json.loads(t)["type"] for t in s.upstream.sent] == ["x.first"]
    pusher.handler('{"type":"x.second"}')
    # Handled at once, in the parser's callback: no task step in between.
    assert [json.loads(t)["type"] for t in s.upstream.sent] == ["x.first", "x.second"]
    await _end(s)
    assert pusher.handler is None, "off when the reader ends"


async def test_a_client_over_the_frame_rate_goes_back_to_the_queue() -> None:
    settings = dataclasses.replace(
        make_settings(), max_client_frame_rate=1.0, client_frame_burst=2.0
    )
    s, pusher = await _pushed_session(core_settings=settings)
    s.task = asyncio.create_task(s.relay.run())
    await wait_until(lambda: pusher.handler is not None, what="the push turned on")
    handler = pusher.handler
    for i in range(3):
        handler(json.dumps({"type": "x.e", "i": i}))
    assert len(s.upstream.sent) == 2, "the third frame is over the burst: dropped"
    assert pusher.calls[-1] is False, "its queue's flow control paces it from here"
    await _end(s)


async def test_a_full_engine_link_pauses_reading_the_client_until_it_drains() -> None:
    s, pusher = await _pushed_session()
    s.task = asyncio.create_task(s.relay.run())
    await wait_until(lambda: pusher.handler is not None, what="the push turned on")
    s.upstream.write_paused = True
    pusher.handler('{"type":"x.e"}')
    assert s.transport.reading_paused
    s.upstream.write_paused = False
    assert s.upstream.on_drained is not None
    s.upstream.on_drained()
    assert not s.transport.reading_paused
    await _end(s)


# -- a lost connection: the reader says whether the client dropped ----------------------------


async def _resumable_session(session_factory: Any) -> Any:
    """A session held on a drop (grace 30 s) whose ``session.created`` was delivered."""
    settings = dataclasses.replace(make_settings(), client_resume_grace=30.0)
    s = await session_factory(core_settings=settings)
    session = {"id": "duplex-abc", "capabilities": {"supports_session_resume": True}}
    created = {"type": "session.created", "event_id": "event_sc", "session": session}
    s.upstream.feed(json.dumps({**created, "resume_token": "engine-token"}))
    await wait_until(lambda: "session.created" in s.types(), what="session.created delivered")
    return s


async def test_a_drop_the_writer_sees_before_the_reader_is_still_held_for_a_resume(
    session_factory: Any,
) -> None:
    """Under load the writer may find the transport lost before the reader reads its
    end: the session waits for the reader's word and is held, not ended."""
    s = await _resumable_session(session_factory)
    s.transport.on_lost.remove(s.client.lose)  # the reader hears of it later
    s.transport.abort()
    s.upstream.feed(response_created("r1"))  # the writer finds the connection gone
    await s.settle()
    assert s.core.state is SessionState.OPEN, "ended on the writer's word"
    s.client.lose()
    await wait_until(lambda: s.relay.view.held, what="held for a resume")
    assert s.core.state is SessionState.OPEN
    assert s.core.resume.detached_at is not None


async def test_a_held_session_ends_when_its_grace_runs_out_without_playback_acks(
    session_factory: Any,
) -> None:
    """With playback acks off the grace is the only deadline: the relay arms it
    while held, and the session ends as a normal close when it runs out."""
    s = await _resumable_session(session_factory)
    assert not s.core.playback.acking
    s.transport.abort()  # a drop: no close frame
    await wait_until(lambda: s.relay.view.held, what="held for a resume")
    s.scheduler.advance(29.999)
    await s.settle()
    assert s.relay.view.held
    s.scheduler.advance(0.001)
    await wait_until(
        lambda: any('"session.close"' in frame for frame in s.upstream.sent),
        what="session.close upstream at the end of the grace",
    )
    assert not s.relay.view.held


async def test_a_cancelled_session_leaves_no_exception_set_for_the_code_after_it(
    session_factory: Any,
) -> None:
    """A relay cancelled mid-session (the task's top coroutine compiled in the
    compiled build) handles the cancellation without leaving it as the thread's
    current exception, where the next session's compiled code would raise it."""
    s = await session_factory()
    s.upstream.feed(response_created("r1"))
    await s.settle()
    assert s.task is not None
    s.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await s.task
    assert s.task.cancelled()
    assert sys.exc_info() == (None, None, None)


async def test_a_lost_connection_whose_reader_was_cut_off_ends_without_waiting(
    session_factory: Any,
) -> None:
    """A reader cut off for flooding reads nothing more, so it never reports the
    loss: the session ends at once, not after waiting for the reader."""
    s = await session_factory()
    s.relay.side.reader.cut()
    s.transport.abort()  # the reader is told, but reads nothing any more
    s.upstream.feed(response_created("r1"))  # the writer finds the connection gone
    await s.finished()  # the manual clock never runs out a wait
    assert s.observer.ended


@pytest.mark.parametrize("held", [True, False])
async def test_a_session_the_drain_hands_over_takes_no_resume(
    session_factory: Any, held: bool
) -> None:
    """Once the drain hands a session over (held, or live with a client that resumes
    whose old connection has not closed yet) the engine replays it to the client on
    another sidecar: a resume read here meanwhile is not attached, and the new
    connection is told nothing (proxy/edge/resume.py answers 1012, the token unspent)."""
    s = await _resumable_session(session_factory)
    s.core.client_resumes = True  # its URL had autostart=0
    if held:
        s.transport.abort()  # a drop: held
        await wait_until(lambda: s.relay.view.held, what="held for a resume")
    # SIGTERM (Sidecar._hand_over); in the same loop turn a connection whose first
    # message was read before the drain asks to resume (resume_held -> attach).
    assert s.relay.hand_over() is HandOver.NOW
    client, protocol = FakeClient(), FakeProtocol()
    side = ClientSide(client, protocol, s.upstream, None, write_buffer_bytes=1 << 20)  # type: ignore[arg-type]
    client.writer = side.writer
    assert not s.relay.attach(side, 0)
    await s.settle()
    assert protocol.transport is None or not protocol.transport.frames()
