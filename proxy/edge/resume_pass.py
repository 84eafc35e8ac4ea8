"""A resume of a session not held here: every engine replica is asked at once.

proxy/edge/session_open.py sends a ``session.resume`` that no session here
holds to the engines (docs/design.md, Resume). With a pool, the placed
replica and every other serving one are asked together: the first that does
not answer "unknown session" gets the session, the rest are let go together,
so a refusal takes the slowest answer, not the answers added up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from proxy.edge.resume import resume_unknown
from proxy.session.upstream_link import UpstreamLink

__all__ = ["Asked", "ask_replicas"]

#: A replica (None: the one engine), its link and the link's URL.
Asked = tuple[int | None, UpstreamLink, str]


async def ask_replicas(
    text: str,
    placed: Asked,
    others: Sequence[int],
    connect: Callable[[int], Awaitable[Asked | None]],
    *,
    timeout: float,
    close_timeout: float,
) -> Asked:
    """Send ``text`` on ``placed``'s link and, at once, to each of ``others``.

    Args:
        connect: a link to a replica (None: it could not be reached).
        timeout: how long each answer is waited for.
        close_timeout: how long closing each link not needed may take.

    Returns:
        The replica that holds the session, its answer first on its link;
        ``placed`` when none does (its refusal is first on its link then).
    """
    asked = [placed]
    found: list[Asked] = []
    tasks: list[asyncio.Task[None]] = []

    async def ask(engine: int | None) -> None:
        if engine == placed[0]:
            link = placed[1]
        else:
            assert engine is not None
            reached = await connect(engine)
            if reached is None:
                return
            asked.append(reached)
            link = reached[1]
        link.send_nowait(text)
        answer = await link.first_text(timeout)
        if not found and answer is not None and not resume_unknown(answer):
            found.append(next(a for a in asked if a[1] is link))
            for task in tasks:
                if task is not asyncio.current_task():
                    task.cancel()  # found: the others' answers are not needed

    async with asyncio.TaskGroup() as tg:
        tasks.append(tg.create_task(ask(placed[0])))
        tasks += [tg.create_task(ask(engine)) for engine in others if engine != placed[0]]
    chosen = found[0] if found else placed
    async with asyncio.TaskGroup() as tg:  # let go together: one close_timeout in all
        for _engine, link, _url in asked:
            if link is not chosen[1]:
                tg.create_task(_close(link, close_timeout))
    return chosen


async def _close(link: UpstreamLink, timeout: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await link.close()
