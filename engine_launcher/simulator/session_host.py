"""I/O shell of one simulated session, which may outlive the socket that opened it.

:class:`SessionHost` runs a :class:`DuplexSession` with two tasks in one
TaskGroup: a producer (the pace of audio chunks, the optional
``response.listen`` timer) and a pump that takes each frame in order and
awaits its ``send_str`` on whichever socket is attached, or drops it when none
is (it is journaled already). Sockets come and go (:class:`Attachment`); the
reader of each is in :mod:`engine_launcher.simulator.connection`.
:class:`SimulatorState` is what the process shares. docs/design.md, Simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from engine_launcher.simulator.audio import AudioBank
from engine_launcher.simulator.counters import SessionSlots, SimulatorStats
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.session_resume import (
    UNKNOWN_SESSION,
    EngineResumeRequest,
    Refusal,
    ResumeCredential,
    Resumed,
    ResyncRequired,
)
from engine_launcher.simulator.session_state import Phase

__all__ = ["CLOSE_TIMEOUT", "Attachment", "SessionHost", "SimulatorState"]

logger = logging.getLogger(__name__)

#: Bound on one socket's close handshake (and on telling a replaced socket so).
CLOSE_TIMEOUT: Final = 5.0


@dataclass(eq=False, slots=True)
class Attachment:
    """One WebSocket, and the session it serves.

    Attributes:
        ws: the prepared server-side socket.
        host: the session it serves (``None`` once it serves none).
    """

    ws: web.WebSocketResponse
    host: SessionHost | None = None


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
        slots: open sessions (attached or detached) against ``--max-sessions``.
        sockets: live WebSockets (``sessions_active``).
        hosts: live sessions, opened or not yet (closed at shutdown).
        by_id: opened sessions by id (resume, ``/debug/history``).
        no_sessions: set while there is neither a socket nor a session.
    """

    config: SimulatorConfig
    bank: AudioBank
    stats: SimulatorStats = field(default_factory=SimulatorStats)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    listening_since: float | None = None
    created: int = 0
    slots: SessionSlots = field(init=False)
    sockets: set[Attachment] = field(default_factory=set)
    hosts: set[SessionHost] = field(default_factory=set)
    by_id: dict[str, SessionHost] = field(default_factory=dict)
    no_sessions: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.no_sessions.set()
        self.slots = SessionSlots(self.config.max_sessions)

    def add_socket(self, attachment: Attachment) -> None:
        """Track a live socket (``sessions_active``, ``sessions_total``)."""
        self.sockets.add(attachment)
        self.no_sessions.clear()
        self.stats.sessions_active = len(self.sockets)
        self.stats.sessions_total += 1

    def discard_socket(self, attachment: Attachment) -> None:
        """Forget a finished socket."""
        self.sockets.discard(attachment)
        self.stats.sessions_active = len(self.sockets)
        self._maybe_idle()

    def add_host(self, host: SessionHost) -> None:
        """Track a live session (closed at shutdown)."""
        self.hosts.add(host)
        self.no_sessions.clear()

    def discard_host(self, host: SessionHost) -> None:
        """Forget a finished session."""
        self.hosts.discard(host)
        if self.by_id.get(host.session.session_id) is host:
            del self.by_id[host.session.session_id]
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.sockets and not self.hosts:
            self.no_sessions.set()

    @property
    def detached(self) -> int:
        """Sessions in their disconnect grace now."""
        return sum(1 for h in self.hosts if h.session.detached_at is not None)

    def resume(
        self, request: EngineResumeRequest, now: float
    ) -> tuple[SessionHost | None, Refusal | ResyncRequired | Resumed]:
        """Carry out ``request`` against the session it names (an unknown id is refused
        exactly like a wrong token)."""
        host = self.by_id.get(request.session_id)
        if host is None:
            ResumeCredential.verify_unknown(request.resume_token)
            return None, UNKNOWN_SESSION
        return host, host.session.resume(request, now)

    def reap(self, now: float) -> int:
        """Expire every detached session past its grace; how many."""
        expired = [h for h in self.hosts if h.session.grace_over(now)]
        for host in expired:
            host.expire()
        return len(expired)

    async def stall_gate(self) -> None:
        """Park forever once ``--stall-after`` fired (sockets stay open)."""
        if self.stalled.is_set():
            await asyncio.get_running_loop().create_future()


class _SessionEnded(Exception):
    """Raised by the pump to end the session's TaskGroup (the session is over)."""


class SessionHost:
    """Runs one session, attached to a socket or detached, until it ends.

    Args:
        session: the sans-I/O protocol core (possibly already opened).
        state: process-wide state.
    """

    def __init__(self, session: DuplexSession, state: SimulatorState) -> None:
        self.session = session
        self._state = state
        #: The socket the session's frames go to; ``None`` while detached.
        self.attachment: Attachment | None = None
        self._output_ready = asyncio.Event()
        self._responses: asyncio.Queue[str] = asyncio.Queue()
        self._wake = asyncio.Event()
        # What this session's queue last added to the process-wide gauges.
        self._counted_events = 0
        self._counted_bytes = 0
        self._registered = False
        state.add_host(self)

    async def run(self) -> None:
        """Produce and pump until the session ends; never raises for ordinary endings."""
        self.flush()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._produce_loop(), name="sim-producer")
                tg.create_task(self._pump(), name="sim-pump")
        except* _SessionEnded:
            pass
        except* Exception as group:
            # Only the top of the session turns an exception into a close, once.
            logger.error(
                "session %s failed", self.session.session_id or "-", exc_info=group.exceptions[0]
            )
        finally:
            self._state.discard_host(self)
            if self.session.holds_slot:
                self.session.holds_slot = False
                self._state.slots.release()
            self._state.stats.outbox_events -= self._counted_events
            self._state.stats.outbox_bytes -= self._counted_bytes
            attachment, self.attachment = self.attachment, None
            if attachment is not None and not attachment.ws.closed:
                attachment.host = None
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await attachment.ws.close(code=1011, message=b"internal_error")

    # ------------------------------------------------------------- attachments

    def attach(self, attachment: Attachment) -> None:
        """The socket that created this session serves it."""
        attachment.host = self
        self.attachment = attachment

    def socket_ended(self, attachment: Attachment) -> None:
        """``attachment`` dropped without a close: detach (resumable) or end the session."""
        if attachment is not self.attachment:
            return  # a replaced socket: the session is someone else's now
        self.attachment = None
        attachment.host = None
        now = asyncio.get_running_loop().time()
        if self.session.detach(now):
            logger.info(
                "session %s detached; resumable for %g s",
                self.session.session_id,
                self._state.config.disconnect_grace,
            )
        self.flush()

    def take_over(self, attachment: Attachment, resumed: Resumed) -> Attachment | None:
        """A resume attached ``attachment``; return the socket it replaced, if any."""
        old = self.attachment if resumed.replaced is not None else None
        if old is not None:
            old.host = None
        self.attach(attachment)
        self.flush()
        return old

    async def tell_replaced(self, old: Attachment, generation: int) -> None:
        """``session.replaced`` to the socket of ``generation``, which a resume took over,
        then close 1000 (bounded)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await old.ws.send_str(self.session.replaced_frame(generation))
                await old.ws.close(code=1000, message=b"session_replaced")

    def hand_over(self) -> None:
        """This never-opened session's socket resumed another one: end without a word."""
        if self.attachment is not None:
            self.attachment = None
        self.session.hand_over()
        self.flush()

    def expire(self) -> None:
        """The disconnect grace ran out."""
        self._state.stats.sessions_expired += 1
        logger.info("session %s expired: disconnect grace over", self.session.session_id)
        self.session.expire()
        self.flush()

    def request_close(self, reason: str, code: int) -> None:
        """Queue ``session.closed`` and a close frame (server shutdown)."""
        self.session.request_close(reason, code)
        self.flush()

    def flush(self) -> None:
        """Wake the pump for what the core queued; hand new responses to the producer."""
        session = self.session
        sid = session.session_id
        if sid and session.phase is Phase.OPEN and not self._registered:
            # With --deterministic every session has the same id: the newest one has it.
            self._registered = True
            self._state.by_id[sid] = self
        self._count_queued()
        self._output_ready.set()
        for response_id in session.responses_to_start():
            self._responses.put_nowait(response_id)
        self._wake.set()

    # --------------------------------------------------------------- internals

    def _count_queued(self) -> None:
        """Bring the process-wide queue gauges up to date with this session's queue."""
        stats = self._state.stats
        events, size = self.session.queued_events, self.session.queued_bytes
        stats.outbox_events += events - self._counted_events
        stats.outbox_bytes += size - self._counted_bytes
        self._counted_events, self._counted_bytes = events, size

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        stats = self._state.stats
        while True:
            item = self.session.next_outgoing(loop.time())
            if item is None:
                self._output_ready.clear()
                await self._output_ready.wait()
                continue
            self._count_queued()
            await self._state.stall_gate()
            target = self.attachment
            if isinstance(item, CloseFrame):
                self.attachment = None
                if target is not None:
                    target.host = None
                    # A client that never answers the close frame costs at most
                    # CLOSE_TIMEOUT; either way the session is finished.
                    with contextlib.suppress(ConnectionError, TimeoutError):
                        async with asyncio.timeout(CLOSE_TIMEOUT):
                            await target.ws.close(
                                code=item.code, message=item.reason.encode()[:123]
                            )
                raise _SessionEnded
            if target is None:
                continue  # detached: numbered and journaled, sent to nobody
            try:
                await target.ws.send_str(item)
            except ConnectionError:
                self.socket_ended(target)
                continue
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
                    await self._state.stall_gate()
                    self.session.produce_listen()
                    self.flush()
                    continue
            await self._stream(response_id)

    async def _stream(self, response_id: str) -> None:
        """Produce the chunks of one response at the configured pace."""
        loop = asyncio.get_running_loop()
        interval = self._state.config.chunk_interval
        deadline = loop.time()
        while self.session.is_active(response_id):
            if interval > 0:
                # Absolute schedule: chunk i is due i intervals after the start,
                # so handling time does not accumulate as drift.
                deadline += interval
                await self._sleep_until(deadline, response_id)
            else:
                await asyncio.sleep(0)  # let the reader see cancels between chunks
            await self._state.stall_gate()
            self.session.produce_chunk(response_id)
            self.flush()

    async def _sleep_until(self, deadline: float, response_id: str) -> None:
        """Sleep until ``deadline``, waking early if the response stops being active."""
        loop = asyncio.get_running_loop()
        while self.session.is_active(response_id):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                return
