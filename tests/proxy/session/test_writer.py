"""ClientFrameWriter without sockets: bytes on the wire checked by an independent parser.

Every rule of the writer (frame encoding at the length boundaries, the write
bound with the core's drain, pong coalescing, close once and last) is
asserted on what a client would read, parsed with the ``websockets``
package's frame parser.
"""

from __future__ import annotations

import json

import pytest
from websockets.frames import Opcode

from proxy.core.buffer import Entry
from proxy.core.session_core import EndReason, SessionCore, SessionState
from proxy.session.frames import OP_TEXT, close_payload, frame_header
from proxy.session.writer import AiohttpWriterAdapter, ClientFrameWriter
from tests.proxy.core.helpers import (
    audio,
    make_settings,
    response_created,
    response_done,
    sized,
)
from tests.proxy.session.fakes import FakeProtocol, parse_frames

BOUND = 4096


class Harness:
    """A core and a writer on a fake transport, joined as the relay joins them."""

    def __init__(self, *, bound: int = BOUND) -> None:
        self.now = 10.0
        self.core = SessionCore(make_settings(), new_event_id=lambda: "event_proxy")
        self.protocol = FakeProtocol()
        self.writer = ClientFrameWriter(self.protocol, write_buffer_bytes=bound)

    @property
    def transport(self):  # type: ignore[no-untyped-def]
        assert self.protocol.transport is not None
        return self.protocol.transport

    def engine(self, *frames: str) -> None:
        for frame in frames:
            self.core.receive_upstream(frame, self.now)

    def pump(self) -> None:
        """Drain what the room allows and write it, as the relay does after a core call."""
        out = self.core.drain(self.now, self.writer.room())
        if out.to_client:
            assert self.writer.write(out.to_client), "a room was given: the transport is open"

    def texts(self) -> list[dict[str, object]]:
        return [
            json.loads(f.data) for f in parse_frames(self.transport.data) if f.opcode is Opcode.TEXT
        ]


# -- frame encoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_frame_header_at_length_boundaries_parses_independently(length: int) -> None:
    payload = bytes(i % 251 for i in range(length))
    data = frame_header(OP_TEXT, length) + payload + frame_header(OP_TEXT, 2) + b"ok"
    frames = parse_frames(data)
    assert [f.opcode for f in frames] == [Opcode.TEXT, Opcode.TEXT]
    assert frames[0].fin and frames[0].data == payload
    assert frames[1].data == b"ok"


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536])
def test_written_events_at_boundaries_arrive_whole_and_in_order(size: int) -> None:
    h = Harness(bound=1 << 20)
    first = sized({"type": "x.big"}, size) if size >= 20 else None
    frames_in = [first] if first is not None else []
    frames_in.append(json.dumps({"type": "x.after"}))
    h.engine(*frames_in)
    h.pump()
    written = parse_frames(h.transport.data)
    assert [f.data.decode() for f in written] == frames_in
    assert all(f.opcode is Opcode.TEXT and f.fin for f in written)


def test_non_ascii_text_is_framed_by_utf8_length() -> None:
    h = Harness()
    text = json.dumps(
        {"type": "response.output_text.delta", "delta": "héllo ☃ 🎙"}, ensure_ascii=False
    )
    h.engine(text)
    h.pump()
    assert [f.data.decode() for f in parse_frames(h.transport.data)] == [text]


def test_close_payload_keeps_utf8_whole_and_within_125_bytes() -> None:
    payload = close_payload(1008, ("é" * 100).encode())
    assert len(payload) <= 125
    payload[2:].decode("utf-8")  # a cut half character would raise
    assert int.from_bytes(payload[:2], "big") == 1008


# -- write bound -----------------------------------------------------------------------------------


def test_nothing_is_taken_while_the_transport_is_paused() -> None:
    h = Harness()
    h.protocol.pause()
    h.engine(response_created("r1"), audio("r1"))
    h.pump()
    assert h.transport.data == b""
    assert h.core.buffer.pending_events == 2, "events stay queued in the core, inside its budget"
    h.protocol.resume()
    h.pump()
    assert [t["type"] for t in h.texts()] == ["response.created", "response.output_audio.delta"]


def test_a_drain_never_takes_more_than_the_room() -> None:
    h = Harness(bound=1000)
    h.engine(*[sized({"type": "x.e", "i": i}, 300) for i in range(10)])
    writes = 0
    while h.core.buffer.pending_events:
        h.pump()
        writes += 1
    assert [len(c) for c in h.transport.calls] and max(map(len, h.transport.calls)) <= 1000
    assert writes == len(h.transport.calls) == 4, "three events per write, then one"
    assert [t["i"] for t in h.texts()] == list(range(10))


def test_what_the_transport_holds_counts_against_the_bound() -> None:
    h = Harness(bound=1000)
    h.transport.buffered = 900  # the client stopped reading: the transport holds 900 bytes
    h.engine(*[sized({"type": "x.e", "i": i}, 300) for i in range(5)])
    h.pump()
    assert [t["i"] for t in h.texts()] == [0], "one event past the room, then nothing"
    assert h.core.buffer.pending_events == 4, "the rest stays queued in the core, inside its budget"
    h.transport.buffered = 0  # drained
    while h.core.buffer.pending_events:
        h.pump()
    assert [t["i"] for t in h.texts()] == [0, 1, 2, 3, 4]


def test_one_event_larger_than_the_bound_is_written_alone() -> None:
    h = Harness(bound=1000)
    big = sized({"type": "x.big"}, 5000)
    h.engine(sized({"type": "x.small"}, 100), big)
    h.pump()
    h.pump()
    assert [len(c) for c in h.transport.calls][-1] >= 5000
    assert len(h.transport.calls) == 2, "the small event and the big one in separate writes"


def test_nothing_is_written_once_the_connection_is_gone() -> None:
    h = Harness()
    h.engine(response_created("r1"))
    h.transport.abort()
    assert h.writer.room() == 0, "no room on a lost connection: the core keeps its events"
    h.pump()
    assert h.core.pending_events == 1, "nothing taken: it waits for a resume or the end"
    entries: list[Entry] = list(h.core.drain(h.now, 1 << 20).to_client)
    assert not h.writer.write(entries), "a write after the loss writes nothing"
    assert h.transport.calls == []


def test_written_counts_frames_and_bytes() -> None:
    h = Harness()
    h.engine(response_created("r1"), response_done("r1"))
    h.pump()
    assert [t["type"] for t in h.texts()] == ["response.created", "response.done"]
    assert h.writer.frames_written == 2
    assert h.writer.bytes_written == len(response_created("r1")) + len(response_done("r1"))


# -- control frames ----------------------------------------------------------------------------------


def test_pong_echoes_the_ping_payload() -> None:
    h = Harness()
    h.writer.pong(b"abc")
    frames = parse_frames(h.transport.data)
    assert [(f.opcode, f.data) for f in frames] == [(Opcode.PONG, b"abc")]


def test_pongs_above_the_mark_are_coalesced_to_the_latest() -> None:
    h = Harness()
    h.protocol.pause()
    for i in range(1000):
        h.writer.pong(str(i).encode())
    assert h.transport.calls == [], "nothing is written above the mark"
    assert h.writer.pongs_coalesced == 999
    assert h.writer.has_pending, "the delivery task writes it once the transport drains"
    h.protocol.resume()
    h.pump()
    frames = parse_frames(h.transport.data)
    assert [(f.opcode, f.data) for f in frames] == [(Opcode.PONG, b"999")]


def test_a_pong_that_finds_the_connection_lost_leaves_no_room_for_events() -> None:
    """A room above 0 promises that a write right after it writes: the pending pong
    written first must not have lost the connection meanwhile."""
    h = Harness()
    h.protocol.pause()
    h.writer.pong(b"x")
    h.protocol.resume()
    h.engine(response_created("r1"))
    transport = h.transport
    send = transport.write

    def lost_on_send(data: bytes) -> None:
        send(data)
        transport.close()  # what asyncio does when the socket's send fails

    transport.write = lost_on_send  # type: ignore[method-assign]
    assert h.writer.room() == 0
    h.pump()
    assert h.core.pending_events == 1, "nothing taken that could not be written"


def test_ping_is_written_at_once_and_capped_at_125_bytes() -> None:
    h = Harness()
    h.writer.ping(b"x" * 500)
    frames = parse_frames(h.transport.data)
    assert frames[0].opcode is Opcode.PING and len(frames[0].data) == 125


def test_close_frame_goes_after_written_events_once_and_nothing_follows() -> None:
    h = Harness()
    h.engine(response_created("r1"))
    h.pump()
    assert h.writer.close(1008, b"overflow")
    assert not h.writer.close(1000), "a second close writes nothing"
    h.writer.ping()
    h.writer.pong(b"x")
    h.engine(response_done("r1"))
    h.pump()
    frames = parse_frames(h.transport.data)
    assert [f.opcode for f in frames] == [Opcode.TEXT, Opcode.CLOSE]
    assert frames[1].data == close_payload(1008, b"overflow")
    assert h.writer.close_code_sent == 1008


def test_close_on_a_lost_connection_records_no_close_code() -> None:
    h = Harness()
    h.transport.abort()
    assert not h.writer.close(1000)
    assert h.writer.close_code_sent is None


async def test_aiohttp_close_and_control_frames_route_through_the_writer() -> None:
    h = Harness()
    adapter = AiohttpWriterAdapter(h.writer)
    await adapter.send_frame(b"p", 0x9)
    await adapter.send_frame(b"q", 0xA)
    await adapter.close(1009, b"message too big")
    frames = parse_frames(h.transport.data)
    assert [f.opcode for f in frames] == [Opcode.PING, Opcode.PONG, Opcode.CLOSE]
    assert h.writer.close_code_sent == 1009
    assert adapter.transport is h.transport


def test_closure_notice_is_the_last_event_taken() -> None:
    h = Harness()
    h.engine(response_created("r1"))
    h.core.receive(EndReason.SHUTDOWN, h.now)
    h.pump()
    types = [t["type"] for t in h.texts()]
    assert types[-1] == "session.closed"
    assert h.core.state is SessionState.CLOSED


class _Doubling:
    """A front door whose client gets each event twice, tagged, and nothing of some."""

    def to_client(self, text: str) -> list[str]:
        body = json.loads(text)
        if body["type"] == "response.done":
            return []
        return [json.dumps({"event": body["type"], "n": n}) for n in (1, 2)]


def test_a_translator_decides_the_frames_each_event_becomes() -> None:
    h = Harness()
    h.writer = ClientFrameWriter(h.protocol, write_buffer_bytes=BOUND, translator=_Doubling())
    h.engine(response_created("r1"), response_done("r1"))
    h.pump()
    got = h.texts()
    assert got == [{"event": "response.created", "n": 1}, {"event": "response.created", "n": 2}]
    assert h.writer.frames_written == 2  # events written (the core's count), not frames
    assert h.writer.bytes_written == sum(len(json.dumps(g).encode()) for g in got)
