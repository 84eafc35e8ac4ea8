"""The per-session relay: a thin coordinator around ``SessionCore``.

It wires four parts, each with one job (docs/design.md, Relay shell):

- :class:`~omni_sidecar.core.session.SessionCore` decides (no I/O);
- :class:`~omni_sidecar.session.writer.ClientFrameWriter` owns every byte written to
  the client (events, pings, pongs, the close frame), within the write bound,
  re-checking each event when it is written;
- :class:`~omni_sidecar.session.engine_link.UpstreamLink` is the engine connection;
- :class:`~omni_sidecar.session.timers.SessionTimers` keeps time (keepalive, idle,
  duration, close deadline) on an injected scheduler.

Three tasks in one TaskGroup:

1. client → upstream: read a client frame, let the core classify it (cancel
   triggers act at once), forward the original text.
2. upstream → client (intake): the engine link runs and pushes each engine
   frame into :meth:`Relay.upstream_text` as it is parsed (no await per
   event); the core filters it and queues it in the session's OutputBuffer.
   Intake never waits on the client, so the engine is always read at full
   speed. When the client transport is below its mark it also asks the
   writer to write what is ready (the fast path: no task switch per event).
3. delivery: once the client transport drains, write what is ready; send the
   upstream keepalive pings; close both sides when the session ends.

What can still be in flight after a cancel: what the transport
(``client_write_buffer_bytes``) and the kernel send buffer (set to the same
size; Linux doubles it) hold, plus whatever the client's own receive buffer
took. An event is taken only while the transport is below the mark, so a
reader that keeps up hears at most about one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import aiohttp

from omni_sidecar.core.buffer import Entry
from omni_sidecar.core.events import ClientKind, EventKind
from omni_sidecar.core.session import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    Outcome,
    SessionCore,
    SessionState,
)
from omni_sidecar.session.engine_link import UpstreamLink
from omni_sidecar.session.timers import LoopScheduler, Scheduler, SessionTimers, Side
from omni_sidecar.session.writer import ClientFrameWriter

if TYPE_CHECKING:
    from omni_sidecar.session.observer import SessionObserver

__all__ = ["ACK_RIDE_WAIT", "ClientSocket", "Relay", "new_event_id"]

log = logging.getLogger(__name__)

#: Client frames that count against max_client_frame_rate (control frames do not).
_DATA_FRAMES: Final = frozenset({aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY})
#: While the client streams, a due playback ack waits this many ack intervals
#: for a client frame to ride along with before its timer sends it alone.
ACK_RIDE_WAIT: Final = 1.0
#: The client reader yields to the event loop every 16 frames.
_YIELD_EVERY_MASK: Final = 15


def new_event_id() -> str:
    return "event_" + uuid.uuid4().hex


class ClientSocket(Protocol):
    """What the relay uses of aiohttp's ``WebSocketResponse`` (reading and the
    close handshake; every write goes through the frame writer)."""

    @property
    def closed(self) -> bool: ...

    async def receive(self) -> aiohttp.WSMessage: ...

    async def close(self, *, code: int = ..., message: bytes = ...) -> bool: ...


class Relay:
    """One client session and its upstream connection.

    Args:
        session_key: our own id for logs and /debug/sessions.
        client: the prepared client WebSocket (reads and the close handshake).
        client_protocol: aiohttp's protocol under ``client`` (flow control).
        upstream: the engine connection.
        core: the session policy.
        observer: metrics and registry hooks.
        close_timeout: seconds to deliver the final events once closing.
        drain_timeout: seconds to deliver what is queued when the engine is lost.
        upstream_close_timeout: seconds to wait for the engine's ``session.closed``.
        max_pending_input_bytes: unsent bytes toward the engine; 0 = off.
        write_buffer_bytes: the client write bound.
        max_session_duration, client_idle_timeout, heartbeat_interval: timers; 0 = off.
        scheduler: time and timers (the running loop by default).
        call_soon: end-of-tick callback scheduling (the running loop's by default).
        client_address: for logs and /debug/sessions.
        client_push: turns on aiohttp's hand-over of parsed client text frames
            (``omni_sidecar.compat.push_text`` bound to the client); None: read them
            from aiohttp's queue.
    """

    def __init__(
        self,
        *,
        session_key: str,
        client: ClientSocket,
        client_protocol: Any,
        upstream: UpstreamLink,
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
        scheduler: Scheduler | None = None,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
        client_address: str = "",
        client_push: Callable[[Callable[[str], None] | None], bool] | None = None,
    ) -> None:
        self.key = session_key
        self.client = client
        self.upstream = upstream
        self.core = core
        self.client_address = client_address
        self._observer = observer
        self._close_timeout = close_timeout
        self._drain_timeout = drain_timeout
        self._upstream_close_timeout = upstream_close_timeout
        self._max_pending_input = max_pending_input_bytes
        self._scheduler = scheduler if scheduler is not None else LoopScheduler()
        self._clock = self._scheduler.time
        if call_soon is None:
            call_soon = asyncio.get_running_loop().call_soon
        self.writer = ClientFrameWriter(
            client_protocol,
            core,
            self,
            write_buffer_bytes=write_buffer_bytes,
            clock=self._clock,
            call_soon=call_soon,
            upstream_backlog=upstream.backlog,
        )
        self.timers = SessionTimers(
            self._scheduler,
            self,
            heartbeat_interval=heartbeat_interval,
            client_idle_timeout=client_idle_timeout,
            max_session_duration=max_session_duration,
        )
        self.started_at = self.timers.started_at
        self._wake = asyncio.Event()
        self._ping_upstream = False
        self._upstream_session_closed = asyncio.Event()
        self._upstream_gone = asyncio.Event()
        self._client_gone = asyncio.Event()
        #: The client was cut off for flooding: its reads are paused.
        self._flooded = False
        #: When a client frame last went to the engine (due acks ride along).
        self._forwarded_at = -math.inf
        #: Turns aiohttp's push of parsed client text frames on (a handler) or
        #: off (None); False while frames are still queued (see _client_to_upstream).
        self._install_push = client_push
        self._pushing = False
        #: Client reading is paused until the engine link drains.
        self._paused_for_upstream = False
        upstream.on_drained = self._upstream_drained
        self._intake: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self.bytes_client_to_upstream = 0
        self.bytes_upstream_to_client = 0
        self.log = logging.LoggerAdapter(log, {"session": session_key})

    # -- entry points used by the app ---------------------------------------------------

    async def run(self) -> None:
        """Relay until both sides are closed. Never raises for peer behaviour."""
        self.timers.start()
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
            self.timers.cancel()
            self.core.finish()
            self._observer.session_observations(self.core)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._close_timeout):
                    await self._close_both()

    def shutdown(self) -> None:
        """Proxy shutdown after the drain deadline: ``session.closed`` {shutdown}, 1001."""
        self.core.shutdown(self._clock())
        self._after_core_call()

    def engine_unavailable(self) -> None:
        """The supervisor saw the engine die: fail this session now."""
        self.core.upstream_lost(self._clock())
        self._after_core_call()
        # The engine socket may linger half-open; stop waiting for its session.closed.
        self._upstream_session_closed.set()

    def end_for_quota(self, message: str) -> None:
        """The key's day audio quota ran out: ``error`` {quota_exceeded}, then 1008."""
        self.log.info("audio_seconds_per_day of the key used up; closing")
        self.core.end_for_quota(self._clock(), message)
        self._after_core_call()

    def shed(self) -> None:
        """Process-wide pending cap exceeded and this is the largest session."""
        self.core.close_for_overflow(self._clock())
        self._after_core_call()

    @property
    def close_code_sent(self) -> int | None:
        """The close code the client was actually sent (None: no close frame reached it)."""
        return self.writer.close_code_sent

    # -- timers (TimerListener) ----------------------------------------------------------

    def ping_due(self, side: Side) -> None:
        if side == "client":
            self.writer.ping()
        else:
            self._ping_upstream = True
            self._wake.set()

    def peer_gone(self, side: Side, silent: float) -> None:
        self.log.info("%s silent for %.1f s (no pong): gone", side, silent)
        if side == "client":
            self.writer.abort()
        else:
            self.upstream.abort()

    def client_idle(self, idle: float) -> None:
        self.log.info("client idle for %.1f s; closing", idle)
        self.core.end(
            self._clock(),
            reason="client_idle_timeout",
            code=CLOSE_NORMAL,
            outcome=Outcome.CLIENT_CLOSED,
        )
        self._after_core_call()

    def duration_reached(self) -> None:
        self.log.info("max_session_duration reached")
        self.core.end(
            self._clock(),
            reason="max_session_duration",
            code=CLOSE_NORMAL,
            outcome=Outcome.CLIENT_CLOSED,
        )
        self._after_core_call()

    def close_deadline_passed(self) -> None:
        self.log.info("client did not take the final events in time; aborting")
        self.writer.abort()
        self._wake.set()

    def pace_due(self) -> None:
        writer = self.writer
        if not writer.paused:
            writer.pump(self._clock())
        self._after_core_call()

    def playback_due(self) -> None:
        core = self.core
        now = self._clock()
        when = core.playback_tick(now)
        if when is not None:
            self._arm_playback(when, now)
        if core.has_upstream_commands and not self._send_commands_now():
            self._wake.set()  # the delivery task sends them (sending awaits)

    def _arm_playback(self, when: float, now: float) -> None:
        """Arm the ack timer; while the client streams, an interval late.

        A due ack rides along with the next client frame sent to the engine
        (one write for both); the timer only sends those that found no ride
        within an interval (``ACK_RIDE_WAIT``): any client that streams audio
        in chunks of up to one interval offers a ride first.
        """
        interval = self.core.playback.settings.ack_interval
        if now - self._forwarded_at < interval:
            when += interval * ACK_RIDE_WAIT
        self.timers.arm_playback(when)

    def _send_commands_now(self) -> bool:
        """Send the core's engine commands without awaiting, where the link can.

        Returns:
            False when the link sends only by awaiting (the caller wakes a task).
        """
        upstream = self.upstream
        if not upstream.sends_without_waiting:
            return False
        if not self._upstream_gone.is_set():
            for text in self.core.events_to_upstream():
                upstream.send_nowait(text)
        return True

    def upstream_close_timed_out(self) -> None:
        if self.core.state is not SessionState.OPEN:
            return
        self.log.info(
            "engine did not answer session.close within %.1f s; closing",
            self._upstream_close_timeout,
        )
        self.core.end(
            self._clock(),
            reason="upstream_timeout",
            code=CLOSE_NORMAL,
            outcome=Outcome.CLIENT_CLOSED,
        )
        self._upstream_session_closed.set()  # stop waiting for it later, too
        self._after_core_call()

    # -- the writer (DeliveryHooks) ------------------------------------------------------

    def delivered(self, entry: Entry, taken_at: float) -> None:
        self._observer.delivered(entry, taken_at)

    def written(self) -> None:
        core = self.core
        if core.playback.acking and not self.timers.playback_armed:
            now = self._clock()
            when = core.playback.next_ack_at(now)
            if when is not None:
                self._arm_playback(when, now)
        self._observer.after_core_call(core)

    def blocked(self) -> None:
        self._wake.set()

    # -- client → upstream -----------------------------------------------------------------

    async def _client_to_upstream(self) -> None:
        client = self.client
        core = self.core
        timers = self.timers
        writer = self.writer
        budget_events = core.settings.buffer.max_pending_output_events
        frames = 0
        push = self.client_text_pushed if self.upstream.sends_without_waiting else None
        try:
            while True:
                if push is not None and not self._pushing and not self._flooded:
                    # Only once aiohttp's queue is empty, so no frame overtakes
                    # one queued before it; then text frames skip the queue.
                    self._push_text(push)
                msg = await client.receive()
                if self._flooded:
                    # Cut off while frames were pushed: read none of what aiohttp
                    # queued (its queue stays full, so it keeps the socket paused).
                    await asyncio.Event().wait()  # until wind-down cancels us
                frames += 1
                if not frames & _YIELD_EVERY_MASK:
                    # aiohttp returns queued frames without suspending: yield now
                    # and then so a flooding client cannot starve other sessions.
                    await asyncio.sleep(0)
                now = self._clock()
                timers.last_client_frame = now
                kind = msg.type
                if kind is aiohttp.WSMsgType.PING:
                    writer.pong(msg.data)
                    if (
                        writer.unanswered_pings + len(core.buffer) > budget_events
                        and core.state is SessionState.OPEN
                    ):
                        # Each unanswered ping counts as one event of the output budget.
                        self.log.warning("client keeps pinging without reading; overflow")
                        core.control_overflow(now)
                        self._after_core_call()
                    continue
                if kind is aiohttp.WSMsgType.PONG:
                    continue
                timers.last_client_event = now
                if kind in _DATA_FRAMES and not self._admit(len(msg.data), now):
                    if self._flooded:
                        await asyncio.Event().wait()  # until wind-down cancels us
                    continue
                if kind is aiohttp.WSMsgType.TEXT:
                    # Frames queued before the push path was on, or all of them
                    # with a link that sends only by awaiting.
                    for frame in self._client_text(msg.data, now):
                        await self._send_upstream(frame)
                    await self.upstream.wait_drained()
                elif kind is aiohttp.WSMsgType.BINARY:
                    core.reject_client_frame(
                        "binary_unsupported",
                        "binary frames are not supported; send JSON text frames",
                        now,
                        size=len(msg.data),
                    )
                    self._observer.client_event(len(msg.data), forwarded=False)
                    self._after_core_call()
                else:
                    # CLOSE, CLOSING, CLOSED or ERROR (aiohttp already answered
                    # an oversized frame with 1009, through our writer).
                    if kind is aiohttp.WSMsgType.ERROR:
                        self.log.info("client error: %s", msg.data)
                    break
        finally:
            self._push_text(None)
            self._client_gone.set()
            if core.state is not SessionState.CLOSED and not core.buffer.closure_delivered:
                core.client_gone()
            self._after_core_call()
            with contextlib.suppress(Exception):
                await self._flush_upstream_commands()

    def _admit(self, size: int, now: float) -> bool:
        """The frame-rate limit; a client over it that the core ends is cut off."""
        core = self.core
        if core.admit_client_frame(size, now):
            return True
        self._observer.client_event(size, forwarded=False)
        self._after_core_call()
        if core.state is not SessionState.OPEN:
            # Ending for flooding: read none of its backlog (parsing it would
            # cost every other session CPU until the socket closes); the close
            # frame goes out without waiting for a reply.
            self._flooded = True
            self._push_text(None)
            self.writer.pause_reading()
        return False

    def client_text_pushed(self, text: str) -> None:
        """A client text frame handed over by aiohttp's parser as it is parsed.

        The push path (``omni_sidecar.compat.push_text``): no queue, no task wake-up
        per frame. Only with an engine link that sends without waiting; when
        that link is above its mark, the client is not read until it drains.
        """
        now = self._clock()
        timers = self.timers
        timers.last_client_frame = now
        timers.last_client_event = now
        if self._admit(len(text), now):
            frames = self._client_text(text, now)
            if not self._upstream_gone.is_set():
                for frame in frames:
                    self.upstream.send_nowait(frame)
        elif self._pushing:
            # Over the frame-rate limit: back to aiohttp's queue, whose flow
            # control (and the reader's yield every few frames) paces a
            # flooding client; the reader turns the push on again once the
            # queue is empty.
            self._push_text(None)
        upstream = self.upstream
        if upstream.write_paused and not self._flooded:
            self.writer.pause_reading()
            self._paused_for_upstream = True

    def _upstream_drained(self) -> None:
        if self._paused_for_upstream:
            self._paused_for_upstream = False
            if not self._flooded:
                self.writer.resume_reading()

    def _client_text(self, text: str, now: float) -> list[str]:
        """Handle one admitted client text frame.

        Returns:
            The frames for the engine, in order: what the core asks to send
            because of it first (a cancel's truncation: what the user heard),
            then the frame itself when it is forwarded, then what follows it
            (acks riding along).
        """
        core = self.core
        decision = core.receive_client(text, now)
        event = decision.event
        if event.kind is ClientKind.SESSION_CLOSE and decision.forward:
            self.timers.arm_upstream_close(self._upstream_close_timeout)
        kind = event.kind
        self._observer.client_event(
            event.size, forwarded=decision.forward, audio=kind is ClientKind.AUDIO_APPEND
        )
        if event.cancels or kind is ClientKind.RESPONSE_CREATE:
            # Before the core call's news reaches the observer: a cancel is
            # then attributed to this event (never reached per audio append).
            tracer = self._observer.tracer
            if tracer is not None:
                tracer.client_event(event)
        out = core.events_to_upstream() if core.has_upstream_commands else []
        if decision.forward:
            ahead = sum(len(frame) for frame in out) if out else 0
            if self._input_over(ahead + event.size):
                self._fail_input(now)
            else:
                self.bytes_client_to_upstream += event.size
                out.append(text)
                self._forwarded_at = now
                if core.playback.acking:
                    core.ride_along_acks(now)
        self._after_core_call()
        if core.has_upstream_commands:
            out += core.events_to_upstream()
        return out

    def _input_over(self, size: int) -> bool:
        """Forwarding ``size`` more bytes would exceed ``max_pending_input_bytes``."""
        return self.upstream.input_backlog() + size > self._max_pending_input > 0

    def _fail_input(self, now: float) -> None:
        self.log.warning("engine is not reading input; failing the session")
        self.core.end(
            now,
            reason="input_backpressure",
            code=CLOSE_POLICY_VIOLATION,
            outcome=Outcome.OVERFLOW,
            error_code="input_backpressure",
            error_message="the engine is not accepting input; more than "
            f"{self._max_pending_input} bytes are waiting",
        )

    def _push_text(self, handler: Callable[[str], None] | None) -> bool:
        """Hand client text frames to ``handler`` as they are parsed (None: queue them).

        Returns:
            True when the hand-over is now as asked.
        """
        install = self._install_push
        done = install is not None and install(handler)
        self._pushing = done and handler is not None
        return done

    async def _send_upstream(self, text: str) -> None:
        if self._upstream_gone.is_set():
            return
        await self.upstream.send(text)

    async def _flush_upstream_commands(self) -> None:
        for text in self.core.events_to_upstream():
            await self._send_upstream(text)

    # -- upstream → client (intake) --------------------------------------------------------------

    async def _upstream_to_client(self) -> None:
        clean = False
        try:
            clean = await self.upstream.run(self)
            if not self._upstream_session_closed.is_set():
                self.log.info(
                    "upstream closed (code %s) without session.closed", self.upstream.close_code
                )
        finally:
            self._upstream_gone.set()
            if not self._upstream_session_closed.is_set():
                self.core.upstream_lost(self._clock(), clean=clean)
            self._after_core_call()

    # -- the engine link (UpstreamHandler): called per engine frame, no await ------------------

    def upstream_text(self, text: str) -> bool:
        now = self._clock()
        self.timers.last_upstream_frame = now
        core = self.core
        event = core.receive_upstream(text, now)
        self._observer.upstream_event(event)
        self.bytes_upstream_to_client += event.size
        if event.kind is EventKind.SESSION_CLOSED:
            self._upstream_session_closed.set()
        writer = self.writer
        written = writer.frames_written
        if not writer.paused:
            # Fast path: the client can take it; write now instead of waking
            # the delivery task (saves a task switch per event).
            writer.pump(now, defer=True)
        self._after_core_call(synced=writer.frames_written != written)
        return core.has_upstream_commands

    def upstream_binary(self, size: int) -> None:
        now = self._clock()
        self.timers.last_upstream_frame = now
        event = self.core.receive_upstream("\x00binary", now)
        self._observer.upstream_event(event)
        self.log.warning("upstream sent a binary frame (%d bytes); dropped", size)

    def upstream_alive(self) -> None:
        self.timers.last_upstream_frame = self._clock()

    def take_upstream_commands(self) -> list[str]:
        if self._upstream_gone.is_set():
            return []
        return self.core.events_to_upstream()

    # -- delivery -------------------------------------------------------------------------------

    def _after_core_call(self, *, synced: bool = False) -> None:
        """Timers, the delivery task and metrics after the core changed.

        Args:
            synced: the writer just reported a write (``written``), which
                synced the metrics with this very state: not again.
        """
        core = self.core
        if core.paced_until is not None:
            self.timers.arm_pace(core.paced_until)
        if core.ready() or core.state is not SessionState.OPEN:
            self._wake.set()
            if core.state is SessionState.CLOSING:
                self._arm_close_deadline()
        if not synced:
            self._observer.after_core_call(core)

    def _arm_close_deadline(self) -> None:
        """A closing session gets a bounded time to deliver its last events,
        also while delivery is blocked on a client that stopped reading."""
        budget = (
            self._drain_timeout
            if self.core.outcome is Outcome.ENGINE_UNAVAILABLE
            else self._close_timeout
        )
        self.timers.arm_close_deadline(budget)

    async def _deliver(self) -> None:
        core = self.core
        writer = self.writer
        buffer = core.buffer
        while True:
            if self._ping_upstream:
                self._ping_upstream = False
                await self.upstream.ping()
            if core.has_upstream_commands and core.state is SessionState.OPEN:
                await self._flush_upstream_commands()  # playback acks
            if core.state is SessionState.CLOSED and not writer.has_pending:
                break
            if writer.gone or writer.close_sent:
                break  # nothing more can be written (a close frame went out)
            if core.state is SessionState.CLOSING:
                self._arm_close_deadline()
            if writer.paused and (writer.has_pending or buffer.has_output()):
                # Write only below the client transport's high-water mark.
                try:
                    await writer.wait_writable()
                except (ConnectionError, RuntimeError):
                    break
                continue
            writer.pump(self._clock())
            self._after_core_call()
            if core.state is SessionState.CLOSED and not writer.has_pending:
                break
            if not writer.has_pending and not core.ready():
                # Nothing to write now (or pacing holds it: its timer wakes us).
                self._wake.clear()
                await self._wake.wait()
        await self._wind_down()

    async def _wind_down(self) -> None:
        """Close the client with the decided code, then the engine side politely."""
        core = self.core
        code = core.close_code if core.close_code is not None else CLOSE_NORMAL
        writer = self.writer
        writer.flush(force=True)
        if self._flooded:
            await self._stop_reader()
            writer.close(code, self._close_message())
            writer.close_transport()  # after the close frame; no reply awaited
        elif not self.client.closed and not writer.gone:
            # Stop our own reader first: with a reader waiting, aiohttp's close()
            # drops the connection right after sending Close, and the client
            # would see 1006 instead of our code. Without it, close() waits
            # (up to close_timeout) for the client's Close reply. The close
            # frame itself goes through our writer (installed as aiohttp's).
            await self._stop_reader()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._close_timeout):
                    await self.client.close(code=code, message=self._close_message())
        writer.discard()
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
        if not self._client_gone.is_set() and not self.client.closed:
            writer.abort()

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
        await self.upstream.close()


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of the events is set."""
    while not any(e.is_set() for e in events):
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
