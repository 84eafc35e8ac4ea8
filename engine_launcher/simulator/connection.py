"""I/O shell of one simulator WebSocket: the reader, and the session it starts.

:class:`SocketRunner` creates the socket's own :class:`SessionHost` (whose
pump writes to the socket) and reads frames into whichever session the socket
serves: its own, or the one its first message, ``session.resume``, took over.
A socket that drops detaches its session or ends it (docs/engine-protocol.md,
Resume); the session's tasks live on in the TaskGroup of the socket that
created it. docs/design.md, Simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from aiohttp import WSMsgType, web

from engine_launcher.simulator.session_host import (
    CLOSE_TIMEOUT,
    Attachment,
    SessionHost,
    SimulatorState,
)
from engine_launcher.simulator.session_resume import EngineResumeRequest, Resumed
from engine_launcher.simulator.session_state import Phase
from engine_launcher.simulator.wire import MAX_CLIENT_MESSAGE_BYTES

__all__ = ["FIRST_MESSAGE_TIMEOUT", "SocketRunner"]

logger = logging.getLogger(__name__)

# docs/engine-protocol.md, Framing and limits: the first message must arrive within 10 s
# (config_timeout).
FIRST_MESSAGE_TIMEOUT: Final = 10.0


def _utf8_size_over(text: str, limit: int) -> int | None:
    """Return the UTF-8 size of ``text`` when it exceeds ``limit``, else ``None``."""
    if len(text) > limit:
        return len(text.encode("utf-8", "surrogatepass"))
    if len(text) * 4 <= limit:
        return None  # cannot exceed: at most 4 bytes per code point
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


class SocketRunner:
    """Runs one WebSocket connection of the simulator.

    Args:
        ws: the prepared server-side WebSocket.
        host: the socket's own session (possibly already opened), attached to it.
        state: process-wide state.
    """

    def __init__(self, ws: web.WebSocketResponse, host: SessionHost, state: SimulatorState):
        self._ws = ws
        self._host = host
        self._state = state
        self._attachment = Attachment(ws)
        host.attach(self._attachment)

    async def run(self) -> None:
        """Serve the socket until it and the session it created are done."""
        self._state.add_socket(self._attachment)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._host.run(), name="sim-session")
                tg.create_task(self._read_loop(), name="sim-reader")
        except* Exception as group:
            logger.error("socket reader failed", exc_info=group.exceptions[0])
        finally:
            self._state.discard_socket(self._attachment)
            if not self._ws.closed:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await self._ws.close(code=1011, message=b"internal_error")

    def _serving(self) -> SessionHost | None:
        """The session this socket serves, ``None`` once it serves none (replaced, ended)."""
        host = self._attachment.host
        return host if host is not None and host.attachment is self._attachment else None

    async def _read_loop(self) -> None:
        state = self._state
        while True:
            await state.stall_gate()
            host = self._serving()
            if host is None:
                return
            session = host.session
            timeout = FIRST_MESSAGE_TIMEOUT if session.phase is Phase.AWAITING_OPEN else None
            try:
                msg = await self._ws.receive(timeout=timeout)
            except TimeoutError:
                session.receive_open_timeout()
                host.flush()
                return
            await state.stall_gate()  # a stalled engine drops what it reads
            if self._serving() is not host:
                return  # a resume took the session over: what this socket sends is dropped
            if msg.type is WSMsgType.TEXT:
                size = _utf8_size_over(msg.data, MAX_CLIENT_MESSAGE_BYTES)
                if size is None:
                    session.receive_text(msg.data)
                else:
                    session.receive_oversized(size)
                request = session.take_resume_request()
                if request is not None:
                    if await self._resume(host, request):
                        continue  # now reading for the resumed session
                    return  # refused: the pump sends why and closes
            elif msg.type is WSMsgType.BINARY:
                session.receive_binary()
            else:
                # CLOSE/CLOSING/CLOSED/ERROR: the client went away (or our own
                # close is under way, and then the session is closed already).
                host.socket_ended(self._attachment)
                return
            host.flush()
            if session.phase is Phase.CLOSED:
                return  # stop reading; the pump delivers session.closed and closes

    async def _resume(self, own: SessionHost, request: EngineResumeRequest) -> bool:
        """This socket's first message was ``session.resume``: attach it to that session.

        Returns whether it did; if not, the socket's own session says why and closes.
        """
        loop = asyncio.get_running_loop()
        target, outcome = self._state.resume(request, loop.time())
        if not isinstance(outcome, Resumed):
            own.session.refuse_resume(outcome)
            own.flush()
            return False
        assert target is not None
        own.hand_over()
        replaced = target.take_over(self._attachment, outcome)
        logger.info(
            "session %s resumed (attachment generation %d)",
            request.session_id,
            target.session.attachment_generation,
        )
        if replaced is not None and outcome.replaced is not None:
            await target.tell_replaced(replaced, outcome.replaced)
        return True
