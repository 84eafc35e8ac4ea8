"""``cancel_and_wait`` and ``first_set`` (proxy/session/tasks.py): the shell's two waits.

A cancelled task is over when ``cancel_and_wait`` returns; ``first_set`` leaves
no waiter behind.
"""

from __future__ import annotations

import asyncio

from proxy.session.tasks import cancel_and_wait, first_set


async def test_a_cancelled_task_has_ended_when_the_wait_returns() -> None:
    cleaned = asyncio.Event()

    async def owned() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself yields
            cleaned.set()

    task = asyncio.create_task(owned())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and cleaned.is_set()


async def test_no_task_or_a_finished_one_is_nothing_to_do() -> None:
    await cancel_and_wait(None)

    async def quick() -> None:
        return None

    task = asyncio.create_task(quick())
    await task
    await cancel_and_wait(task)
    assert not task.cancelled()


async def test_the_caller_is_not_cancelled_by_the_wait() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_first_set_returns_when_any_event_is_set_and_leaves_no_waiter() -> None:
    a, b = asyncio.Event(), asyncio.Event()
    before = len(asyncio.all_tasks())
    waiting = asyncio.create_task(first_set(a, b))
    await asyncio.sleep(0)
    assert not waiting.done()
    b.set()
    await asyncio.wait_for(waiting, timeout=5)
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before, "the waiters on the other events are gone"


async def test_first_set_of_an_event_already_set_does_not_wait() -> None:
    done = asyncio.Event()
    done.set()
    await asyncio.wait_for(first_set(asyncio.Event(), done), timeout=5)
