"""The engine link (proxy/session/upstream_link/__init__.py) against a real loopback engine.

The engine here is the ``websockets`` package's sans-I/O server protocol over
a plain asyncio socket: it parses what we send as strictly as a conforming
server must (masking, UTF-8, control frames, close codes), lets the test
write exact frames (fragments, invalid UTF-8, pings, any close code, a frame
together with the 101 response) and keeps the raw bytes it received, so the
frame headers we wrote can be checked too. Both links are run through the
cases they share (``upstream_client`` = picows, the default, and aiohttp);
the picows link's own behaviour (sends without waiting, batched per loop
tick) has its own tests. The end of the file runs whole sessions through a
real sidecar with each ``upstream_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from websockets.datastructures import Headers
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.server import ServerProtocol

from proxy.session.upstream_link import (
    PicowsUpstreamLink,
    UpstreamConnectError,
    UpstreamLink,
    connect_upstream,
)
from tests.conftest import DEADLINE, MS, free_port, wait_until
from tests.integration.helpers import (
    AUDIO_DELTA,
    assert_relayed_as_the_engine_wrote,
    clean_env,
    connect,
    request_response,
    rid_of,
    run_cli,
)
from tests.proxy.session.test_frames import parse_masked

MIB = 1024 * 1024
#: The links' bound on one engine message in these tests.
MAX_MESSAGE = 64 * 1024
CLIENTS = ("picows", "aiohttp")
#: Loopback round trips take milliseconds: a broken link fails in 2 s, not DEADLINE.
QUICK = 2_000 * MS


async def soon(predicate: Callable[[], bool], *, what: str) -> None:
    await wait_until(predicate, timeout=QUICK, what=what)


# -- the engine ---------------------------------------------------------------------------------


@dataclass
class RawFrame:
    """One frame as it arrived on the wire: header facts and the unmasked payload."""

    opcode: int
    fin: bool
    masked: bool
    length_form: int  # 7, 16 or 64: how the payload length was written
    mask: bytes
    payload: bytes


def parse_wire(data: bytes) -> list[RawFrame]:
    """Walk client-to-server frames by hand (header facts), each checked again by
    ``websockets``' own parser with ``mask=True`` (it rejects an unmasked frame)."""
    frames: list[RawFrame] = []
    at = 0
    while at < len(data):
        first, second = data[at], data[at + 1]
        length = second & 0x7F
        header = 2
        form = 7
        if length == 126:
            (length,) = struct.unpack_from("!H", data, at + 2)
            header, form = 4, 16
        elif length == 127:
            (length,) = struct.unpack_from("!Q", data, at + 2)
            header, form = 10, 64
        masked = bool(second & 0x80)
        mask = data[at + header : at + header + 4] if masked else b""
        end = at + header + (4 if masked else 0) + length
        assert end <= len(data), "truncated frame on the wire"
        parsed = parse_masked(data[at:end])
        frames.append(RawFrame(first & 0x0F, bool(first & 0x80), masked, form, mask, parsed.data))
        at = end
    return frames


@dataclass
class EngineConn:
    """One engine-side connection: what arrived, and frames to send."""

    writer: asyncio.StreamWriter
    protocol: ServerProtocol
    headers: Headers | None = None
    raw: bytearray = field(default_factory=bytearray)
    frames: list[Frame] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set: the engine reads its socket; cleared: it stops reading (the kernel fills up).
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    #: True: what the protocol has to send (a close reply too) waits for release().
    holding: bool = False

    def flush(self) -> None:
        if self.holding:
            return
        chunks = self.protocol.data_to_send()
        # One write for all of it: frames sent together arrive in one read.
        self.writer.write(b"".join(chunks))
        if chunks and not chunks[-1]:  # the protocol's end of stream: the server closes TCP
            self.writer.close()

    def release(self) -> None:
        self.holding = False
        self.flush()

    # what the engine sends
    def text(self, data: str | bytes, *, fin: bool = True) -> None:
        self.protocol.send_text(data.encode() if isinstance(data, str) else data, fin=fin)
        self.flush()

    def continuation(self, data: bytes, *, fin: bool) -> None:
        self.protocol.send_continuation(data, fin=fin)
        self.flush()

    def binary(self, data: bytes) -> None:
        self.protocol.send_binary(data)
        self.flush()

    def ping(self, data: bytes) -> None:
        self.protocol.send_ping(data)
        self.flush()

    def close(self, code: int, reason: str = "") -> None:
        self.protocol.send_close(code, reason)
        self.flush()

    def raw_frame(self, opcode: int, payload: bytes, *, fin: bool = True) -> None:
        """A server frame written by hand (what the protocol object refuses to send)."""
        assert len(payload) < 126
        self.writer.write(bytes(((0x80 if fin else 0) | opcode, len(payload))) + payload)

    def drop(self) -> None:
        """Vanish: reset the connection, no close frame."""
        self.writer.transport.abort()

    # what the engine observed
    @property
    def wire(self) -> list[RawFrame]:
        """Every frame we sent, parsed from the raw bytes after the handshake."""
        start = bytes(self.raw).index(b"\r\n\r\n") + 4
        return parse_wire(bytes(self.raw[start:]))

    def texts(self) -> list[str]:
        return [f.data.decode() for f in self.frames if f.opcode is Opcode.TEXT]

    def of(self, opcode: Opcode) -> list[Frame]:
        return [f for f in self.frames if f.opcode is opcode]

    @property
    def close_code_received(self) -> int | None:
        rcvd = self.protocol.close_rcvd
        return None if rcvd is None else rcvd.code


class Engine:
    """A loopback WebSocket engine the test drives frame by frame.

    Args:
        on_connect: called with the new connection right after the 101 is
            queued; what it sends goes out in the same write as the 101.
        reject: answer the handshake with this HTTP status instead.
        receive_buffer: SO_RCVBUF of accepted sockets (None: the kernel's).
    """

    def __init__(
        self,
        *,
        on_connect: Callable[[EngineConn], None] | None = None,
        reject: int | None = None,
        receive_buffer: int | None = None,
    ) -> None:
        self.on_connect = on_connect
        self.reject = reject
        self.receive_buffer = receive_buffer
        self.conns: list[EngineConn] = []
        #: Every connection's serving task (health probes and refused handshakes too).
        self._serving: dict[asyncio.Task[None], EngineConn] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime?model=m"

    async def start(self) -> Engine:
        sock = socket.socket()
        if self.receive_buffer is not None:  # before listen(): accepted sockets inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=sock)
        self.port = int(sock.getsockname()[1])
        return self

    async def aclose(self) -> None:
        for conn in self._serving.values():
            conn.drop()
            conn.reading.set()  # a paused reader sees the reset too
        if self._serving:  # each serving task ends on its reset connection
            await asyncio.wait(list(self._serving), timeout=QUICK)
        if self._server is not None:
            self._server.close()
            async with asyncio.timeout(DEADLINE):
                await self._server.wait_closed()

    async def connection(self) -> EngineConn:
        await soon(lambda: bool(self.conns), what="the engine's connection")
        return self.conns[-1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = EngineConn(writer, ServerProtocol(max_size=None))
        conn.reading.set()
        protocol = conn.protocol
        task = asyncio.current_task()
        assert task is not None
        self._serving[task] = conn
        try:
            while True:
                await conn.reading.wait()
                data = await reader.read(256 * 1024)
                conn.raw += data
                if data:
                    protocol.receive_data(data)
                else:
                    protocol.receive_eof()
                for event in protocol.events_received():
                    if isinstance(event, Request):
                        self._handshake(conn, event)
                    else:
                        conn.frames.append(event)
                        if event.opcode is Opcode.TEXT and b'"session.close"' in event.data:
                            # Like the engine: session.closed, then close 1000.
                            conn.text(json.dumps({"type": "session.closed"}))
                            conn.close(1000)
                conn.flush()
                if not data:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            conn.ended.set()
            writer.close()

    def _handshake(self, conn: EngineConn, request: Request) -> None:
        conn.headers = request.headers
        if "upgrade" not in request.headers.get("Connection", "").lower():
            # Plain HTTP (the sidecar's readiness probe asks for /health).
            conn.protocol.send_response(conn.protocol.reject(200, "healthy"))
            conn.flush()
            return
        if self.reject is not None:
            conn.protocol.send_response(conn.protocol.reject(self.reject, "refused by the test"))
            conn.flush()
            return
        conn.protocol.send_response(conn.protocol.accept(request))
        self.conns.append(conn)
        if self.on_connect is not None:
            conn.holding = True  # the first frames go out in the same write as the 101
            self.on_connect(conn)
            conn.release()
        else:
            conn.flush()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[Engine]]]:
    started: list[Engine] = []

    async def start(**kwargs: Any) -> Engine:
        engine = await Engine(**kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.aclose()


# -- the link under test ------------------------------------------------------------------------


class Recorder:
    """An UpstreamHandler that records what the link hands over, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.alive = 0
        #: Commands returned by the next upstream_text, for the link to send.
        self.commands: list[str] = []
        self.taken = 0

    def upstream_text(self, text: str) -> list[str]:
        self.events.append(("text", text))
        if not self.commands:
            return []
        self.taken += 1
        out, self.commands = self.commands, []
        return out

    def upstream_binary(self, size: int) -> None:
        self.events.append(("binary", size))

    def upstream_alive(self) -> None:
        self.alive += 1

    def texts(self) -> list[str]:
        return [data for kind, data in self.events if kind == "text"]


@dataclass
class Opened:
    """A link, its handler and (once started) its run task."""

    link: UpstreamLink
    handler: Recorder = field(default_factory=Recorder)
    task: asyncio.Task[bool] | None = None

    def run(self) -> asyncio.Task[bool]:
        self.task = asyncio.create_task(self.link.run(self.handler))
        return self.task

    async def result(self) -> bool:
        assert self.task is not None
        async with asyncio.timeout(QUICK):
            return await self.task


Opener = Callable[..., Awaitable[Opened]]


@pytest.fixture(params=CLIENTS)
async def open_link(request: pytest.FixtureRequest) -> AsyncIterator[Opener]:
    """Factory: ``await open_link(engine.url, headers=..., max_message_bytes=...)``."""
    client: str = request.param
    http = aiohttp.ClientSession() if client == "aiohttp" else None
    opened: list[Opened] = []

    async def open_(
        url: str,
        *,
        headers: dict[str, str] | None = None,
        max_message_bytes: int = MAX_MESSAGE,
        write_limit: int = 64 * MIB,
    ) -> Opened:
        async with asyncio.timeout(QUICK):
            link = await connect_upstream(
                client,  # type: ignore[arg-type]
                url,
                headers=headers or {},
                max_message_bytes=max_message_bytes,
                write_limit=write_limit,
                close_timeout=DEADLINE,
                session=http,
            )
        item = Opened(link)
        opened.append(item)
        return item

    open_.client = client  # type: ignore[attr-defined]
    yield open_
    for item in opened:
        item.link.abort()
        if item.task is not None and not item.task.done():
            item.task.cancel()
            with contextlib.suppress(BaseException):
                await item.task
    if http is not None:
        await http.close()


async def picows_link(url: str, **kwargs: Any) -> UpstreamLink:
    values: dict[str, Any] = {
        "headers": {},
        "max_message_bytes": MAX_MESSAGE,
        "write_limit": 64 * MIB,
        "close_timeout": DEADLINE,
    }
    values.update(kwargs)
    async with asyncio.timeout(QUICK):
        return await connect_upstream("picows", url, **values)


def event(kind: str, n: int = 0) -> str:
    return json.dumps({"type": kind, "n": n})


# -- what the engine sends ----------------------------------------------------------------------


async def _started(engines: Any, open_link: Opener, **link_options: Any) -> tuple[Any, Any]:
    """A link to a fresh engine, running, and the engine's side of the connection."""
    engine = await engines()
    link = await open_link(engine.url, **link_options)
    conn = await engine.connection()
    link.run()
    return link, conn


async def test_frames_sent_with_the_101_are_handed_over_once_run_starts_in_order(
    engines: Any, open_link: Opener
) -> None:
    engine = await engines(on_connect=lambda c: (c.text(event("a")), c.text(event("b"))))
    link = await open_link(engine.url)
    conn = await engine.connection()
    conn.text(event("c"))  # before run too: held behind the first two
    await soon(lambda: conn.writer.transport.get_write_buffer_size() == 0, what="c sent")
    assert link.handler.events == []
    link.run()
    await soon(lambda: len(link.handler.events) == 3, what="the held frames")
    conn.text(event("d"))
    conn.close(1000)
    assert await link.result() is True
    assert link.handler.texts() == [event("a"), event("b"), event("c"), event("d")]


async def test_a_frame_and_a_close_sent_with_the_101_both_reach_run(
    engines: Any, open_link: Opener
) -> None:
    engine = await engines(on_connect=lambda c: (c.text(event("created")), c.close(1001)))
    link = await open_link(engine.url)
    conn = await engine.connection()
    link.run()
    assert await link.result() is True
    await soon(lambda: conn.close_code_received is not None, what="the close answered")
    assert link.handler.texts() == [event("created")]
    assert link.link.close_code == 1001


async def test_a_message_in_three_fragments_is_one_text_and_a_ping_between_is_answered(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    whole = json.dumps(
        {"type": "response.output_audio.delta", "delta": "é" * 300}, ensure_ascii=False
    )
    data = whole.encode()
    # Split inside the two-byte "é": each fragment alone is not valid UTF-8.
    cut1, cut2 = data.index(b"\xc3") + 1, len(data) // 2 + 1
    conn.text(data[:cut1], fin=False)
    conn.ping(b"between")
    conn.continuation(data[cut1:cut2], fin=False)
    conn.continuation(data[cut2:], fin=True)
    conn.text(event("next"))
    await soon(lambda: len(link.handler.events) == 2, what="two messages")
    assert link.handler.texts() == [whole, event("next")]
    await soon(lambda: bool(conn.of(Opcode.PONG)), what="the pong")
    assert [f.data for f in conn.of(Opcode.PONG)] == [b"between"]


async def test_fragments_above_max_message_bytes_end_the_link_with_1009(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link, max_message_bytes=10_000)
    conn.text(b"x" * 4_000, fin=False)  # each fragment is under the bound, all three are not
    conn.continuation(b"x" * 4_000, fin=False)
    conn.continuation(b"x" * 4_000, fin=True)
    assert await link.result() is False
    assert link.handler.events == []
    await soon(lambda: conn.ended.is_set(), what="the connection ended")
    assert conn.close_code_received == 1009


async def test_one_frame_above_max_message_bytes_ends_the_link(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link, max_message_bytes=10_000)
    conn.text(b"x" * 10_001)
    assert await link.result() is False
    await soon(lambda: conn.ended.is_set(), what="the connection ended")
    assert conn.close_code_received == 1009


@pytest.mark.parametrize("fragmented", [False, True], ids=["one-frame", "fragmented"])
async def test_invalid_utf8_in_a_text_message_closes_with_1007(
    engines: Any, open_link: Opener, fragmented: bool
) -> None:
    link, conn = await _started(engines, open_link)
    conn.text(event("fine"))
    if fragmented:
        conn.text(b'{"type":"', fin=False)
        conn.continuation(b'\xff"}', fin=True)
    else:
        conn.text(b'{"type":"\xff"}')
    assert await link.result() is False
    assert link.handler.texts() == [event("fine")]
    await soon(lambda: conn.close_code_received is not None, what="our close frame")
    assert conn.close_code_received == 1007


async def test_invalid_utf8_sent_with_the_101_closes_with_1007_too(
    engines: Any, open_link: Opener, request: pytest.FixtureRequest
) -> None:
    engine = await engines(on_connect=lambda c: c.text(b'{"type":"\xff"}'))
    link = await open_link(engine.url)
    conn = await engine.connection()
    link.run()
    raised: Exception | None = None
    clean: bool | None = None
    try:
        clean = await link.result()
    except Exception as exc:  # noqa: BLE001 - the product bug this test documents
        raised = exc
    await soon(lambda: conn.close_code_received is not None, what="our close frame")
    assert (raised, clean, conn.close_code_received) == (None, False, 1007)


_BAD_THEN_GOOD = {
    # What fails the connection, then a valid event in the same read.
    "invalid-utf8": lambda c: (c.text(b'{"type":"\xff"}'), c.text(event("after"))),
    "fragments-too-big": lambda c: (
        c.text(b"x" * 6_000, fin=False),
        c.continuation(b"x" * 6_000, fin=True),
        c.text(event("after")),
    ),
}


@pytest.mark.parametrize("failure", list(_BAD_THEN_GOOD))
async def test_nothing_reaches_the_handler_after_the_link_failed_the_connection(
    engines: Any, open_link: Opener, request: pytest.FixtureRequest, failure: str
) -> None:
    """RFC 6455 §7.1.7: once failing the connection, no further data is processed."""
    link, conn = await _started(engines, open_link, max_message_bytes=10_000)
    conn.holding = True
    _BAD_THEN_GOOD[failure](conn)
    conn.release()  # one write: the bad frame and the good one arrive together
    assert await link.result() is False
    assert link.handler.events == []


_OUT_OF_ORDER = {
    # A fragmented message interrupted by a new one; a continuation with nothing to continue.
    "new-message-inside-a-fragmented-one": lambda c: (
        c.raw_frame(0x1, b'{"type":', fin=False),
        c.raw_frame(0x1, event("other").encode()),
    ),
    "fragmented-message-inside-a-fragmented-one": lambda c: (
        c.raw_frame(0x1, b'{"type":', fin=False),
        c.raw_frame(0x1, b'{"type":', fin=False),
    ),
    "continuation-without-a-first-frame": lambda c: c.raw_frame(0x0, b'"x"}'),
}


@pytest.mark.parametrize("case", list(_OUT_OF_ORDER))
async def test_fragments_out_of_order_close_with_1002(
    engines: Any, open_link: Opener, request: pytest.FixtureRequest, case: str
) -> None:
    engine = await engines()
    link = await open_link(engine.url)
    conn = await engine.connection()
    task = link.run()
    _OUT_OF_ORDER[case](conn)
    await soon(lambda: task.done() or bool(link.handler.events), what="the link to react")
    assert link.handler.events == []
    assert await link.result() is False
    await soon(lambda: conn.close_code_received is not None, what="our close frame")
    assert conn.close_code_received == 1002


async def test_a_close_without_a_code_is_a_clean_end(
    engines: Any, open_link: Opener, request: pytest.FixtureRequest
) -> None:
    """A Close frame may carry no code (RFC 6455 §7.1.5: the receiver sees 1005); the
    aiohttp link (the relay's engine link until picows) ends cleanly on it, and so does
    the websockets package (1005 is one of its OK close codes)."""
    link, conn = await _started(engines, open_link)
    conn.raw_frame(0x8, b"")
    assert await link.result() is True
    assert link.link.closed


async def test_a_binary_message_is_reported_by_size(engines: Any, open_link: Opener) -> None:
    link, conn = await _started(engines, open_link)
    conn.binary(b"\x00" * 1234)
    conn.text(event("after"))
    await soon(lambda: len(link.handler.events) == 2, what="both messages")
    assert link.handler.events == [("binary", 1234), ("text", event("after"))]


async def test_engine_pings_are_answered_and_our_pings_prove_the_engine_alive(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    conn.ping(b"are you there")
    await soon(lambda: bool(conn.of(Opcode.PONG)), what="the pong")
    assert [f.data for f in conn.of(Opcode.PONG)] == [b"are you there"]
    before = link.handler.alive
    await link.link.ping()
    await soon(lambda: bool(conn.of(Opcode.PING)), what="our ping")
    await soon(lambda: link.handler.alive > before, what="upstream_alive for the pong")
    assert link.handler.events == [], "control frames are not messages"


@pytest.mark.parametrize(("code", "clean"), [(1000, True), (1001, True), (1011, False)])
async def test_the_engines_close_code_decides_a_clean_end(
    engines: Any, open_link: Opener, code: int, clean: bool
) -> None:
    link, conn = await _started(engines, open_link)
    conn.text(event("last"))
    conn.close(code, "bye")
    assert await link.result() is clean
    assert link.link.close_code == code
    assert link.link.closed
    assert link.handler.texts() == [event("last")]
    await soon(lambda: conn.ended.is_set(), what="the connection ended")
    assert conn.close_code_received is not None, "the engine's close is answered"


async def test_an_engine_that_vanishes_is_not_a_clean_end(engines: Any, open_link: Opener) -> None:
    link, conn = await _started(engines, open_link)
    conn.drop()
    assert await link.result() is False
    assert link.link.closed


async def test_close_sends_1000_and_completes_once_the_engine_answers(
    engines: Any, open_link: Opener
) -> None:
    engine = await engines()
    link = await open_link(engine.url)
    conn = await engine.connection()
    conn.holding = True  # the engine takes its time to answer
    closing = asyncio.create_task(link.link.close())
    await soon(lambda: conn.close_code_received is not None, what="our close frame")
    assert conn.close_code_received == 1000
    await asyncio.sleep(0.05)  # bounded look: close() must still be waiting
    assert not closing.done(), "close() returned before the engine answered"
    conn.release()
    async with asyncio.timeout(QUICK):
        await closing
    assert link.link.closed
    await soon(lambda: conn.ended.is_set(), what="the connection ended")
    assert conn.protocol.close_sent is not None and conn.protocol.close_sent.code == 1000


async def test_close_while_running_ends_run_cleanly(engines: Any, open_link: Opener) -> None:
    link, conn = await _started(engines, open_link)
    await link.link.send(event("last words"))
    async with asyncio.timeout(QUICK):
        await link.link.close()
    await soon(lambda: conn.ended.is_set(), what="the connection ended")
    assert conn.texts() == [event("last words")], "what was sent goes before the close"
    assert conn.close_code_received == 1000
    assert link.task is not None
    async with asyncio.timeout(QUICK):
        await asyncio.wait([link.task])


async def test_abort_drops_the_connection_without_a_close_frame(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    link.link.abort()
    assert await link.result() is False
    await soon(lambda: conn.ended.is_set(), what="the engine saw the connection end")
    assert conn.close_code_received is None


# -- what we send -------------------------------------------------------------------------------


async def test_sent_frames_arrive_intact_masked_and_in_order(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    texts = [
        event("small"),
        json.dumps({"type": "conversation.item.create", "text": "héllo wörld 🎵"}),
        json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 200}),  # 16-bit length
        json.dumps({"type": "input_audio_buffer.append", "audio": "B" * 70_000}),  # 64-bit
        "",
    ]
    for text in texts:
        await link.link.send(text)
    await soon(lambda: len(conn.texts()) == len(texts), what="every frame")
    assert conn.texts() == texts
    assert conn.protocol.parser_exc is None
    wire = conn.wire
    assert [f.payload.decode() for f in wire] == texts
    assert all(f.masked and f.fin and f.opcode == 1 for f in wire)
    assert [f.length_form for f in wire] == [7, 7, 16, 64, 7]
    assert len({f.mask for f in wire}) > 1, "a fresh masking key per frame"


async def test_commands_the_handler_has_waiting_are_sent_in_order(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    conn.text(event("nothing waits"))
    await soon(lambda: len(link.handler.events) == 1, what="the first event")
    assert link.handler.taken == 0, "nothing asked for, nothing taken"
    link.handler.commands = [event("ack", 1), event("ack", 2), event("truncate", 3)]
    conn.text(event("audio"))
    await soon(lambda: len(conn.texts()) == 3, what="the commands")
    assert conn.texts() == [event("ack", 1), event("ack", 2), event("truncate", 3)]
    assert link.handler.taken == 1


async def test_the_authorization_header_goes_to_the_engine(engines: Any, open_link: Opener) -> None:
    engine = await engines()
    await open_link(engine.url, headers={"Authorization": "Bearer engine-key"})
    conn = await engine.connection()
    assert conn.headers is not None
    assert conn.headers["Authorization"] == "Bearer engine-key"


@pytest.mark.parametrize("status", [403, 404])
async def test_a_refused_handshake_raises_upstream_connect_error(
    engines: Any, open_link: Opener, status: int
) -> None:
    engine = await engines(reject=status)
    with pytest.raises(UpstreamConnectError):
        await open_link(engine.url)


async def test_a_closed_port_raises_upstream_connect_error(open_link: Opener) -> None:
    with pytest.raises(UpstreamConnectError):
        await open_link(f"ws://127.0.0.1:{free_port()}/v1/realtime")


async def test_sending_after_the_engine_left_neither_raises_nor_writes(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    conn.close(1000)
    assert await link.result() is True
    await link.link.send(event("too late"))
    await link.link.ping()
    assert conn.texts() == []


async def test_input_backlog_counts_what_a_stalled_engine_has_not_taken(
    engines: Any, open_link: Opener
) -> None:
    engine = await engines(receive_buffer=4096)
    link = await open_link(engine.url)
    conn = await engine.connection()
    link.run()
    conn.reading.clear()
    chunk = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 60_000})
    for _ in range(160):  # ~9.6 MB: more than the kernel's buffers on both ends hold
        await link.link.send(chunk)
    await soon(lambda: link.link.input_backlog() > 0, what="a backlog")
    conn.reading.set()
    await soon(lambda: link.link.input_backlog() == 0, what="the backlog drained")
    await soon(lambda: len(conn.texts()) == 160, what="every frame")


@pytest.mark.parametrize("yields", [True, False], ids=["caller-yields", "tight-loop"])
async def test_send_waits_above_write_limit_while_the_engine_does_not_read(
    engines: Any, open_link: Opener, request: pytest.FixtureRequest, yields: bool
) -> None:
    engine = await engines(receive_buffer=4096)
    link = await open_link(engine.url, write_limit=256 * 1024)
    conn = await engine.connection()
    link.run()
    conn.reading.clear()
    chunk = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 60_000})

    async def stream() -> int:
        for sent in range(1000):  # 60 MB at most: far above every buffer on the way
            await link.link.send(chunk)
            if yields:  # as the relay's client reader does now and then
                await asyncio.sleep(0)
        return sent

    sender = asyncio.create_task(stream())
    await soon(lambda: link.link.input_backlog() >= 256 * 1024, what="input above the limit")
    await asyncio.sleep(0.05)  # bounded look: the sender is held, the backlog stays bounded
    assert not sender.done()
    # Bounded near write_limit (aiohttp checks for a drain every write_limit bytes written).
    assert link.link.input_backlog() < 4 * 256 * 1024
    conn.drop()  # the engine goes away: the held send returns instead of hanging
    async with asyncio.timeout(QUICK):
        await sender
    assert await link.result() is False


async def test_close_that_the_engine_never_answers_can_be_bounded_and_drops_it(
    engines: Any, open_link: Opener
) -> None:
    link, conn = await _started(engines, open_link)
    conn.holding = True  # never answers our close
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await link.link.close()
    await soon(lambda: conn.ended.is_set(), what="the connection dropped after the timeout")
    assert conn.close_code_received == 1000
    assert link.task is not None
    async with asyncio.timeout(QUICK):
        await asyncio.wait([link.task])


# -- the picows link's own sending --------------------------------------------------------------


async def test_picows_sends_of_one_tick_are_counted_then_written_in_order(engines: Any) -> None:
    engine = await engines()
    link = await picows_link(engine.url)
    try:
        conn = await engine.connection()
        texts = [event("append", i) for i in range(5)]
        for text in texts:
            link.send_nowait(text)
        # Nothing is written before the end of the tick: all of it is backlog.
        assert link.input_backlog() == sum(len(t) for t in texts)
        await soon(lambda: len(conn.texts()) == 5, what="the batch")
        assert conn.texts() == texts
        assert all(f.masked for f in conn.wire)
        await soon(lambda: link.input_backlog() == 0, what="the batch taken")
    finally:
        link.abort()


async def test_picows_stops_reading_at_a_frame_that_arrives_before_run(engines: Any) -> None:
    """What arrives before run() is held, so reading pauses there (the bound on what is held
    is one socket read; on loopback the kernel would absorb tens of MB before the engine
    could see it, so the transport's own reading state is checked)."""
    engine = await engines(on_connect=lambda c: c.text(event("session.created")))
    link = await picows_link(engine.url)
    try:
        assert isinstance(link, PicowsUpstreamLink) and link.transport is not None
        underlying = link.transport.underlying_transport
        await soon(lambda: not underlying.is_reading(), what="reading paused")
        handler = Recorder()
        task = asyncio.create_task(link.run(handler))
        await soon(lambda: underlying.is_reading(), what="reading resumed by run()")
        assert handler.texts() == [event("session.created")]
        (await engine.connection()).close(1000)
        async with asyncio.timeout(QUICK):
            assert await task is True
    finally:
        link.abort()


# -- whole sessions through a sidecar, with each upstream_client --------------------------------


def _created(rid: str) -> dict[str, Any]:
    return {"type": "response.created", "response_id": rid, "response": {"id": rid}}


def _audio(rid: str, n: int) -> dict[str, Any]:
    return {"type": AUDIO_DELTA, "response_id": rid, "delta": "AAAA" * 64, "n": n}


def _done(rid: str, status: str) -> dict[str, Any]:
    return {"type": "response.done", "response_id": rid, "response": {"id": rid, "status": status}}


def _send(conn: EngineConn, *events: dict[str, Any]) -> None:
    conn.holding = True
    for item in events:
        conn.text(json.dumps(item))
    conn.release()


async def _session_frames(url: str) -> tuple[list[str], int | None]:
    """One whole scripted session: its frames as read, and the close code."""
    async with connect(url) as client:
        await request_response(client, open_session=True)
        await client.recv_until("rate_limits.updated")
        await client.send({"type": "session.close"})
        await client.recv_until_closed()
    return client.frames, client.close_code


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_response_is_byte_identical_through_either_link(
    simulator: Any, sidecar: Any, client: str
) -> None:
    sim = await simulator("--realtime-factor", "0", "--deterministic")
    # No acks on the client's behalf: their hidden answers would shift the engine's seq numbers.
    proxy = await sidecar(upstream=sim.ws_url, playback_ack="off", upstream_client=client)
    direct, direct_code = await _session_frames(sim.ws_url)
    proxied, proxied_code = await _session_frames(proxy.url)
    assert json.loads(direct[-1])["type"] == "session.closed"
    assert sum(AUDIO_DELTA in f for f in direct) >= 3
    assert_relayed_as_the_engine_wrote(proxied, direct)
    assert proxied_code == direct_code == 1000


@pytest.mark.parametrize("client", CLIENTS)
async def test_the_setting_picks_the_engine_link(engines: Any, sidecar: Any, client: str) -> None:
    engine = await engines()
    proxy = await sidecar(upstream=engine.url, upstream_client=client)
    async with connect(proxy.url):
        conn = await engine.connection()
    assert conn.headers is not None
    # What the engine sees of the client library: aiohttp names itself, picows does not.
    agent = conn.headers.get("User-Agent", "")
    assert ("aiohttp" in agent) is (client == "aiohttp"), agent


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_cancel_drops_the_late_audio_on_either_link(
    engines: Any, sidecar: Any, client: str
) -> None:
    engine = await engines()
    proxy = await sidecar(upstream=engine.url, upstream_client=client, playback_ack="off")
    async with connect(proxy.url) as client_ws:
        conn = await engine.connection()
        _send(conn, _created("r1"), _audio("r1", 0))
        await client_ws.recv_until(AUDIO_DELTA)
        await client_ws.send({"type": "response.cancel", "response_id": "r1"})
        await wait_until(lambda: conn.texts()[-1:] != [], what="the cancel upstream")
        assert json.loads(conn.texts()[-1]) == {"type": "response.cancel", "response_id": "r1"}
        mark = client_ws.mark()
        _send(conn, _audio("r1", 1), _audio("r1", 2), _done("r1", "cancelled"))
        _send(conn, _created("r2"), _audio("r2", 0), _done("r2", "completed"))
        await client_ws.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == "r2")
    after = client_ws.events[mark:]
    assert [(e["type"], rid_of(e)) for e in after] == [
        ("response.done", "r1"),
        ("response.created", "r2"),
        (AUDIO_DELTA, "r2"),
        ("response.done", "r2"),
    ]
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) == 2


def _chunk_100ms(rid: str, n: int) -> dict[str, Any]:
    """100 ms of pcm16 at 24 kHz."""
    return {
        "type": AUDIO_DELTA,
        "response_id": rid,
        "item_id": f"item_{rid}",
        "delta": "A" * 6400,
        "format": "pcm16",
        "sample_rate_hz": 24000,
        "n": n,
    }


@pytest.mark.parametrize("client", CLIENTS)
async def test_playback_acks_reach_the_engine_through_either_link(
    engines: Any, sidecar: Any, client: str
) -> None:
    engine = await engines()
    proxy = await sidecar(upstream=engine.url, upstream_client=client, playback_ack="auto")
    append = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"})

    def acks(conn: EngineConn) -> list[dict[str, Any]]:
        events = [json.loads(t) for t in conn.texts()]
        return [e for e in events if e["type"] == "playback.ack"]

    async with connect(proxy.url) as client_ws:
        conn = await engine.connection()
        _send(conn, _created("r1"), *[_chunk_100ms("r1", i) for i in range(5)])
        _send(conn, _done("r1", "completed"))
        await client_ws.recv_until("response.done")
        await soon(lambda: bool(acks(conn)), what="an ack from the timer")
        for _ in range(3):  # acks may ride along with these
            await client_ws.send(append)
        # The last one says all 500 ms were heard.
        await soon(lambda: any(a["played_ms"] == 500 for a in acks(conn)), what="the final ack")
        await soon(lambda: conn.texts().count(append) == 3, what="the appends")
    played = [a["played_ms"] for a in acks(conn)]
    assert played == sorted(set(played)) and played[0] > 0, played
    assert {(a["response_id"], a["item_id"]) for a in acks(conn)} == {("r1", "item_r1")}
    assert all(f.masked for f in conn.wire)


_ENDINGS: dict[str, tuple[Callable[[EngineConn], None], str, int]] = {
    # engine action: (what the engine does, session.closed reason, client close code)
    "close-1000": (lambda c: c.close(1000), "upstream_closed", 1000),
    "close-1001": (lambda c: c.close(1001), "upstream_closed", 1000),
    "close-1011": (lambda c: c.close(1011), "engine_unavailable", 1011),
    "vanish": (lambda c: c.drop(), "engine_unavailable", 1011),
    "invalid-utf8": (lambda c: c.text(b'{"type":"\xff"}'), "engine_unavailable", 1011),
    "close-without-code": (lambda c: c.raw_frame(0x8, b""), "upstream_closed", 1000),
}


@pytest.mark.parametrize("ending", list(_ENDINGS))
@pytest.mark.parametrize("client", CLIENTS)
async def test_how_the_engine_ends_decides_the_clients_close(
    engines: Any, sidecar: Any, client: str, ending: str, request: pytest.FixtureRequest
) -> None:
    action, reason, code = _ENDINGS[ending]
    engine = await engines()
    proxy = await sidecar(upstream=engine.url, upstream_client=client)
    async with connect(proxy.url) as client_ws:
        conn = await engine.connection()
        _send(conn, _created("r1"))
        await client_ws.recv_until("response.created")
        action(conn)
        events = await client_ws.recv_until_closed()
    assert events[-1]["type"] == "session.closed"
    assert events[-1]["reason"] == reason
    if reason == "engine_unavailable":
        assert [e["error"]["code"] for e in events if e["type"] == "error"] == [reason]
    assert client_ws.close_code == code


@pytest.mark.parametrize("client", CLIENTS)
async def test_an_engine_whose_first_frame_is_not_utf8_is_unavailable(
    engines: Any,
    sidecar: Any,
    client: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = await engines(on_connect=lambda c: c.text(b'{"type":"\xff"}'))
    proxy = await sidecar(upstream=engine.url, upstream_client=client)
    with caplog.at_level(logging.ERROR, logger="omni_sidecar"):
        async with connect(proxy.url) as client_ws:
            events = await client_ws.recv_until_closed()
        await proxy.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [e["type"] for e in events] == ["error", "session.closed"]
    assert events[-1]["reason"] == "engine_unavailable"
    assert client_ws.close_code == 1011


# -- the setting itself -------------------------------------------------------------------------


async def test_upstream_client_from_env_is_accepted_and_a_bad_one_exits_2() -> None:
    rc, out, err = await run_cli(
        "serve", "--print-config", env=clean_env(OMNI_SIDECAR_UPSTREAM_CLIENT="aiohttp")
    )
    assert rc == 0, err
    assert 'upstream_client = "aiohttp"  # env OMNI_SIDECAR_UPSTREAM_CLIENT' in out.splitlines()
    rc, _, err = await run_cli(
        "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
        env=clean_env(OMNI_SIDECAR_UPSTREAM_CLIENT="websockets"),
    )  # fmt: skip
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "upstream_client" in line and "env OMNI_SIDECAR_UPSTREAM_CLIENT" in line
