"""Socket-free stand-ins for the relay shell: transport, protocol, clock, engine link.

Each fake records what a peer would observe (bytes on the wire, aborts,
frames sent upstream) and lets the test drive time and flow control by hand,
so shell rules are checked at exact injected times with no socket and no
sleep.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from websockets.frames import Frame
from websockets.streams import StreamReader

from proxy.session.upstream_link import UpstreamHandler, read_messages

__all__ = [
    "FakeClient",
    "FakeProtocol",
    "FakeTransport",
    "FakeUpstream",
    "ManualScheduler",
    "parse_frames",
]

#: Upper bound on frames parsed from one capture: a runaway writer fails fast.
MAX_FRAMES = 100_000


def parse_frames(data: bytes) -> list[Frame]:
    """Parse server-to-client frames with the ``websockets`` package's parser
    (independent of ours): unmasked, any size."""
    reader = StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    frames: list[Frame] = []
    while reader.buffer:
        if len(frames) >= MAX_FRAMES:
            raise AssertionError(f"more than {MAX_FRAMES} frames written")
        parser = Frame.parse(reader.read_exact, mask=False)
        try:
            next(parser)
        except StopIteration as done:
            frames.append(done.value)
        else:
            raise AssertionError("truncated frame at the end of the written bytes")
    return frames


class FakeTransport:
    """An asyncio transport that keeps what was written, in write calls."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.closing = False
        self.aborted = False
        self.reading_paused = False
        #: Called when the connection is lost (what asyncio's connection_lost does).
        self.on_lost: list[Callable[[], None]] = []

    def write(self, data: bytes) -> None:
        assert not self.closing, "write after close/abort"
        self.calls.append(bytes(data))

    def writelines(self, parts: list[bytes]) -> None:
        assert not self.closing, "write after close/abort"
        self.calls.append(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def close(self) -> None:
        self.closing = True
        for callback in self.on_lost:
            callback()

    def get_write_buffer_size(self) -> int:
        return self.buffered

    #: Bytes the transport holds unsent (a test sets it: a client that stopped reading).
    buffered = 0

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    @property
    def data(self) -> bytes:
        return b"".join(self.calls)

    def frames(self) -> list[Frame]:
        return parse_frames(self.data)


class FakeProtocol:
    """aiohttp's server protocol as the writer sees it: transport + flow control."""

    def __init__(self, transport: FakeTransport | None = None) -> None:
        self.transport: FakeTransport | None = transport or FakeTransport()
        self.writing_paused = False
        self._drained: asyncio.Event | None = None
        self.transport.on_lost.append(self._lost)

    def _lost(self) -> None:
        if self._drained is not None:
            self._drained.set()

    def pause(self) -> None:
        self.writing_paused = True

    def resume(self) -> None:
        self.writing_paused = False
        if self._drained is not None:
            self._drained.set()

    async def _drain_helper(self) -> None:
        if self.transport is None or self.transport.closing:
            raise ConnectionResetError("Connection lost")
        if not self.writing_paused:
            return
        self._drained = asyncio.Event()
        await self._drained.wait()
        if self.transport is None or self.transport.closing:
            raise ConnectionResetError("Connection lost")


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class ManualScheduler:
    """A clock the test moves: ``advance`` fires due timers in time order."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self.fired: list[tuple[float, str]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(when, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    def pending(self) -> list[float]:
        return sorted(t.when for t in self._timers if not t.cancelled)

    def advance(self, seconds: float, *, max_timers: int = 10_000) -> None:
        """Move time forward, firing every timer due on the way (bounded)."""
        target = self.now + seconds
        fired = 0
        while self._timers and self._timers[0].when <= target:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            fired += 1
            if fired > max_timers:
                raise AssertionError(f"more than {max_timers} timers fired in {seconds} s")
            self.now = timer.when
            self.fired.append((timer.when, getattr(timer.callback, "__name__", "?")))
            timer.callback()
        self.now = target


class FakeClient:
    """The client WebSocket as the relay uses it: a queue of received messages
    and the close handshake, which writes its close frame through the writer."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue(maxsize=10_000)
        self.closed = False
        self.close_calls: list[int] = []
        self.writer: object | None = None

    def send(self, msg_type: aiohttp.WSMsgType, data: object = None, extra: object = None) -> None:
        self.inbox.put_nowait(aiohttp.WSMessage(msg_type, data, extra))

    async def receive(self) -> aiohttp.WSMessage:
        if self.closed:
            return aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None)
        return await self.inbox.get()

    def lose(self) -> None:
        """The connection dropped: reads end with CLOSED."""
        self.closed = True
        self.send(aiohttp.WSMsgType.CLOSED)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        if self.closed:
            return False
        self.closed = True
        self.close_calls.append(code)
        writer = self.writer
        if writer is not None:
            writer.close(code, message)  # type: ignore[attr-defined]
        return True


class FakeUpstream:
    """The engine link: frames to hand to the relay, frames the relay sent."""

    def __init__(self, *, answer_close: bool = True) -> None:
        self.inbox: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue(maxsize=10_000)
        self.backlog: deque[object] = deque()
        #: Answer our ``session.close`` with ``session.closed`` and a close, like the engine.
        self.answer_close = answer_close
        self.sent: list[str] = []
        self.pings = 0
        self.closed = False
        self.close_code: int | None = None
        self.aborted = False
        self.pending_input = 0

    def feed(self, text: str) -> None:
        self.inbox.put_nowait(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, text, None))

    def feed_close(self, code: int = 1000) -> None:
        self.close_code = code
        self.inbox.put_nowait(aiohttp.WSMessage(aiohttp.WSMsgType.CLOSE, code, None))

    def input_backlog(self) -> int:
        return self.pending_input

    async def receive(self) -> aiohttp.WSMessage:
        if self.closed:
            return aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None)
        return await self.inbox.get()

    async def run(self, handler: UpstreamHandler) -> bool:
        return await read_messages(self, self, handler)

    #: Like a link above its mark (a test sets it); the relay sets on_drained.
    write_paused = False
    on_drained: Callable[[], None] | None = None

    async def wait_drained(self) -> None:
        pass

    def send_nowait(self, text: str) -> None:
        self.sent.append(text)
        if self.answer_close and '"session.close"' in text:
            self.feed('{"type":"session.closed","reason":"client_close"}')
            self.feed_close(1000)

    async def ping(self) -> None:
        self.pings += 1

    def pong_nowait(self, payload: bytes) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True
        self.feed_close(1006)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inbox.put_nowait(aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None))
