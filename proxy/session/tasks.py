"""Two small waits the session shell needs, written once.

``cancel_and_wait`` stops a task the session owns and waits until it has
ended (structured concurrency: a cancelled task is never left running);
``first_set`` waits until any of several events is set.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancel_and_wait", "first_set"]


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (one of the caller's own) and wait until it has ended."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def first_set(*events: asyncio.Event) -> None:
    """Wait until any of the events is set."""
    while not any(e.is_set() for e in events):
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
