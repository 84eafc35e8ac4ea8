"""``ClientSide`` (proxy/session/client_side.py): one client connection of a session.

A connection that resumes a session carries the totals of the ones before it; a
superseded one is told ``session.replaced`` and dropped; closing writes the close
frame after what was written; waiting for the reader's verdict is bounded.
"""

from __future__ import annotations

import asyncio

from websockets.frames import Opcode

from proxy.core.buffer import Entry
from proxy.core.events import classify_upstream
from proxy.session.client_side import ClientSide
from tests.conftest import MS
from tests.proxy.session.fakes import FakeClient, FakeProtocol, FakeUpstream, ManualScheduler

NOTICE = '{"type":"session.replaced","session_id":"d","attachment_generation":1}'


def _side() -> tuple[ClientSide, FakeClient, FakeProtocol]:
    client, protocol = FakeClient(), FakeProtocol()
    side = ClientSide(client, protocol, FakeUpstream(), write_buffer_bytes=1 << 20)  # type: ignore[arg-type]
    client.writer = side.writer
    return side, client, protocol


def _entry(text: str) -> Entry:
    return Entry(classify_upstream(text), 0.0)


def test_a_resuming_connection_carries_the_totals_of_the_earlier_ones() -> None:
    first, _, _ = _side()
    first.writer.write([_entry('{"type":"a"}'), _entry('{"type":"b"}')])
    second, _, _ = _side()
    second.follow(first)
    second.writer.write([_entry('{"type":"c"}')])
    assert second.attachment == 2
    assert second.frames_written == 3
    assert second.bytes_written == 3 * len('{"type":"a"}')
    third, _, _ = _side()
    third.follow(second)
    assert (third.attachment, third.frames_written) == (3, 3)


def test_a_superseded_connection_is_told_and_dropped() -> None:
    side, _, protocol = _side()
    side.supersede(NOTICE)
    assert side.replaced
    transport = protocol.transport
    assert transport is not None and transport.closing
    frames = transport.frames()
    assert [f.opcode for f in frames] == [Opcode.TEXT, Opcode.CLOSE]
    assert frames[0].data.decode() == NOTICE
    assert frames[1].data[:2] == (1000).to_bytes(2, "big")


async def test_close_writes_the_close_frame_after_what_was_written() -> None:
    side, client, protocol = _side()
    side.writer.write([_entry('{"type":"last"}')])
    await side.close(1001, b"shutdown", 10_000 * MS)
    assert client.close_calls == [1001]
    transport = protocol.transport
    assert transport is not None
    assert [f.opcode for f in transport.frames()] == [Opcode.TEXT, Opcode.CLOSE]


async def test_the_readers_verdict_is_not_waited_for_when_the_writer_still_writes() -> None:
    side, _, _ = _side()
    await asyncio.wait_for(side.reader_verdict(ManualScheduler(), 10.0), timeout=10_000 * MS)


async def test_the_readers_verdict_is_waited_for_at_most_the_timeout() -> None:
    side, _, protocol = _side()
    transport = protocol.transport
    assert transport is not None
    transport.close()  # the writer finds the connection lost
    protocol.transport = None
    assert side.writer.gone
    scheduler = ManualScheduler()
    waiting = asyncio.create_task(side.reader_verdict(scheduler, 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    scheduler.advance(5.0)
    await asyncio.wait_for(waiting, timeout=10_000 * MS)


async def test_the_readers_verdict_ends_the_wait_when_it_comes() -> None:
    side, _, protocol = _side()
    protocol.transport = None
    scheduler = ManualScheduler()
    waiting = asyncio.create_task(side.reader_verdict(scheduler, 5.0))
    await asyncio.sleep(0)
    side.ended.set()
    await asyncio.wait_for(waiting, timeout=10_000 * MS)
    assert scheduler.pending() == [], "the timer was cancelled"
