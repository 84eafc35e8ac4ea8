"""The engine link over picows (the default ``upstream_client``).

picows parses frames in C and calls back per frame with the payload as a
buffer, so an engine event costs no task wake-up, no message object and no
reader queue: :meth:`PicowsUpstreamLink.on_ws_frame` hands each text message
straight to the relay and sends whatever the relay answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import picows
import picows.picows  # mypyc loads the listener's base class from here
from mypy_extensions import mypyc_attr

from proxy.session.frames import OP_TEXT
from proxy.session.upstream_link.frame_outbox import Outbox
from proxy.session.upstream_link.interface import (
    CLEAN_CLOSES,
    NO_STATUS,
    UpstreamConnectError,
    UpstreamHandler,
)

__all__ = ["PicowsUpstreamLink"]

log = logging.getLogger(__name__)

_TEXT: Final = picows.WSMsgType.TEXT
_BINARY: Final = picows.WSMsgType.BINARY
_CONTINUATION: Final = picows.WSMsgType.CONTINUATION
_CLOSE: Final = picows.WSMsgType.CLOSE
_PING: Final = picows.WSMsgType.PING
_PONG: Final = picows.WSMsgType.PONG


class _Frame(Protocol):
    """What the link reads of a ``picows.WSFrame``.

    Its flags are C integers that the stubs call ``bool``; read as ``int`` so
    that compiled code does not insist on a ``bool``.
    """

    @property
    def msg_type(self) -> picows.WSMsgType: ...

    @property
    def fin(self) -> int: ...

    @property
    def last_in_buffer(self) -> int: ...

    @property
    def payload_size(self) -> int: ...

    def get_payload_as_utf8_text(self) -> str: ...

    def get_payload_as_bytes(self) -> bytes: ...

    def get_close_code(self) -> picows.WSCloseCode: ...


class _FramesWaiting:
    """The picows link's ``backlog``: 1 while more frames of the current read wait."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0

    def __len__(self) -> int:
        return self.waiting


# A Python class whose methods are compiled: mypyc cannot lay out a native
# subclass of picows' Cython listener.
@mypyc_attr(native_class=False)
class PicowsUpstreamLink(picows.WSListener):
    """:class:`UpstreamLink` over picows (frames by callback, masking in C).

    Messages fragmented by the engine are joined here, bounded by
    ``max_message_bytes``; invalid UTF-8 in a text message closes the link
    with 1007, as aiohttp would.

    Text frames toward the engine go through an :class:`Outbox` (masked,
    one ``writelines`` per loop tick). Control frames (the keepalive's ping,
    pongs, close) go through picows.
    """

    def __init__(self, *, max_message_bytes: int, write_limit: int) -> None:
        super().__init__()
        self.transport: picows.WSTransport | None = None
        self._underlying: asyncio.Transport | None = None
        self.backlog = _FramesWaiting()
        self._handler: UpstreamHandler | None = None
        self._max_message = max_message_bytes
        self._write_limit = write_limit
        #: Messages that arrived before run() (the engine's session.created):
        #: reading pauses at the first one, so at most one socket read is held.
        self._early: list[tuple[picows.WSMsgType, bytes]] = []
        #: first_text() waits on it for the first of those.
        self._first: asyncio.Future[None] | None = None
        self._fragments: list[bytes] | None = None
        self._fragment_kind: picows.WSMsgType = _TEXT
        self._fragment_bytes = 0
        self._close_code: int | None = None
        #: We failed the connection (a protocol error): frames after it are ignored.
        self._failed = False
        self._disconnected = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._log: Any = log
        # Kept: asyncio.get_running_loop() costs a getpid() system call per use.
        self._loop = asyncio.get_running_loop()
        #: Masked text frames, written at the end of this loop tick.
        self._outbox = Outbox(self._loop)
        self.on_drained: Callable[[], None] | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        headers: Mapping[str, str],
        max_message_bytes: int,
        write_limit: int,
    ) -> PicowsUpstreamLink:
        link = cls(max_message_bytes=max_message_bytes, write_limit=write_limit)
        try:
            await picows.ws_connect(
                lambda: link,
                url,
                extra_headers=dict(headers),
                # The caller's upstream_connect_timeout bounds the whole connect.
                websocket_handshake_timeout=None,
                max_frame_size=max_message_bytes,
                max_redirects=0,
                enable_auto_pong=True,
                logger_name="omni_sidecar.upstream",
            )
        except (picows.WSError, OSError) as exc:
            raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
        transport = link.transport
        assert transport is not None
        underlying = transport.underlying_transport
        with contextlib.suppress(Exception):
            underlying.set_write_buffer_limits(high=write_limit)
        return link

    # -- picows callbacks -----------------------------------------------------------------

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.transport = transport
        # Kept: reached on every frame sent and every input_backlog().
        self._underlying = transport.underlying_transport
        self._outbox.transport = self._underlying

    def on_ws_frame(self, transport: picows.WSTransport, frame: _Frame) -> None:
        if self._failed:
            return  # we failed the connection: nothing more is processed (RFC 6455 §7.1.7)
        handler = self._handler
        if (
            frame.msg_type == _TEXT
            and frame.fin
            and handler is not None
            and self._fragments is None
        ):
            # The hot path: one engine event, handed over from the parser's buffer.
            self.backlog.waiting = not frame.last_in_buffer
            try:
                text = frame.get_payload_as_utf8_text()
            except UnicodeDecodeError as exc:
                raise self._fail(_not_utf8()) from exc
            commands = handler.upstream_text(text)
            if commands:
                self._send_all(commands)
            return
        try:
            self._other_frame(transport, frame)
        except picows.WSProtocolError as exc:
            raise self._fail(exc) from None

    def _fail(self, exc: picows.WSProtocolError) -> picows.WSProtocolError:
        """We fail the connection with ``exc`` (picows sends its close frame)."""
        self._failed = True
        return exc

    def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
        self._disconnected = True
        self._outbox.transport = None
        self._resume()
        self._first_arrived()

    def _first_arrived(self) -> None:
        first = self._first
        if first is not None and not first.done():
            first.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume()
        if self.on_drained is not None:
            self.on_drained()

    # -- frames off the hot path ----------------------------------------------------------

    def _other_frame(self, transport: picows.WSTransport, frame: _Frame) -> None:
        kind = frame.msg_type
        if kind == _CLOSE:
            # A flexible IntEnum (any code); 0 when the frame carries none.
            self._close_code = frame.get_close_code().value or NO_STATUS
            self._outbox.flush()
            if not transport.is_close_frame_sent:
                transport.send_close(frame.get_close_code())
            transport.disconnect()
            return
        if kind == _PING or kind == _PONG:
            if self._handler is not None:
                self._handler.upstream_alive()
            return
        if kind == _CONTINUATION:
            if self._fragments is None:
                raise picows.WSProtocolError(
                    picows.WSCloseCode.PROTOCOL_ERROR, "continuation without a first frame"
                )
            self._add_fragment(frame)
            if not frame.fin:
                return
            payload = b"".join(self._fragments)
            kind = self._fragment_kind
            self._fragments = None
            self._fragment_bytes = 0
        elif kind == _TEXT or kind == _BINARY:
            if self._fragments is not None:
                raise picows.WSProtocolError(
                    picows.WSCloseCode.PROTOCOL_ERROR, "new message inside a fragmented one"
                )
            if not frame.fin:
                self._fragments = []
                self._fragment_kind = kind
                self._add_fragment(frame)
                return
            payload = frame.get_payload_as_bytes()
        else:  # pragma: no cover - picows knows no other opcodes
            return
        self._message(kind, payload)

    def _add_fragment(self, frame: _Frame) -> None:
        assert self._fragments is not None
        self._fragment_bytes += frame.payload_size
        if self._fragment_bytes > self._max_message:
            raise picows.WSProtocolError(
                picows.WSCloseCode.MESSAGE_TOO_BIG,
                f"engine message over {self._max_message} bytes",
            )
        self._fragments.append(frame.get_payload_as_bytes())

    def _message(self, kind: picows.WSMsgType, payload: bytes) -> None:
        handler = self._handler
        if handler is None:
            self._early.append((kind, payload))
            if self.transport is not None:
                self.transport.underlying_transport.pause_reading()
            self._first_arrived()
            return
        self.backlog.waiting = 0
        if kind == _TEXT:
            commands = handler.upstream_text(_utf8(payload))
            if commands:
                self._send_all(commands)
        else:
            handler.upstream_binary(len(payload))

    def _send_all(self, commands: Sequence[str]) -> None:
        for text in commands:
            self.send_nowait(text)

    def send_nowait(self, text: str) -> None:
        if self.transport is None or self.closed:
            return
        self._outbox.frame(OP_TEXT, bytearray(text, "utf-8", "surrogatepass"))

    # -- UpstreamLink ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        transport = self.transport
        return (
            self._disconnected
            or self._close_code is not None
            or transport is None
            or transport.is_close_frame_sent
        )

    @property
    def close_code(self) -> int | None:
        return self._close_code

    def input_backlog(self) -> int:
        underlying = self._underlying
        if underlying is None or self._disconnected:
            return 0
        try:
            return self._outbox.pending_bytes + int(underlying.get_write_buffer_size())
        except (AttributeError, RuntimeError, OSError):  # pragma: no cover - closed transport
            return 0

    async def first_text(self, timeout: float) -> str | None:
        if not self._early and not self._disconnected and self._handler is None:
            self._first = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._first
            except TimeoutError:
                return None
            finally:
                self._first = None
        if not self._early or self._early[0][0] != _TEXT:
            return None
        try:
            return self._early[0][1].decode("utf-8")
        except UnicodeDecodeError:
            return None  # run() fails the link with 1007

    async def run(self, handler: UpstreamHandler) -> bool:
        transport = self.transport
        assert transport is not None
        self._handler = handler
        early, self._early = self._early, []
        try:
            for kind, payload in early:
                self._message(kind, payload)
        except picows.WSProtocolError as exc:
            # As picows ends a connection whose callback raised it (the close
            # code is the error's): e.g. a held first frame that is not UTF-8.
            self._failed = True
            transport.send_close(exc.code, str(exc.args[1]).encode()[:120])
            transport.disconnect()
            self._log.info("engine link closed: %s", exc)
            return False
        except Exception:
            # The same end as another exception raised inside a picows callback.
            transport.send_close(picows.WSCloseCode.INTERNAL_ERROR)
            transport.disconnect()
            raise
        if early and not self._disconnected:
            transport.underlying_transport.resume_reading()
        try:
            await transport.wait_disconnected()
        except picows.WSProtocolError as exc:
            self._log.info("engine link closed: %s", exc)
            return False
        finally:
            self._handler = None  # the session is over: no cycle through it
        return self._close_code in CLEAN_CLOSES

    async def send(self, text: str) -> None:
        self.send_nowait(text)
        await self.wait_drained()

    @property
    def write_paused(self) -> bool:
        return self._write_paused and not self._disconnected

    async def wait_drained(self) -> None:
        while self._write_paused and not self._disconnected:
            if self._drained is None or self._drained.done():
                self._drained = self._loop.create_future()
            await self._drained

    def _resume(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def ping(self) -> None:
        transport = self.transport
        if transport is not None and not self.closed:
            transport.send_ping()

    def abort(self) -> None:
        transport = self.transport
        if transport is not None and not self._disconnected:
            transport.disconnect(graceful=False)

    async def close(self) -> None:
        """Send a close frame and wait for the engine's (the caller bounds the wait)."""
        transport = self.transport
        if transport is None or self._disconnected:
            return
        try:
            self._outbox.flush()  # what was sent goes before the close frame
            if not transport.is_close_frame_sent:
                transport.send_close(picows.WSCloseCode.OK)
            with contextlib.suppress(picows.WSError):
                await transport.wait_disconnected()
        finally:
            if not self._disconnected:
                transport.disconnect()


def _utf8(payload: bytes) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8() from exc


def _not_utf8() -> picows.WSProtocolError:
    return picows.WSProtocolError(picows.WSCloseCode.INVALID_TEXT, "engine text frame is not UTF-8")
