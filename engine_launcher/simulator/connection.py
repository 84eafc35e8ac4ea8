"""I/O shell around one :class:`DuplexSession`: three tasks in one TaskGroup.

The reader feeds ``ws.receive()`` to ``session.receive_*``; the producer paces
audio chunks of the active response (and the optional ``response.listen``
timer); the sender takes the session's next frame and awaits each
``send_str``. The frames wait in the session's own output queue
(``delivery.OutputQueue``): unbounded on 0.30, as the released engine's, bounded
from 0.31 (docs/design.md, Simulator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Final

from aiohttp import WSMsgType, web

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.counters import SessionSlots, SimulatorStats
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.session_state import Phase
from engine_launcher.simulator.wire import MAX_CLIENT_MESSAGE_BYTES

__all__ = [
    "FIRST_MESSAGE_TIMEOUT",
    "SessionRunner",
    "SimulatorState",
]

logger = logging.getLogger(__name__)

# docs/engine-protocol.md, Framing and limits: the first message must arrive within 10 s
# (config_timeout).
FIRST_MESSAGE_TIMEOUT: Final = 10.0
# Bound on the final close handshake and cleanup of one socket.
CLOSE_TIMEOUT: Final = 5.0


@dataclass(slots=True, kw_only=True)
class SimulatorState:
    """Process-wide state shared by the HTTP and WebSocket handlers.

    Attributes:
        config: the simulator configuration.
        bank: precomputed output audio.
        stats: counters for ``/metrics``.
        stalled: set by ``--stall-after``; every socket stops reading and sending.
        listening_since: loop time when the port was bound (``None`` before).
        created: unix time reported as the model's ``created``.
        slots: open sessions against ``--max-sessions``.
    """

    config: SimulatorConfig
    bank: AudioBank
    stats: SimulatorStats = field(default_factory=SimulatorStats)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    listening_since: float | None = None
    created: int = 0
    sessions: set[SessionRunner] = field(default_factory=set)
    no_sessions: asyncio.Event = field(default_factory=asyncio.Event)
    slots: SessionSlots = field(init=False)

    def __post_init__(self) -> None:
        self.no_sessions.set()
        self.slots = SessionSlots(self.config.max_sessions)

    def add(self, runner: SessionRunner) -> None:
        """Track a live socket (for shutdown and ``sessions_active``)."""
        self.sessions.add(runner)
        self.no_sessions.clear()
        self.stats.sessions_active = len(self.sessions)
        self.stats.sessions_total += 1

    def discard(self, runner: SessionRunner) -> None:
        """Forget a finished socket."""
        self.sessions.discard(runner)
        self.stats.sessions_active = len(self.sessions)
        if not self.sessions:
            self.no_sessions.set()


class _SessionEnded(Exception):
    """Raised by a session task to end the whole TaskGroup (socket done)."""


def _utf8_size_over(text: str, limit: int) -> int | None:
    """Return the UTF-8 size of ``text`` when it exceeds ``limit``, else ``None``."""
    if len(text) > limit:
        return len(text.encode("utf-8", "surrogatepass"))
    if len(text) * 4 <= limit:
        return None  # cannot exceed: at most 4 bytes per code point
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


class SessionRunner:
    """Runs one WebSocket connection of the simulator.

    Args:
        ws: the prepared server-side WebSocket.
        session: the sans-I/O protocol core (possibly already opened).
        state: process-wide state.
    """

    def __init__(self, ws: web.WebSocketResponse, session: DuplexSession, state: SimulatorState):
        self._ws = ws
        self._session = session
        self._state = state
        self._output_ready = asyncio.Event()
        self._responses: asyncio.Queue[str] = asyncio.Queue()
        self._wake = asyncio.Event()
        # What this socket's queue last added to the process-wide gauges.
        self._counted_events = 0
        self._counted_bytes = 0

    async def run(self) -> None:
        """Serve the socket until it closes; never raises for ordinary endings."""
        self._state.add(self)
        self._flush()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read_loop(), name="sim-reader")
                tg.create_task(self._produce_loop(), name="sim-producer")
                tg.create_task(self._send_loop(), name="sim-sender")
        except* _SessionEnded:
            pass
        except* Exception as group:
            # Only the top of the session turns an exception into a close, once.
            logger.error(
                "session %s failed", self._session.session_id or "-", exc_info=group.exceptions[0]
            )
        finally:
            self._state.discard(self)
            if self._session.holds_slot:
                self._session.holds_slot = False
                self._state.slots.release()
            self._state.stats.outbox_events -= self._counted_events
            self._state.stats.outbox_bytes -= self._counted_bytes
            if not self._ws.closed:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await self._ws.close(code=1011, message=b"internal_error")

    @property
    def session(self) -> DuplexSession:
        """The protocol core of this socket (read by ``GET /debug/history``)."""
        return self._session

    def request_close(self, reason: str, code: int) -> None:
        """Queue ``session.closed`` and a close frame (server shutdown)."""
        self._session.request_close(reason, code)
        self._flush()

    # ------------------------------------------------------------ internals

    def _flush(self) -> None:
        """Wake the sender for what the core queued; hand new responses to the producer."""
        self._count_queued()
        self._output_ready.set()
        for response_id in self._session.responses_to_start():
            self._responses.put_nowait(response_id)
        self._wake.set()

    def _count_queued(self) -> None:
        """Bring the process-wide queue gauges up to date with this session's queue."""
        stats = self._state.stats
        events, size = self._session.queued_events, self._session.queued_bytes
        stats.outbox_events += events - self._counted_events
        stats.outbox_bytes += size - self._counted_bytes
        self._counted_events, self._counted_bytes = events, size

    async def _stall_gate(self) -> None:
        """Park forever once ``--stall-after`` fired (sockets stay open)."""
        if self._state.stalled.is_set():
            await asyncio.get_running_loop().create_future()

    async def _read_loop(self) -> None:
        session = self._session
        while True:
            await self._stall_gate()
            timeout = FIRST_MESSAGE_TIMEOUT if session.phase is Phase.AWAITING_OPEN else None
            try:
                msg = await self._ws.receive(timeout=timeout)
            except TimeoutError:
                session.receive_open_timeout()
                self._flush()
                return
            await self._stall_gate()  # a stalled engine drops what it reads
            if msg.type is WSMsgType.TEXT:
                size = _utf8_size_over(msg.data, MAX_CLIENT_MESSAGE_BYTES)
                if size is None:
                    session.receive_text(msg.data)
                else:
                    session.receive_oversized(size)
            elif msg.type is WSMsgType.BINARY:
                session.receive_binary()
            else:
                # CLOSE/CLOSING/CLOSED/ERROR. When we are the ones closing, the
                # sender finishes the handshake and ends the group.
                if session.phase is Phase.CLOSED:
                    return
                raise _SessionEnded
            self._flush()
            if session.phase is Phase.CLOSED:
                return  # stop reading; the sender delivers session.closed and closes

    async def _send_loop(self) -> None:
        ws = self._ws
        stats = self._state.stats
        while True:
            item = self._session.next_outgoing()
            if item is None:
                self._output_ready.clear()
                await self._output_ready.wait()
                continue
            self._count_queued()
            await self._stall_gate()
            if isinstance(item, CloseFrame):
                # A client that never answers the close frame costs at most
                # CLOSE_TIMEOUT; either way this socket is finished.
                with contextlib.suppress(ConnectionError, TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await ws.close(code=item.code, message=item.reason.encode()[:123])
                raise _SessionEnded
            try:
                await ws.send_str(item)
            except ConnectionError:
                raise _SessionEnded from None
            stats.events_sent += 1
            stats.bytes_sent += len(item)

    async def _produce_loop(self) -> None:
        config = self._state.config
        listen = config.listen_interval if config.listen_events else None
        while True:
            if listen is None:
                response_id = await self._responses.get()
            else:
                try:
                    async with asyncio.timeout(listen):
                        response_id = await self._responses.get()
                except TimeoutError:
                    await self._stall_gate()
                    self._session.produce_listen()
                    self._flush()
                    continue
            await self._stream(response_id)

    async def _stream(self, response_id: str) -> None:
        """Produce the chunks of one response at the configured pace."""
        loop = asyncio.get_running_loop()
        interval = self._state.config.chunk_interval
        deadline = loop.time()
        while self._session.is_active(response_id):
            if interval > 0:
                # Absolute schedule: chunk i is due i intervals after the start,
                # so handling time does not accumulate as drift.
                deadline += interval
                await self._sleep_until(deadline, response_id)
            else:
                await asyncio.sleep(0)  # let the reader see cancels between chunks
            await self._stall_gate()
            self._session.produce_chunk(response_id)
            self._flush()

    async def _sleep_until(self, deadline: float, response_id: str) -> None:
        """Sleep until ``deadline``, waking early if the response stops being active."""
        loop = asyncio.get_running_loop()
        while self._session.is_active(response_id):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                return
