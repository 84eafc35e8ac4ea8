"""The per-session relay: a thin aiohttp shell around ``SessionCore``.

Three tasks in one TaskGroup (DESIGN.md §2):

1. client → upstream: read a client frame, let the core classify it (cancel
   triggers act at once), forward the original text.
2. upstream → client (intake): read an engine frame and hand it to the core,
   which filters it and queues it in the session's OutputBuffer. This task
   never waits on the client, so the engine is always read at full speed.
3. delivery: wait until the client transport is below its high-water mark,
   take the next event from the core (re-checked at that moment) and write it.

Fast path: when the delivery task is parked (nothing queued, nothing being
written) and the client transport is not paused, the intake takes the event
itself and writes it, batched with the other engine frames already waiting in
this loop tick (one transport write per burst). The intake still never waits
on the client: the batch is bounded by ``client_write_buffer_bytes``, taken
events are re-checked when written, and aiohttp's own drain is disabled (the
relay waits for writability only in the delivery task).

Keepalive is the relay's own: a timestamp per received frame on each side and
a tick every half ``heartbeat_interval`` that pings a quiet side and drops one
silent for two intervals.

What can still be in flight after a cancel: the one frame being written, plus
what the transport (``client_write_buffer_bytes``) and the kernel send buffer
(set to the same size; Linux doubles it) hold, plus whatever the client's own
receive buffer took. A frame is written only while the transport buffer is
below the mark, so a reader that keeps up hears at most about one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
import uuid
from collections.abc import Callable, Sized
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from aiohttp import web

from proxy.core.buffer import Entry
from proxy.core.events import ClientKind, EventKind
from proxy.core.session import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    DropReason,
    Outcome,
    SessionCore,
    SessionState,
)

if TYPE_CHECKING:
    from proxy.observer import SessionObserver

__all__ = ["Relay", "new_event_id", "tune_client_socket"]

log = logging.getLogger(__name__)

#: Close codes a client may receive and what the engine's close maps to.
_UPSTREAM_CLEAN_CLOSES: Final = frozenset({1000, 1001})


def new_event_id() -> str:
    return "event_" + uuid.uuid4().hex


class Relay:
    """One client session and its upstream connection.

    Args:
        session_key: our own id for logs and /debug/sessions.
        client: the prepared client WebSocketResponse.
        client_protocol: the aiohttp protocol under ``client`` (flow control).
        upstream: the connected upstream ClientWebSocketResponse.
        core: the session policy.
        observer: metrics and registry hooks.
        close_timeout: seconds to deliver the final events once closing.
        drain_timeout: seconds to deliver what is queued when the engine is lost.
        upstream_close_timeout: seconds to wait for the engine's ``session.closed``.
    """

    def __init__(
        self,
        *,
        session_key: str,
        client: web.WebSocketResponse,
        client_protocol: Any,
        upstream: aiohttp.ClientWebSocketResponse,
        core: SessionCore,
        observer: SessionObserver,
        close_timeout: float,
        drain_timeout: float,
        upstream_close_timeout: float,
        max_pending_input_bytes: int = 0,
        write_buffer_bytes: int = 64 * 1024,
        max_session_duration: float = 0.0,
        client_idle_timeout: float = 0.0,
        heartbeat_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = session_key
        self.client = client
        self._protocol = client_protocol
        self.upstream = upstream
        self.core = core
        self._observer = observer
        self._close_timeout = close_timeout
        self._drain_timeout = drain_timeout
        self._upstream_close_timeout = upstream_close_timeout
        self._max_pending_input = max_pending_input_bytes
        self._write_buffer_bytes = write_buffer_bytes
        #: Entries the fast path took, written at the end of the loop tick.
        self._batch: list[tuple[Entry, float]] = []
        self._batch_bytes = 0
        #: Engine frames aiohttp has parsed but we have not read yet (its
        #: reader queue; empty when unknown, which disables batching).
        self._upstream_backlog: Sized = getattr(getattr(upstream, "_reader", None), "_buffer", ())
        self._max_duration = max_session_duration
        self._idle_timeout = client_idle_timeout
        self._last_client_frame = clock()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._heartbeat = heartbeat_interval
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._last_upstream_frame = self._last_client_frame
        self._ping_client = False
        self._ping_upstream = False
        #: The timeout scope of the delivery loop; closing sessions get a deadline.
        self._deadline: asyncio.Timeout | None = None
        self._clock = clock
        self.started_at = clock()
        self._wake = asyncio.Event()
        self._upstream_session_closed = asyncio.Event()
        self._upstream_gone = asyncio.Event()
        self._client_gone = asyncio.Event()
        self._intake: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        #: The delivery task is parked waiting for output (fast path allowed).
        self._delivery_idle = False
        self.bytes_client_to_upstream = 0
        self.bytes_upstream_to_client = 0
        self.log = logging.LoggerAdapter(log, {"session": session_key})

    # -- entry points used by the app ---------------------------------------------------

    async def run(self) -> None:
        """Relay until both sides are closed. Never raises for peer behaviour."""
        loop = asyncio.get_running_loop()
        timer = None
        if self._max_duration > 0:
            timer = loop.call_later(self._max_duration, self._expire)
        if self._idle_timeout > 0:
            self._idle_timer = loop.call_later(self._idle_timeout, self._check_idle)
        if self._heartbeat > 0:
            self._heartbeat_timer = loop.call_later(self._heartbeat / 2, self._heartbeat_tick)
        try:
            async with asyncio.TaskGroup() as tg:
                self._reader = tg.create_task(self._client_to_upstream(), name=f"{self.key}:client")
                self._intake = tg.create_task(self._upstream_to_client(), name=f"{self.key}:intake")
                tg.create_task(self._deliver(), name=f"{self.key}:deliver")
        except Exception:
            self.log.exception("session %s failed", self.key)
            if self.core.outcome is None:
                self.core.outcome = Outcome.ERROR
        finally:
            if timer is not None:
                timer.cancel()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            if self._heartbeat_timer is not None:
                self._heartbeat_timer.cancel()
            self.core.finish()
            self._observer.session_observations(self)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._close_timeout):
                    await self._close_both()

    def shutdown(self) -> None:
        """Proxy shutdown after the drain deadline: ``session.closed`` {shutdown}, 1001."""
        self.core.shutdown(self._clock())
        self._after_core_call()

    def _expire(self) -> None:
        self.log.info("max_session_duration reached")
        self.core.end(
            self._clock(),
            reason="max_session_duration",
            code=CLOSE_NORMAL,
            outcome=Outcome.CLIENT_CLOSED,
        )
        self._after_core_call()

    def _heartbeat_tick(self) -> None:
        """Keepalive on both sides (heartbeat_interval): every half interval, a
        side silent for half an interval is pinged; silent for two intervals (no
        frame, no pong) it is gone. A live peer is thus never silent for much
        more than one interval plus a round trip: a full interval of margin.

        Activity is a timestamp stored per received frame, so keepalive costs
        nothing per event; pings are sent by the delivery task.
        """
        now = self._clock()
        interval = self._heartbeat
        for side, last in (
            ("client", self._last_client_frame),
            ("upstream", self._last_upstream_frame),
        ):
            silent = now - last
            if silent >= 2 * interval:
                self.log.info("%s silent for %.1f s (no pong): gone", side, silent)
                self._abort(side)
            elif silent >= interval / 2:
                if side == "client":
                    self._ping_client = True
                else:
                    self._ping_upstream = True
                self._wake.set()
        self._heartbeat_timer = asyncio.get_running_loop().call_later(
            interval / 2, self._heartbeat_tick
        )

    def _abort(self, side: str) -> None:
        if side == "client":
            transport = getattr(self._protocol, "transport", None)
        else:
            connection = getattr(getattr(self.upstream, "_response", None), "connection", None)
            transport = getattr(connection, "transport", None)
            if transport is None:
                transport = getattr(getattr(self.upstream, "_writer", None), "transport", None)
        if transport is not None:
            transport.abort()

    async def _send_pings(self) -> None:
        if self._ping_client:
            self._ping_client = False
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.client.ping()
        if self._ping_upstream:
            self._ping_upstream = False
            if not self.upstream.closed:
                with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                    await self.upstream.ping()

    def _check_idle(self) -> None:
        """client_idle_timeout: no client frame for that long (the heartbeat,
        not this timer, detects peers that stopped answering pings)."""
        idle = self._clock() - self._last_client_frame
        if idle < self._idle_timeout:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self._idle_timeout - idle, self._check_idle
            )
            return
        self._idle_timer = None
        self.log.info("client idle for %.1f s; closing", idle)
        self.core.end(
            self._clock(),
            reason="client_idle_timeout",
            code=CLOSE_NORMAL,
            outcome=Outcome.CLIENT_CLOSED,
        )
        self._after_core_call()

    def engine_unavailable(self) -> None:
        """The supervisor saw the engine die: fail this session now."""
        self.core.upstream_lost(self._clock())
        self._after_core_call()
        # The engine socket may linger half-open; stop waiting for its session.closed.
        self._upstream_session_closed.set()

    def shed(self) -> None:
        """Process-wide pending cap exceeded and this is the largest session."""
        self.core.close_for_overflow(self._clock())
        self._after_core_call()

    # -- client → upstream -----------------------------------------------------------------

    async def _client_to_upstream(self) -> None:
        client = self.client
        core = self.core
        try:
            while True:
                msg = await client.receive()
                self._last_client_frame = self._clock()
                kind = msg.type
                if kind is aiohttp.WSMsgType.PING:
                    with contextlib.suppress(ConnectionError, RuntimeError):
                        await client.pong(msg.data)
                    continue
                if kind is aiohttp.WSMsgType.PONG:
                    continue
                if kind is aiohttp.WSMsgType.TEXT:
                    text: str = msg.data
                    decision = core.receive_client(text, self._clock())
                    self._observer.client_event(
                        decision.event.size,
                        forwarded=decision.forward,
                        audio=decision.event.kind is ClientKind.AUDIO_APPEND,
                    )
                    if decision.forward:
                        if (
                            self._input_backlog() + decision.event.size
                            > self._max_pending_input
                            > 0
                        ):
                            self.log.warning("engine is not reading input; failing the session")
                            core.end(
                                self._clock(),
                                reason="input_backpressure",
                                code=CLOSE_POLICY_VIOLATION,
                                outcome=Outcome.OVERFLOW,
                                error_code="input_backpressure",
                                error_message="the engine is not accepting input; more than "
                                f"{self._max_pending_input} bytes are waiting",
                            )
                        else:
                            self.bytes_client_to_upstream += decision.event.size
                            await self._send_upstream(text)
                    self._after_core_call()
                    if core.has_upstream_commands:
                        await self._flush_upstream_commands()
                elif kind is aiohttp.WSMsgType.BINARY:
                    core.reject_client_frame(
                        "binary_unsupported",
                        "binary frames are not supported; send JSON text frames",
                        self._clock(),
                        size=len(msg.data),
                    )
                    self._observer.client_event(len(msg.data), forwarded=False)
                    self._after_core_call()
                else:
                    # CLOSE, CLOSING, CLOSED or ERROR (aiohttp already answered
                    # an oversized frame with 1009).
                    if kind is aiohttp.WSMsgType.ERROR:
                        self.log.info("client error: %s", msg.data)
                    break
        finally:
            self._client_gone.set()
            if core.state is not SessionState.CLOSED and not core.buffer.closure_delivered:
                core.client_gone()
            self._after_core_call()
            with contextlib.suppress(Exception):
                await self._flush_upstream_commands()

    def _input_backlog(self) -> int:
        """Bytes written toward the engine that it has not taken yet."""
        writer = getattr(self.upstream, "_writer", None)
        transport = getattr(writer, "transport", None)
        if transport is None:
            return 0
        try:
            return int(transport.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    async def _send_upstream(self, text: str) -> None:
        if self.upstream.closed or self._upstream_gone.is_set():
            return
        try:
            await self.upstream.send_str(text)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self.log.info("upstream send failed: %s", exc)

    async def _flush_upstream_commands(self) -> None:
        for text in self.core.events_to_upstream():
            await self._send_upstream(text)

    # -- upstream → client (intake) --------------------------------------------------------------

    async def _upstream_to_client(self) -> None:
        upstream = self.upstream
        core = self.core
        observer = self._observer
        protocol = self._protocol if self._protocol is not None else _NeverPaused()
        clean = False
        try:
            while True:
                msg = await upstream.receive()
                self._last_upstream_frame = self._clock()
                kind = msg.type
                if kind is aiohttp.WSMsgType.PING:
                    with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                        await upstream.pong(msg.data)
                    continue
                if kind is aiohttp.WSMsgType.PONG:
                    continue
                if kind is aiohttp.WSMsgType.TEXT:
                    now = self._clock()
                    event = core.receive_upstream(msg.data, now)
                    observer.upstream_event(event)
                    self.bytes_upstream_to_client += event.size
                    if event.kind is EventKind.SESSION_CLOSED:
                        self._upstream_session_closed.set()
                    if (
                        self._delivery_idle
                        and core.state is SessionState.OPEN
                        and not protocol.writing_paused
                    ):
                        # Fast path: nothing queued or being written, the client
                        # can take it: write now instead of waking the delivery
                        # task (saves a task switch per event). Same checks as
                        # delivery: next_delivery re-validates the event.
                        self._write_ready(now)
                    self._after_core_call()
                    if core.has_upstream_commands:
                        await self._flush_upstream_commands()
                elif kind is aiohttp.WSMsgType.BINARY:
                    event = core.receive_upstream("\x00binary", self._clock())
                    self._observer.upstream_event(event)
                    self.log.warning(
                        "upstream sent a binary frame (%d bytes); dropped", len(msg.data)
                    )
                else:
                    code = upstream.close_code
                    clean = code in _UPSTREAM_CLEAN_CLOSES and kind is not aiohttp.WSMsgType.ERROR
                    if not self._upstream_session_closed.is_set():
                        self.log.info("upstream closed (code %s) without session.closed", code)
                    break
        finally:
            self._upstream_gone.set()
            if not self._upstream_session_closed.is_set():
                core.upstream_lost(self._clock(), clean=clean)
            self._after_core_call()

    # -- delivery -------------------------------------------------------------------------------

    def _after_core_call(self) -> None:
        core = self.core
        if core.buffer.has_output() or core.state is not SessionState.OPEN:
            self._wake.set()
            if core.state is SessionState.CLOSING:
                self._arm_close_deadline()
        self._observer.after_core_call(self)

    def _arm_close_deadline(self) -> None:
        """A closing session gets a bounded time to deliver its last events,
        also while delivery is blocked on a client that stopped reading."""
        deadline = self._deadline
        if deadline is None or deadline.when() is not None:
            return
        budget = (
            self._drain_timeout
            if self.core.outcome is Outcome.ENGINE_UNAVAILABLE
            else self._close_timeout
        )
        deadline.reschedule(asyncio.get_running_loop().time() + budget)

    def _write_ready(self, now: float) -> None:
        """Fast path: take what is ready into the write batch.

        The batch is written as soon as no further engine frame is waiting
        (at real-time pace: at once), else at the end of this loop tick: one
        transport write for a burst of frames. It never grows past the client
        write buffer size, so it never holds more than the transport would.
        Taken entries are re-checked when written: a cancel that arrives in
        between still drops their audio.
        """
        core = self.core
        buffer = core.buffer
        protocol = self._protocol
        while buffer.has_output() and not buffer.holding:
            if protocol is not None and protocol.writing_paused:
                return
            entry = core.next_delivery(now)
            if entry is None:
                return
            buffer.release_held()
            self._batch.append((entry, now))
            self._batch_bytes += entry.event.size
            if self._batch_bytes >= self._write_buffer_bytes or not self._upstream_backlog:
                # Nothing more from the engine in this tick (the usual case at
                # real-time pace), or the batch is full: write now.
                self._flush_batch()
            elif len(self._batch) == 1:
                # More engine frames are already buffered: gather them, but
                # never past this tick.
                asyncio.get_running_loop().call_soon(self._flush_batch)

    def _flush_batch(self) -> None:
        """Write the batch as WebSocket text frames in one transport call."""
        batch = self._batch
        if not batch:
            return
        self._batch = []
        self._batch_bytes = 0
        core = self.core
        transport = getattr(self._protocol, "transport", None)
        gone = transport is None or transport.is_closing() or self.client.closed
        parts: list[bytes] = []
        written: list[tuple[Entry, float]] = []
        for entry, taken_at in batch:
            if gone:
                core.drop_taken(entry, DropReason.SESSION_CLOSED)
            elif not core.still_valid(entry):
                core.drop_taken(entry, DropReason.CANCELLED_AUDIO)
            else:
                payload = entry.event.text.encode("utf-8", "surrogatepass")
                parts.append(_text_frame_header(len(payload)))
                parts.append(payload)
                written.append((entry, taken_at))
        if parts:
            assert transport is not None
            transport.writelines(parts)
            now = self._clock()
            for entry, taken_at in written:
                core.delivered(entry, now, release=False)
                self._observer.delivered(entry, taken_at)
        self._observer.after_core_call(self)

    async def _deliver(self) -> None:
        core = self.core
        client = self.client
        try:
            async with asyncio.timeout(None) as deadline:
                self._deadline = deadline
                while True:
                    if core.state is SessionState.CLOSED:
                        break
                    if core.state is SessionState.CLOSING:
                        self._arm_close_deadline()
                    if self._ping_client or self._ping_upstream:
                        await self._send_pings()
                    if not core.buffer.has_output():
                        self._wake.clear()
                        self._delivery_idle = True
                        try:
                            await self._wake.wait()
                        finally:
                            self._delivery_idle = False
                        continue
                    protocol = self._protocol
                    if protocol is not None and protocol.writing_paused:
                        # Write only below the client transport's high-water mark.
                        with contextlib.suppress(ConnectionError, RuntimeError):
                            await protocol._drain_helper()
                    if client.closed:
                        break
                    self._flush_batch()  # what the fast path took goes first
                    now = self._clock()
                    entry = core.next_delivery(now)
                    if entry is None:
                        continue
                    try:
                        await client.send_str(entry.event.text)
                    except (ConnectionError, RuntimeError) as exc:
                        self.log.info("client write failed: %s", exc)
                        break
                    core.delivered(entry, self._clock())
                    self._observer.delivered(entry, now)
                    self._observer.after_core_call(self)
                    if entry.closure:
                        break
        except TimeoutError:
            self.log.info("client did not take the final events in time; aborting")
            transport = getattr(self._protocol, "transport", None)
            if transport is not None:
                transport.abort()
        await self._wind_down()

    async def _wind_down(self) -> None:
        """Close the client with the decided code, then the engine side politely."""
        core = self.core
        code = core.close_code if core.close_code is not None else CLOSE_NORMAL
        self._flush_batch()
        if not self.client.closed:
            # Stop our own reader first: with a reader waiting, aiohttp's close()
            # drops the connection right after sending Close, and the client
            # would see 1006 instead of our code. Without it, close() waits
            # (up to close_timeout) for the client's Close reply.
            await self._stop_reader()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._close_timeout):
                    await self.client.close(code=code, message=self._close_message())
        if core.state is not SessionState.CLOSED:
            core.client_gone()
        await self._flush_upstream_commands()
        if not self._upstream_gone.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._upstream_close_timeout):
                    await _first(self._upstream_session_closed, self._upstream_gone)
        intake = self._intake
        if intake is not None and not intake.done():
            intake.cancel()  # our own task: the engine had its chance to answer
            with contextlib.suppress(asyncio.CancelledError):
                await intake
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._close_timeout):
                await self.upstream.close()
        # Unblock the client reader if the client never answered our close.
        if not self._client_gone.is_set():
            transport = getattr(self._protocol, "transport", None)
            if transport is not None and not self.client.closed:
                transport.abort()

    async def _stop_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def _close_message(self) -> bytes:
        outcome = self.core.outcome
        return b"" if outcome is None else outcome.value.encode()

    async def _close_both(self) -> None:
        if not self.client.closed:
            await self.client.close(code=self.core.close_code or CLOSE_NORMAL)
        if not self.upstream.closed:
            await self.upstream.close()


def _text_frame_header(length: int) -> bytes:
    """RFC 6455 §5.2 header of an unmasked, final text frame (server to client)."""
    if length < 126:
        return bytes((0x81, length))
    if length < 65536:
        return struct.pack("!BBH", 0x81, 126, length)
    return struct.pack("!BBQ", 0x81, 127, length)


class _NeverPaused:
    writing_paused = False


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of the events is set."""
    while not any(e.is_set() for e in events):
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


def tune_client_socket(request: web.Request, write_buffer_bytes: int) -> Any:
    """Bound what the transport and kernel hold for this client; return its protocol."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.set_write_buffer_limits(high=write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
    return request.protocol
