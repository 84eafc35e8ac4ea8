"""The engine end of a session: its link's intake task and how it closes.

The counterpart of ``ClientSide`` (docs/design.md, Relay shell). The link
pushes engine frames into the relay while ``run`` lasts; at the end the
relay asks the engine to close the session and waits a bounded time for its
``session.closed`` before closing the link. It holds no relay.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from proxy.core.events import EventKind, UpstreamEvent
from proxy.session.tasks import cancel_and_wait, first_set
from proxy.session.upstream_link import UpstreamHandler, UpstreamLink

__all__ = ["UpstreamSide"]


class UpstreamEnds(UpstreamHandler, Protocol):
    """What the intake tells the relay besides frames."""

    def upstream_ended(self, clean: bool | None) -> None:
        """The link's ``run`` returned (``clean``: the engine closed cleanly), or
        was cancelled (None)."""


class UpstreamSide:
    """The session's engine connection as its relay uses it."""

    def __init__(self, link: UpstreamLink) -> None:
        self.link = link
        #: The engine's ``session.closed`` arrived, or it is no longer waited for.
        self.session_closed = asyncio.Event()
        #: The link's ``run`` is over.
        self.gone = asyncio.Event()
        #: Handed over: the engine session goes on, so nothing more is waited for
        #: and the link is read until the engine answers its close.
        self.live = False
        self._intake: asyncio.Task[None] | None = None

    def start(self, relay: UpstreamEnds, tg: asyncio.TaskGroup, name: str) -> None:
        """Hand engine frames to ``relay`` from a task in the session's TaskGroup."""
        self._intake = tg.create_task(self._run(relay), name=name)

    async def _run(self, relay: UpstreamEnds) -> None:
        # Not one try/finally: compiled, the finally block would take ``clean`` as the
        # bool the try narrowed it to, and a cancelled run has none.
        try:
            clean = await self.link.run(relay)
        except BaseException:
            self.gone.set()
            relay.upstream_ended(None)
            raise
        self.gone.set()
        relay.upstream_ended(clean)

    def saw(self, event: UpstreamEvent) -> None:
        """An engine event went through the core: its ``session.closed`` ends the wait."""
        if event.kind is EventKind.SESSION_CLOSED:
            self.session_closed.set()

    def hand_over(self) -> None:
        """The session leaves this engine link without ``session.close``."""
        self.live = True
        self.session_closed.set()  # no session.closed to wait for

    async def close(self, session_close_timeout: float, close_timeout: float) -> None:
        """After ``session.close`` went: wait for the engine's answer, then close the link.

        Args:
            session_close_timeout: how long ``session.closed`` is waited for
                (``upstream_close_timeout``).
            close_timeout: the WebSocket close handshake's bound.

        After a hand-over the engine session still streams: the link is read until
        the engine answers the close, or an engine blocked on a full socket would
        not read it before ``close_timeout``.
        """
        live = self.live
        if not self.gone.is_set() and not live:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(session_close_timeout):
                    await first_set(self.session_closed, self.gone)
        if not live:
            await cancel_and_wait(self._intake)  # the engine had its chance to answer
        with contextlib.suppress(Exception):
            async with asyncio.timeout(close_timeout):
                await self.link.close()
        await cancel_and_wait(self._intake)
