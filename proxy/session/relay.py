"""The per-session relay: the I/O shell around ``SessionCore``, its only caller.

Frames and facts go into the core; after each call the relay does what its
drain says: write to the client, send upstream, arm one timer, report
(docs/design.md, Relay shell). One TaskGroup per session; a held session
outlives its client connection (docs/design.md, Resume).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from proxy.core.capabilities import EngineCapabilities
from proxy.core.drain import NOTHING
from proxy.core.lifecycle import EndReason, Fact, SessionPhase
from proxy.core.resume_state import HandOver
from proxy.core.session_core import ClientVerdict, SessionCore, SessionSettings
from proxy.core.view import SessionView
from proxy.session.client_side import ClientSide
from proxy.session.frames import ControlPayload
from proxy.session.lifetime import run_session
from proxy.session.limits import RelayLimits
from proxy.session.tasks import first_set
from proxy.session.timers import LoopScheduler, Scheduler, SessionTimers, Side
from proxy.session.upstream_link import UpstreamLink
from proxy.session.upstream_side import UpstreamSide

if TYPE_CHECKING:
    from proxy.session.observer import RelayObserver

__all__ = ["Relay"]

log = logging.getLogger(__name__)

_HELD = SessionPhase.HELD
_CLOSED = SessionPhase.CLOSED
_HANDED_OVER = SessionPhase.HANDED_OVER
_OVER = frozenset({_CLOSED, _HANDED_OVER})
_LIVE = frozenset({SessionPhase.OPEN, _HELD})


class Relay:
    """One client session and its upstream connection: ``side`` the client connection,
    ``upstream`` the engine link; ``settings``, ``capabilities``, ``resuming`` the
    session's policy (the relay builds its core; ``resuming``: the client's
    ``session.resume`` went upstream already; ``key_id``: the API key's id, which the
    client's resume tokens are bound to); ``observer`` metrics, registry and
    tracing (it reads ``view``); ``limits`` the shell's bounds and deadlines;
    ``scheduler`` and ``call_soon``: the running loop's unless given (tests).
    """

    def __init__(
        self,
        *,
        session_key: str,
        side: ClientSide,
        upstream: UpstreamLink,
        settings: SessionSettings,
        observer: RelayObserver,
        limits: RelayLimits,
        capabilities: EngineCapabilities | None = None,
        scheduler: Scheduler | None = None,
        call_soon: Callable[[Callable[[], object]], object] | None = None,
        resuming: bool = False,
        key_id: str = "",
    ) -> None:
        self.key = session_key
        #: The client connection now (another after a resume).
        self.side = side
        self.upstream = upstream
        self.core = SessionCore(
            settings,
            new_event_id=lambda: "event_" + uuid.uuid4().hex,
            capabilities=capabilities,
            resuming=resuming,
            key_id=key_id,
            client_resumes=side.resumes,  # a drain may hand it over
        )
        #: What reporters may read of the session.
        self.view: SessionView = self.core
        self._observer = observer
        self.limits = limits
        self._scheduler = scheduler if scheduler is not None else LoopScheduler()
        self._clock = self._scheduler.time
        self._call_soon = call_soon or asyncio.get_running_loop().call_soon
        self.timers = SessionTimers(self._scheduler, self, limits)
        self.started_at = self.timers.started_at
        self._wake, self._attached = asyncio.Event(), asyncio.Event()
        #: Flags: upstream ping due, flush at the end of the tick, the last drain took events,
        #: shutdown began (a drop now is not held), engine link's run over. Whether the
        #: session is held for a resume is the core's (``view.held``).
        self._ping_upstream = self._flush_soon = self._took = False
        self._shutting_down = self._upstream_ended = self._handed_over = False
        #: The client connection's close frame, once a drain said the session is over for it.
        self._close_frame: tuple[int, bytes] = (1000, b"")
        #: The core deadline the timer is armed for (None: not armed).
        self._deadline: float | None = None
        self._upstream = UpstreamSide(upstream)
        self.log = logging.LoggerAdapter(log, {"session": session_key})
        observer.watch(self.view)

    # -- the app's entry points ---------------------------------------------------------------

    async def run(self) -> None:
        """Relay until both sides are closed. Never raises for peer behaviour."""
        await run_session(self)  # interpreted: it handles the exceptions (its docstring)

    async def serve(self, tg: asyncio.TaskGroup) -> None:
        """Relay in ``tg`` until the client is gone for good, then close upstream."""
        self.timers.start()
        self._upstream.start(self, tg, f"{self.key}:intake")
        while True:
            side = self.side
            side.start(self, tg, f"{self.key}:client")
            await self._deliver(side)
            if self.core.phase is _HANDED_OVER:  # its frames up to its close still go upstream
                await side.wait_closed(self._scheduler, self.limits.close_timeout)
                break
            await side.reader_verdict(self._scheduler, self.limits.close_timeout)
            if not (side.replaced or self.core.phase is _HELD):  # a dropped one is left be
                await side.close(*self._close_frame, self.limits.close_timeout)
            side.done.set()
            if self.side is side and not await self._held():
                break
        self._fact(Fact.CLIENT_GONE)  # over: session.close goes to the engine
        await self._upstream.close(self.limits.upstream_close_timeout, self.limits.close_timeout)

    def failed(self) -> None:
        self.core.receive(Fact.FAILED, self._clock())

    def finish(self) -> None:
        """The session is over: stop its timers, settle its outcome and report it."""
        self.side.done.set()
        self.timers.cancel()
        now = self._clock()
        self.core.receive(Fact.FINISHED, now)
        self._observer.after_drain(self.core.drain(now, 0))
        self._observer.session_end()

    async def close_connections(self) -> None:
        """Close whatever is still open of the client and the engine link."""
        if not self.side.client.closed:
            await self.side.client.close(code=self._close_frame[0])
        await self.upstream.close()

    def shutdown(self) -> None:
        """Proxy shutdown after the drain deadline: ``session.closed`` {shutdown}, 1001."""
        self._shutting_down = True
        self._end(EndReason.SHUTDOWN)

    def hand_over(self) -> HandOver:
        """The sidecar drains: hand the session over now or once it may be (a drain does)."""
        wait = self.core.request_hand_over()
        self._send(self._after(self._clock()))
        return wait

    def end_for_quota(self, message: str) -> None:
        """The key's day audio quota ran out: ``error`` {quota_exceeded}, then 1008.

        Applied at the loop's next step, like :meth:`shed`: the quota's check
        never runs a drain of this session from inside its own call.
        """
        self._call_soon(partial(self._end, EndReason.QUOTA_EXCEEDED, message))

    def trim_journal(self, excess: int) -> int:
        """The process's output cap is passed: free ``excess`` bytes of the resume
        journal (oldest first) before any session is shed; returns the bytes freed."""
        return self.core.trim_journal(excess)

    def shed(self) -> None:
        """Process-wide pending cap exceeded and this is the largest session.

        The registry marks the session from inside a drain (the observer's
        ``update_pending``); the relay applies the shed at the loop's next step,
        outside any drain, so each frame it sends upstream goes once
        (docs/design.md, Process-wide output cap).
        """
        self._call_soon(partial(self._fact, Fact.SHED))

    def engine_unavailable(self) -> None:
        """The supervisor saw the engine die: fail this session now."""
        self._fact(Fact.ENGINE_LOST)
        self._upstream.session_closed.set()  # its socket may linger: stop waiting for it

    def _end(self, reason: EndReason, message: str = "") -> None:
        if self.core.phase in _LIVE:
            self.log.info("ending the session: %s", reason.value)
        self._fact(reason, message=message)

    def _fact(self, fact: Fact | EndReason, amount: int = 0, message: str = "") -> bool:
        """Tell the core ``fact``, then do what its drain says."""
        now = self._clock()
        answer = self.core.receive(fact, now, amount=amount, message=message)
        self._send(self._after(now))
        return answer

    # -- timers (TimerListener) -------------------------------------------------------------

    def ping_due(self, side: Side) -> None:
        if side == "client":
            self.side.writer.ping()
        else:
            self._ping_upstream = True
            self._wake.set()

    def peer_gone(self, side: Side, silent: float) -> None:
        self.log.info("%s silent for %.1f s (no pong): gone", side, silent)
        if side == "client":
            self.side.writer.abort()
        else:
            self.upstream.abort()

    def time_up(self, reason: EndReason) -> None:
        if reason is EndReason.UPSTREAM_TIMEOUT:
            self._upstream.session_closed.set()  # stop waiting for it later, too
        self._end(reason)

    def close_deadline_passed(self) -> None:
        self.log.info("client did not take the final events in time; aborting")
        self.side.writer.abort()
        self._wake.set()

    def core_due(self) -> None:
        self._deadline = None  # the timer fired: it is no longer armed
        self._fact(Fact.TIMER)

    # -- client frames (ClientFrames) ---------------------------------------------------------

    def client_text(self, text: str) -> None:
        """One client text frame, pushed by aiohttp's parser or read from its queue."""
        now = self._clock()
        timers = self.timers
        timers.last_client_frame = timers.last_client_event = now
        upstream = self.upstream
        decision = self.core.receive_client(text, now, upstream_backlog=upstream.input_backlog())
        self._observer.client_frame(len(text), decision)
        self._admitted(decision.verdict)
        self._send(self._after(now))
        if upstream.write_paused:
            self.side.reader.pause_for_upstream()  # not read again until the link drains

    def client_binary(self, size: int) -> None:
        now = self._clock()
        self.timers.last_client_frame = self.timers.last_client_event = now
        decision = self.core.receive_client_binary(size, now)
        self._observer.client_frame(size, decision)
        self._admitted(decision.verdict)
        self._send(self._after(now))

    def _admitted(self, verdict: ClientVerdict) -> None:
        if verdict is ClientVerdict.OVER_RATE:
            self.side.reader.over_rate()  # back to aiohttp's queue
        elif verdict is ClientVerdict.CUT_OFF:
            self.side.reader.cut()  # read none of its backlog
        elif verdict is ClientVerdict.CLOSE_ASKED:
            self.timers.arm_upstream_close(self.limits.upstream_close_timeout)

    def client_ping(self, payload: ControlPayload) -> None:
        self.timers.last_client_frame = self._clock()
        writer = self.side.writer
        if writer.pong(payload):
            return
        self._wake.set()  # the pong waits for the transport to drain
        if self._fact(Fact.CLIENT_PING, writer.unanswered_pings):
            self.log.warning("client keeps pinging without reading; overflow")

    def client_control(self) -> None:
        self.timers.last_client_frame = self._clock()

    def client_error(self, error: object) -> None:
        self.log.info("client error: %s", error)

    def client_ended(self) -> None:
        side = self.side
        if side.ended.is_set() or not side.reader.finished:
            return  # a superseded connection's reader ended
        side.ended.set()
        if side.replaced:
            self._send(self._after(self._clock()))
            return
        dropped = not (side.reader.closed_cleanly or self._shutting_down)
        dropped = dropped and self._observer.may_hold()
        if self._fact(Fact.CLIENT_DROPPED if dropped else Fact.CLIENT_CLOSED):
            self.log.info("client dropped; held for a resume")

    def attach(self, side: ClientSide, cursor: int) -> bool:
        """A ``session.resume`` on ``side``: replay what it missed and go on there. False: it
        ended, is handed over, or lost what followed ``cursor`` (``session.resync_required``)."""
        now = self._clock()
        attached, notice = self.core.attach(cursor, now)
        if not attached:
            if notice is not None:
                side.writer.send_text(notice)
            return False
        if notice is not None:  # the old connection still looked alive: superseded
            self.side.supersede(notice)
        self.side = side
        self.timers.last_client_frame = self.timers.last_client_event = now
        self._attached.set()
        self._wake.set()
        return True

    # -- engine frames (UpstreamHandler): called per frame, no await ---------------------------

    def upstream_text(self, text: str) -> Sequence[str]:
        now = self._clock()
        self.timers.last_upstream_frame = now
        event = self.core.receive_upstream(text, now)
        self._observer.upstream_event(event)
        self._upstream.saw(event)
        if self.upstream.backlog:
            # More engine frames are parsed already: write them all at the end of the tick.
            if not self._flush_soon:
                self._flush_soon = True
                self._call_soon(self._flush_tick)
            return self._after(now, deferred=True)
        return self._after(now)

    def upstream_binary(self, size: int) -> None:
        self.timers.last_upstream_frame = self._clock()
        self._fact(Fact.UPSTREAM_BINARY, size)
        self._observer.upstream_invalid(size)
        self.log.warning("upstream sent a binary frame (%d bytes); dropped", size)

    def upstream_alive(self) -> None:
        self.timers.last_upstream_frame = self._clock()

    def _flush_tick(self) -> None:
        self._flush_soon = False
        self._send(self._after(self._clock()))

    def upstream_ended(self, clean: bool | None) -> None:
        self._upstream_ended = True
        if not self._upstream.session_closed.is_set():
            if clean is not None:
                self.log.info("upstream closed (%s), no session.closed", self.upstream.close_code)
            self._fact(Fact.UPSTREAM_CLOSED if clean else Fact.ENGINE_LOST)
        else:
            self._after(self._clock())

    # -- after every core call: do what its drain says ------------------------------------------

    def _after(self, now: float, *, deferred: bool = False) -> Sequence[str]:
        """Do what the core's drain says (``deferred``: write at the tick's end)."""
        core = self.core
        writer = self.side.writer
        held = core.phase is _HELD
        room = 0 if deferred else writer.room()  # held: the core takes none
        out = core.drain(now, room)
        entries = out.to_client
        self._took = bool(entries)
        if entries:
            out.to_client = NOTHING  # the writer has them: the drain keeps no large frame alive
            if writer.write(entries):
                self._observer.delivered(entries, now)
        deadline = out.deadline
        if deadline != self._deadline:
            self._deadline = deadline
            self.timers.arm_core(deadline)
        self._observer.after_drain(out)
        close = out.close
        if close is not None:
            self._close_frame = close
            if core.phase is not _HANDED_OVER:
                # A bounded time to deliver the last events, also to a client that stopped reading.
                self.timers.arm_close_deadline(close[0])
            elif not self._handed_over:  # 1012, no session.close
                self._handed_over = True
                if not held:  # a held one has no client connection to close
                    writer.close(*close)
                self._upstream.hand_over()
                self.log.info("handed over: the client resumes on another sidecar")
            self._wake.set()
        elif core.output_waiting and not deferred and not held and (self._took or not room):
            # More than one room's worth, or a client not writable: delivery goes on.
            self._wake.set()
        return NOTHING if self._upstream_ended else out.to_upstream

    def _send(self, frames: Sequence[str]) -> None:
        send = self.upstream.send_nowait
        for frame in frames:
            send(frame)

    # -- delivery ----------------------------------------------------------------------------------

    async def _deliver(self, side: ClientSide) -> None:
        """Write to ``side`` while it is the session's connection and writable."""
        core = self.core
        writer = side.writer
        while side is self.side and core.phase is not _HELD:
            await self._ping_if_due()
            if core.phase in _OVER or writer.gone or writer.close_sent:
                break
            if writer.paused:
                if writer.has_pending or core.output_waiting:
                    try:
                        await writer.wait_writable()  # write only below the high-water mark
                    except (ConnectionError, RuntimeError):
                        break
                    continue
            elif core.output_waiting or writer.has_pending:
                self._send(self._after(self._clock()))
                if core.phase in _OVER:
                    break
                if self._took:
                    await asyncio.sleep(0)  # one room per turn: let other sessions run
                    continue
            self._wake.clear()
            await self._wake.wait()

    async def _held(self) -> bool:
        """While the session is held for a resume: True once another connection attached."""
        side, core = self.side, self.core
        while core.phase is _HELD:
            await self._ping_if_due()
            self._wake.clear()
            self._attached.clear()
            if core.phase is _HELD:
                await first_set(self._wake, self._attached)
        self._fact(Fact.RESUME_ABANDONED)  # ended while held (shutdown, replaced): nobody to tell
        return self.side is not side

    async def _ping_if_due(self) -> None:
        if self._ping_upstream:
            self._ping_upstream = False
            await self.upstream.ping()
