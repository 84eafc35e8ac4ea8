"""``UpstreamSide`` (proxy/session/upstream_side.py): the engine end of a session.

Engine frames reach the relay while the link runs; the relay hears once how the
link ended; closing waits a bounded time for the engine's ``session.closed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from proxy.session.upstream_link import NO_COMMANDS
from proxy.session.upstream_side import UpstreamSide
from tests.conftest import MS, wait_until
from tests.proxy.session.fakes import FakeUpstream


class Relay:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ended: list[bool | None] = []

    def upstream_text(self, text: str) -> Sequence[str]:
        self.texts.append(text)
        return NO_COMMANDS

    def upstream_binary(self, size: int) -> None:
        pass

    def upstream_alive(self) -> None:
        pass

    def upstream_ended(self, clean: bool | None) -> None:
        self.ended.append(clean)


async def test_frames_reach_the_relay_in_order_and_a_clean_close_is_told_once() -> None:
    link = FakeUpstream()
    side, relay = UpstreamSide(link), Relay()
    async with asyncio.TaskGroup() as tg:
        side.start(relay, tg, "intake")
        link.feed('{"type":"a"}')
        link.feed('{"type":"b"}')
        link.feed_close(1000)
    assert relay.texts == ['{"type":"a"}', '{"type":"b"}']
    assert relay.ended == [True] and side.gone.is_set()


async def test_an_engine_that_vanishes_is_not_a_clean_end() -> None:
    link = FakeUpstream()
    side, relay = UpstreamSide(link), Relay()
    async with asyncio.TaskGroup() as tg:
        side.start(relay, tg, "intake")
        link.feed_close(1011)
    assert relay.ended == [False]


async def test_close_waits_for_the_engines_session_closed_then_closes_the_link() -> None:
    link = FakeUpstream()
    side, relay = UpstreamSide(link), Relay()
    async with asyncio.TaskGroup() as tg:
        side.start(relay, tg, "intake")
        closing = tg.create_task(side.close(100_000 * MS, 100_000 * MS))
        await asyncio.sleep(0)
        assert not closing.done(), "waiting for session.closed"
        side.session_closed.set()
    assert link.closed
    assert relay.ended == [None], "the intake was stopped, not ended by the engine"


async def test_an_engine_that_never_answers_is_waited_for_a_bounded_time() -> None:
    link = FakeUpstream()
    side, relay = UpstreamSide(link), Relay()
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tg:
        side.start(relay, tg, "intake")
        await asyncio.sleep(0)
        started = loop.time()
        await side.close(20 * MS, 100_000 * MS)
        assert loop.time() - started >= 20 * MS * 0.9
    assert link.closed and side.gone.is_set()


async def test_close_after_the_link_ended_does_not_wait() -> None:
    link = FakeUpstream()
    side, relay = UpstreamSide(link), Relay()
    async with asyncio.TaskGroup() as tg:
        side.start(relay, tg, "intake")
        link.feed_close(1000)
        await wait_until(side.gone.is_set, what="the link's end")
        await asyncio.wait_for(side.close(100_000 * MS, 100_000 * MS), timeout=10_000 * MS)
    assert relay.ended == [True]
