"""One client connection of a session: its socket, reader and frame writer.

A session has one at a time (docs/design.md, Relay shell). A resumable session
whose client drops goes on without one, and a ``session.resume`` attaches a
new one (docs/design.md, Resume); a connection that a resume supersedes gets
``session.replaced`` and is closed. The relay drives it; it holds no relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

from proxy.session.client_reader import (
    ClientFrames,
    ClientReader,
    ClientSocket,
    InputTranslator,
    TextPush,
)
from proxy.session.tasks import cancel_and_wait, first_set
from proxy.session.timers import Scheduler
from proxy.session.upstream_link import UpstreamLink
from proxy.session.writer import ClientFrameWriter, OutputTranslator

__all__ = ["ClientSide", "FrontDoorTranslator"]


class FrontDoorTranslator(InputTranslator, OutputTranslator, Protocol):
    """Both directions of a front door that speaks another protocol to its client."""


class ClientSide:
    """A client connection as its session uses it.

    Args:
        client: the prepared client WebSocket (reads and the close handshake).
        protocol: aiohttp's protocol under ``client`` (flow control).
        upstream: the session's engine link (its flow control pauses client reads).
        push: aiohttp's hand-over of parsed text frames (``proxy.compat.push_text``);
            None reads every frame from aiohttp's queue.
        write_buffer_bytes: the write bound (``client_write_buffer_bytes``).
        address: the client's address, for logs and the access line.
        resumes: its URL says its client resumes (a drain may hand the session over).
        translator: a front door of another protocol (the phone front door:
            proxy/session/twilio_side.py), both ways; None: the engine's protocol.
    """

    def __init__(
        self,
        client: ClientSocket,
        protocol: Any,
        upstream: UpstreamLink,
        push: TextPush | None = None,
        *,
        write_buffer_bytes: int,
        address: str = "",
        resumes: bool = False,
        translator: FrontDoorTranslator | None = None,
    ) -> None:
        self.client = client
        self.address = address
        #: The front door of another protocol, both ways (None: the engine's protocol).
        self.translator = translator
        self.writer = ClientFrameWriter(
            protocol, write_buffer_bytes=write_buffer_bytes, translator=translator
        )
        self.reader = ClientReader(client, protocol, upstream, push, translator)
        #: The client's reads ended (closed, lost, or stopped).
        self.ended = asyncio.Event()
        #: The session is done with this connection (its handler may return).
        self.done = asyncio.Event()
        #: A resume on another connection superseded this one.
        self.replaced = False
        #: When it became the session's connection (monotonic seconds), and which
        #: one it is (1: the connection that opened the session).
        self.attached_at = time.monotonic()
        self.attachment = 1
        #: Its URL says its client resumes after a 1012 (``autostart=0``/``resume=1``).
        self.resumes = resumes
        #: Frames and bytes written to the session's earlier connections.
        self.earlier_frames = self.earlier_bytes = 0
        self._reader_task: asyncio.Task[None] | None = None

    def follow(self, previous: ClientSide) -> None:
        """This connection resumes the session ``previous`` served: carry its totals."""
        self.attachment = previous.attachment + 1
        self.earlier_frames = previous.earlier_frames + previous.writer.frames_written
        self.earlier_bytes = previous.earlier_bytes + previous.writer.bytes_written

    @property
    def frames_written(self) -> int:
        """Frames written to the client over the session's connections so far."""
        return self.earlier_frames + self.writer.frames_written

    @property
    def bytes_written(self) -> int:
        return self.earlier_bytes + self.writer.bytes_written

    def start(self, frames: ClientFrames, tg: asyncio.TaskGroup, name: str) -> None:
        """Start reading the client into ``frames`` (the relay), in the session's TaskGroup."""
        self._reader_task = tg.create_task(self.reader.run(frames), name=name)

    async def reader_verdict(self, scheduler: Scheduler, timeout: float) -> None:
        """A connection the writer found lost: wait (at most ``timeout``) for the reader
        to end, which says how it ended (a drop, held for a resume, or a close frame).

        Either may notice a lost connection first; deciding on the writer's word
        alone would end a session a drop should hold. A reader cut off for
        flooding reads nothing more and its session is ending: nothing to wait for.
        """
        if self.replaced or not self.writer.gone or self.ended.is_set() or self.reader.cut_off:
            return  # a superseded connection's end decides nothing: the session moved on
        expired = asyncio.Event()
        timer = scheduler.call_at(scheduler.time() + timeout, expired.set)
        try:
            await first_set(self.ended, expired)
        finally:
            timer.cancel()

    async def wait_closed(self, scheduler: Scheduler, timeout: float) -> None:
        """Our close frame went (``writer.close``): wait, at most ``timeout``, for the
        client's own close while its reader still reads; then drop the connection."""
        if not self.ended.is_set() and not self.writer.gone:
            expired = asyncio.Event()
            timer = scheduler.call_at(scheduler.time() + timeout, expired.set)
            try:
                await first_set(self.ended, expired)
            finally:
                timer.cancel()
        if not self.ended.is_set():
            self.writer.abort()
        self.done.set()

    async def close(self, code: int, message: bytes, timeout: float) -> None:
        """Close the connection with ``code`` after what was written (at most ``timeout``)."""
        writer = self.writer
        if self.reader.cut_off:
            await cancel_and_wait(self._reader_task)
            writer.close(code, message)
            writer.close_transport()  # after the close frame; no reply awaited
        elif not self.client.closed and not writer.gone:
            # Our reader first: with one waiting, aiohttp's close() drops the
            # connection right after Close (the client would see 1006); without,
            # it waits up to ``timeout`` for the reply. Close goes via our writer.
            await cancel_and_wait(self._reader_task)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout):
                    await self.client.close(code=code, message=message)
        # Unblock the reader if the client never answered our close.
        if not self.ended.is_set() and not self.client.closed:
            writer.abort()

    def supersede(self, notice: str) -> None:
        """Another connection resumed the session: tell this one (``notice``: its
        ``session.replaced``, proxy/core/notices.py), and drop it."""
        self.replaced = True
        writer = self.writer
        if writer.room():
            writer.send_text(notice)
        writer.close(1000, b"session_replaced")
        writer.close_transport()
