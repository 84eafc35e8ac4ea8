"""A session's lifetime around its relay: the TaskGroup, a failure, the cleanup.

Interpreted Python in both builds, on purpose. A coroutine compiled with mypyc
that suspends while it handles an exception (an ``await`` in ``except`` or
``finally``, or a TaskGroup left by an exception) leaves that exception set as
the thread's current one, and later compiled code of any session can raise it
again. An interpreted coroutine keeps the exception it handles to itself, also
for the compiled code it awaits meanwhile (docs/design.md, Performance).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from proxy.session.limits import RelayLimits

__all__ = ["SessionRelay", "run_session"]


class SessionRelay(Protocol):
    """What a session's lifetime needs of its relay (``proxy.session.relay.Relay``)."""

    key: str
    limits: RelayLimits
    log: logging.LoggerAdapter[Any]

    async def serve(self, tg: asyncio.TaskGroup) -> None: ...
    def failed(self) -> None: ...
    def finish(self) -> None: ...
    async def close_connections(self) -> None: ...


async def run_session(relay: SessionRelay) -> None:
    """Run ``relay`` in the session's TaskGroup; a failure is logged and ends it as
    failed; cleanup is bounded by ``close_timeout``. Never raises for peer behaviour."""
    try:
        async with asyncio.TaskGroup() as tg:
            await relay.serve(tg)
    except Exception:
        relay.log.exception("session %s failed", relay.key)
        relay.failed()
    finally:
        relay.finish()
        with contextlib.suppress(Exception):  # whatever is still open, bounded
            async with asyncio.timeout(relay.limits.close_timeout):
                await relay.close_connections()
