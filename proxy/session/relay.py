"""The per-session relay: a thin coordinator around ``SessionCore``, its only caller.

It wires the session's parts (docs/design.md, Relay shell): the core decides;
the :class:`~proxy.session.writer.ClientFrameWriter` is the sink for
everything written to the client; the
:class:`~proxy.session.client_reader.ClientReader` brings client frames
in through :meth:`Relay.client_text`; the engine link pushes engine frames in
through :meth:`Relay.upstream_text` and sends what it answers; the
:class:`~proxy.session.timers.SessionTimers` call back when time is up.

Three tasks in one TaskGroup: the client reader; the intake (the engine
link's ``run``: it never waits on the client, so the engine is always read at
full speed, and while the client transport is below its mark it writes what
is ready at once, without a task switch per event); and delivery (once the
client transport drains, write what is ready, send keepalive pings, close
both sides when the session ends).

What can still be in flight after a cancel: what the transport
(``client_write_buffer_bytes``) and the kernel send buffer hold, plus the
client's own receive buffer. An event is taken only while the transport is
below the mark, so a reader that keeps up hears at most about one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from proxy.core.buffer import Entry
from proxy.core.events import ClientKind, EventKind
from proxy.core.session_core import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    DropReason,
    Outcome,
    SessionCore,
    SessionState,
)
from proxy.session.client_reader import ClientReader, ClientSocket, TextPush
from proxy.session.limits import RelayLimits
from proxy.session.tasks import cancel_and_wait, first_set
from proxy.session.timers import LoopScheduler, Scheduler, SessionTimers, Side
from proxy.session.upstream_link import NO_COMMANDS, UpstreamLink
from proxy.session.writer import ClientFrameWriter

if TYPE_CHECKING:
    from proxy.session.observer import SessionObserver

__all__ = ["ACK_RIDE_WAIT", "ClientSocket", "Relay", "new_event_id", "pump"]

log = logging.getLogger(__name__)

#: While the client streams, a due playback ack waits this many ack intervals
#: for a client frame to ride along with before its timer sends it alone.
ACK_RIDE_WAIT: Final = 1.0


def new_event_id() -> str:
    return "event_" + uuid.uuid4().hex


def pump(core: SessionCore, writer: ClientFrameWriter, now: float, *, defer: bool = False) -> None:
    """Take what the core has ready, within the writer's bound, and hand it to the writer.

    Nothing is taken while the client transport is above its mark or after the
    close frame (``ClientFrameWriter.start_batch``).

    Args:
        now: the time the events are taken (their queue delay ends here).
        defer: the caller is the engine reader (see ``ClientFrameWriter.end_batch``).
    """
    room = writer.start_batch()
    if room is None:
        return
    if room:
        buffer = core.buffer
        while buffer.has_output():
            entry = core.next_delivery(now)
            if entry is None:
                break
            buffer.release_held()
            if not writer.take(entry, now) or entry.closure:
                break
    writer.end_batch(defer=defer)


class Relay:
    """One client session and its upstream connection.

    Args:
        session_key: our own id for logs and /debug/sessions.
        client: the prepared client WebSocket (reads and the close handshake).
        client_protocol: aiohttp's protocol under ``client`` (flow control).
        upstream: the engine connection.
        core: the session policy.
        observer: metrics and registry hooks.
        limits: the shell's bounds and deadlines (:class:`RelayLimits`).
        scheduler: time and timers (the running loop by default).
        call_soon: end-of-tick callback scheduling (the running loop's by default).
        client_address: for logs and /debug/sessions.
        client_push: turns on aiohttp's hand-over of parsed client text frames
            (``proxy.compat.push_text`` bound to the client); None: read them
            all from aiohttp's queue.
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
        limits: RelayLimits,
        scheduler: Scheduler | None = None,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
        client_address: str = "",
        client_push: TextPush | None = None,
    ) -> None:
        self.key = session_key
        self.client = client
        self.upstream = upstream
        self.core = core
        self.client_address = client_address
        self._observer = observer
        self._close_timeout = limits.close_timeout
        self._drain_timeout = limits.drain_timeout
        self._upstream_close_timeout = limits.upstream_close_timeout
        self._max_pending_input = limits.max_pending_input_bytes
        self._scheduler = scheduler if scheduler is not None else LoopScheduler()
        self._clock = self._scheduler.time
        if call_soon is None:
            call_soon = asyncio.get_running_loop().call_soon
        self.writer = ClientFrameWriter(
            client_protocol,
            self,
            still_valid=core.still_valid,
            write_buffer_bytes=limits.write_buffer_bytes,
            clock=self._clock,
            call_soon=call_soon,
            upstream_backlog=upstream.backlog,
        )
        self.timers = SessionTimers(
            self._scheduler,
            self,
            heartbeat_interval=limits.heartbeat_interval,
            client_idle_timeout=limits.client_idle_timeout,
            max_session_duration=limits.max_session_duration,
        )
        self.started_at = self.timers.started_at
        self._wake = asyncio.Event()
        self._ping_upstream = False
        self._upstream_session_closed = asyncio.Event()
        self._upstream_gone = asyncio.Event()
        self._client_gone = asyncio.Event()
        #: When a client frame last went to the engine (due acks ride along).
        self._forwarded_at = -math.inf
        self.reader = ClientReader(client, self, client_protocol, upstream, client_push)
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
                self._reader = tg.create_task(self.reader.run(), name=f"{self.key}:client")
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
        self._end_normally("client_idle_timeout")

    def duration_reached(self) -> None:
        self.log.info("max_session_duration reached")
        self._end_normally("max_session_duration")

    def _end_normally(self, reason: str) -> None:
        """End the session with ``session.closed`` {reason} and close code 1000."""
        self.core.end(
            self._clock(), reason=reason, code=CLOSE_NORMAL, outcome=Outcome.CLIENT_CLOSED
        )
        self._after_core_call()

    def close_deadline_passed(self) -> None:
        self.log.info("client did not take the final events in time; aborting")
        self.writer.abort()
        self._wake.set()

    def pace_due(self) -> None:
        pump(self.core, self.writer, self._clock())  # nothing while the client is paused
        self._after_core_call()

    def playback_due(self) -> None:
        core = self.core
        now = self._clock()
        when = core.playback_tick(now)
        if when is not None:
            self._arm_playback(when, now)
        if core.has_upstream_commands:
            self._send_commands()

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

    def _send_commands(self) -> None:
        """Send the core's engine commands now (the link writes them at the end of the tick)."""
        if self._upstream_gone.is_set():
            return
        send = self.upstream.send_nowait
        for text in self.core.events_to_upstream():
            send(text)

    def upstream_close_timed_out(self) -> None:
        if self.core.state is not SessionState.OPEN:
            return
        self.log.info(
            "engine did not answer session.close within %.1f s; closing",
            self._upstream_close_timeout,
        )
        self._upstream_session_closed.set()  # stop waiting for it later, too
        self._end_normally("upstream_timeout")

    # -- the writer (DeliveryHooks) ------------------------------------------------------

    def delivered(self, entry: Entry, taken_at: float, now: float) -> None:
        self.core.delivered(entry, now, release=False)
        self._observer.delivered(entry, taken_at)

    def dropped(self, entry: Entry, reason: DropReason) -> None:
        self.core.drop_taken(entry, reason)

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

    def client_text(self, text: str) -> None:
        """One client text frame, pushed by aiohttp's parser or read from its queue.

        When the engine link is above its mark afterwards, the client is not
        read until it drains.
        """
        now = self._clock()
        timers = self.timers
        timers.last_client_frame = now
        timers.last_client_event = now
        if self._admit(len(text), now):
            frames = self._client_text(text, now)
            if not self._upstream_gone.is_set():
                send = self.upstream.send_nowait
                for frame in frames:
                    send(frame)
        else:
            self.reader.over_rate()
        if self.upstream.write_paused:
            self.reader.pause_for_upstream()

    def client_binary(self, size: int) -> None:
        now = self._clock()
        timers = self.timers
        timers.last_client_frame = now
        timers.last_client_event = now
        if not self._admit(size, now):
            return
        self.core.reject_client_frame(
            "binary_unsupported",
            "binary frames are not supported; send JSON text frames",
            now,
            size=size,
        )
        self._observer.client_event(size, forwarded=False)
        self._after_core_call()

    def client_ping(self, payload: bytes) -> None:
        now = self._clock()
        self.timers.last_client_frame = now
        core = self.core
        writer = self.writer
        writer.pong(payload)
        budget_events = core.settings.buffer.max_pending_output_events
        if (
            writer.unanswered_pings + len(core.buffer) > budget_events
            and core.state is SessionState.OPEN
        ):
            # Each unanswered ping counts as one event of the output budget.
            self.log.warning("client keeps pinging without reading; overflow")
            core.control_overflow(now)
            self._after_core_call()

    def client_control(self) -> None:
        self.timers.last_client_frame = self._clock()

    def client_error(self, error: object) -> None:
        self.log.info("client error: %s", error)

    def client_ended(self) -> None:
        self._client_gone.set()
        core = self.core
        if core.state is not SessionState.CLOSED and not core.buffer.closure_delivered:
            core.client_gone()
        self._after_core_call()
        self._send_commands()

    def _admit(self, size: int, now: float) -> bool:
        """The frame-rate limit; a client over it that the core ends is cut off."""
        core = self.core
        if core.admit_client_frame(size, now):
            return True
        self._observer.client_event(size, forwarded=False)
        self._after_core_call()
        if core.state is not SessionState.OPEN:
            # Ending for flooding: read none of its backlog.
            self.reader.cut()
        return False

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

    def upstream_text(self, text: str) -> Sequence[str]:
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
        # Fast path: while the client can take it, write now instead of waking
        # the delivery task (saves a task switch per event).
        pump(core, writer, now, defer=True)
        self._after_core_call(synced=writer.frames_written != written)
        if core.has_upstream_commands and not self._upstream_gone.is_set():
            return core.events_to_upstream()
        return NO_COMMANDS

    def upstream_binary(self, size: int) -> None:
        now = self._clock()
        self.timers.last_upstream_frame = now
        event = self.core.receive_upstream("\x00binary", now)
        self._observer.upstream_event(event)
        self.log.warning("upstream sent a binary frame (%d bytes); dropped", size)

    def upstream_alive(self) -> None:
        self.timers.last_upstream_frame = self._clock()

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
                self._send_commands()  # playback acks
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
            pump(core, writer, self._clock())
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
        if self.reader.cut_off:
            await cancel_and_wait(self._reader)
            writer.close(code, self._close_message())
            writer.close_transport()  # after the close frame; no reply awaited
        elif not self.client.closed and not writer.gone:
            # Stop our own reader first: with a reader waiting, aiohttp's close()
            # drops the connection right after sending Close, and the client
            # would see 1006 instead of our code. Without it, close() waits
            # (up to close_timeout) for the client's Close reply. The close
            # frame itself goes through our writer (installed as aiohttp's).
            await cancel_and_wait(self._reader)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._close_timeout):
                    await self.client.close(code=code, message=self._close_message())
        writer.discard()
        if core.state is not SessionState.CLOSED:
            core.client_gone()
        self._send_commands()
        if not self._upstream_gone.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._upstream_close_timeout):
                    await first_set(self._upstream_session_closed, self._upstream_gone)
        await cancel_and_wait(self._intake)  # the engine had its chance to answer
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._close_timeout):
                await self.upstream.close()
        # Unblock the client reader if the client never answered our close.
        if not self._client_gone.is_set() and not self.client.closed:
            writer.abort()

    def _close_message(self) -> bytes:
        outcome = self.core.outcome
        return b"" if outcome is None else outcome.value.encode()

    async def _close_both(self) -> None:
        if not self.client.closed:
            await self.client.close(code=self.core.close_code or CLOSE_NORMAL)
        await self.upstream.close()
