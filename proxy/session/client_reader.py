"""How a session's client frames come in: one path, whether pushed or read.

Once aiohttp's reader queue is empty, text messages are handed over as they
are parsed (``proxy.compat.push_text``); the reader task reads the queue for
everything else. Either way a text frame reaches :meth:`ClientFrames.client_text`.
A client over its frame rate goes back to the queue (paced by aiohttp's flow
control, the task yielding every 16 frames); one ended for flooding is cut
off; while the upstream link is above its write mark the client is not read
(docs/design.md, Relay shell).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import aiohttp

from proxy import compat
from proxy.session.frames import ControlPayload

if TYPE_CHECKING:
    from proxy.session.upstream_link import UpstreamLink

__all__ = ["ClientFrames", "ClientReader", "ClientSocket", "InputTranslator", "TextPush"]

#: The reader yields to the event loop every 16 frames.
_YIELD_EVERY_MASK: Final = 15

#: Turns aiohttp's hand-over of parsed client text frames on (a handler) or off
#: (None); returns whether it is now as asked (``compat.push_text`` bound to the client).
TextPush = Callable[[Callable[[str], None] | None], bool]


class ClientSocket(Protocol):
    """What the session uses of aiohttp's ``WebSocketResponse`` (reading and the
    close handshake; every write goes through the frame writer)."""

    @property
    def closed(self) -> bool: ...

    async def receive(self) -> aiohttp.WSMessage: ...

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool: ...


class InputTranslator(Protocol):
    """A front door speaking another protocol (docs/design.md, Phone front door):
    each client text frame becomes the session's client events (zero or more)."""

    def from_client(self, text: str) -> list[str]: ...


class ClientFrames(Protocol):
    """What the reader hands each client frame to (the relay)."""

    def client_text(self, text: str) -> None:
        """One text frame, pushed by the parser or read from the queue."""

    def client_binary(self, size: int) -> None:
        """One binary frame (refused: the protocol is JSON text)."""

    def client_ping(self, payload: ControlPayload) -> None:
        """A ping (answered by the writer; counted against the output budget)."""

    def client_control(self) -> None:
        """A pong: proof of life only."""

    def client_error(self, error: object) -> None:
        """aiohttp's reader failed (the connection ends)."""

    def client_ended(self) -> None:
        """The client side is done (closed, lost, or the reader was stopped)."""


class ClientReader:
    """The client read task of one session.

    Args:
        client: the prepared client WebSocket.
        protocol: aiohttp's protocol under ``client``: reading is paused and
            resumed on its transport (writing is the frame writer's alone).
        upstream: the engine link (its flow control pauses client reads).
        push: turns the parser's hand-over of text frames on and off; None
            reads every frame from aiohttp's queue.
        translator: what a client of another protocol's frames become (None:
            each text frame is a client event; with one, frames are read from
            the queue, never pushed).
    """

    def __init__(
        self,
        client: ClientSocket,
        protocol: Any,
        upstream: UpstreamLink,
        push: TextPush | None,
        translator: InputTranslator | None = None,
    ) -> None:
        self._client = client
        self._protocol = protocol
        self._upstream = upstream
        self._push = push if translator is None else None
        self._translator = translator
        #: Text frames are being handed over by the parser right now.
        self.pushing = False
        #: Text frames read from aiohttp's queue (the rest were handed over as parsed).
        self.frames_read = 0
        #: The client was cut off for flooding: its reads are paused for good.
        self.cut_off = False
        #: ``run`` has ended (the connection is done for this reader).
        self.finished = False
        #: The client ended with a close frame (not a dropped connection).
        self.closed_cleanly = False
        #: A message read before ``run`` (the edge's look at the first one): handled first.
        self.first: aiohttp.WSMessage | None = None
        #: Client reading is paused until the engine link drains.
        self._paused_for_upstream = False
        upstream.on_drained = self._upstream_drained

    async def run(self, frames: ClientFrames) -> None:
        """Read until the client closes or is lost (cancelled at wind-down).

        Args:
            frames: where frames go (the relay; held only while this runs).
        """
        client = self._client
        upstream = self._upstream
        translator = self._translator
        handler = frames.client_text if self._push is not None else None
        count = 0
        try:
            while True:
                if handler is not None and not self.pushing and not self.cut_off:
                    # Only once aiohttp's queue is empty, so no frame overtakes
                    # one queued before it; then text frames skip the queue.
                    self._set_push(handler)
                msg = self.first or await client.receive()
                self.first = None
                if self.cut_off:
                    # Cut off while frames were pushed: read none of what aiohttp
                    # queued (its queue stays full, so it keeps the socket paused).
                    await asyncio.Event().wait()  # until wind-down cancels us
                count += 1
                if not count & _YIELD_EVERY_MASK:
                    # aiohttp returns queued frames without suspending: yield now
                    # and then so a flooding client cannot starve other sessions.
                    await asyncio.sleep(0)
                kind = msg.type
                if kind is aiohttp.WSMsgType.TEXT:
                    self.frames_read += 1
                    if translator is None:
                        frames.client_text(msg.data)
                    else:
                        for text in translator.from_client(msg.data):
                            frames.client_text(text)
                            if self.cut_off:
                                break
                    if self.cut_off:
                        await asyncio.Event().wait()  # until wind-down cancels us
                    # A frame read from the queue waits for the engine link, as
                    # a pushed one waits with the socket paused.
                    await upstream.wait_drained()
                elif kind is aiohttp.WSMsgType.PING:
                    frames.client_ping(msg.data)
                elif kind is aiohttp.WSMsgType.PONG:
                    frames.client_control()
                elif kind is aiohttp.WSMsgType.BINARY:
                    frames.client_binary(len(msg.data))
                    if self.cut_off:
                        await asyncio.Event().wait()  # until wind-down cancels us
                else:
                    # CLOSE, CLOSING, CLOSED or ERROR (aiohttp already answered
                    # an oversized frame with 1009, through our writer).
                    self.closed_cleanly = kind is aiohttp.WSMsgType.CLOSE
                    if kind is aiohttp.WSMsgType.ERROR:
                        frames.client_error(msg.data)
                    break
        finally:
            self._set_push(None)
            upstream.on_drained = None  # no cycle between the link and this reader
            self.finished = True
            frames.client_ended()

    def over_rate(self) -> None:
        """The client is over its frame rate: back to aiohttp's queue.

        Its flow control (and the reader's yield every few frames) then paces
        a flooding client; the reader turns the push on again once the queue
        is empty.
        """
        if self.pushing:
            self._set_push(None)

    def cut(self) -> None:
        """End reading for good (the session ends for flooding).

        Read none of the backlog (parsing it would cost every other session
        CPU until the socket closes); the close frame goes out without
        waiting for a reply.
        """
        self.cut_off = True
        self._set_push(None)
        self._pause()

    def pause_for_upstream(self) -> None:
        """Read no more client frames until the engine link drains."""
        if not self.cut_off and not self._paused_for_upstream:
            self._pause()
            self._paused_for_upstream = True

    def _upstream_drained(self) -> None:
        if self._paused_for_upstream:
            self._paused_for_upstream = False
            if not self.cut_off:
                transport = compat.client_transport(self._protocol)
                if transport is not None and not transport.is_closing():
                    transport.resume_reading()

    def _pause(self) -> None:
        transport = compat.client_transport(self._protocol)
        if transport is not None and not transport.is_closing():
            transport.pause_reading()

    def _set_push(self, handler: Callable[[str], None] | None) -> bool:
        """Hand client text frames to ``handler`` as they are parsed (None: queue them).

        Returns:
            True when the hand-over is now as asked.
        """
        push = self._push
        done = push is not None and push(handler)
        self.pushing = done and handler is not None
        return done
