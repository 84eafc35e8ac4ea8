"""Admission without sockets: slots, the admission wait, per-address limits, refusals."""

from __future__ import annotations

import asyncio

from proxy.edge.session_slots import Admission
from proxy.server import Sidecar
from proxy.settings import Settings
from tests.conftest import MS


async def test_max_sessions_slots_are_taken_and_returned() -> None:
    admission = Admission(2, 0.0)
    assert await admission.acquire()
    assert await admission.acquire()
    assert not await admission.acquire(), "the third session over max_sessions = 2"
    await admission.release()
    assert await admission.acquire()


async def test_zero_means_unlimited() -> None:
    admission = Admission(0, 0.0)
    assert all([await admission.acquire() for _ in range(1000)])


async def test_admission_timeout_waits_for_a_slot_freed_meanwhile() -> None:
    admission = Admission(1, 5.0)
    assert await admission.acquire()
    waiter = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    await admission.release()
    async with asyncio.timeout(1000 * MS):
        assert await waiter


async def test_admission_timeout_gives_up_when_no_slot_comes() -> None:
    admission = Admission(1, 50 * MS)
    assert await admission.acquire()
    async with asyncio.timeout(2000 * MS):
        assert not await admission.acquire()


def test_per_address_limit_counts_each_address_apart() -> None:
    admission = Admission(0, 0.0, max_sessions_per_ip=2)
    assert admission.acquire_ip("10.0.0.1") and admission.acquire_ip("10.0.0.1")
    assert not admission.acquire_ip("10.0.0.1")
    assert admission.acquire_ip("10.0.0.2")
    admission.release_ip("10.0.0.1")
    assert admission.acquire_ip("10.0.0.1")


def test_refusal_reasons_in_order_draining_then_not_ready() -> None:
    # The edge's slots (state.admission) and the engines' admission state
    # (state.router, its one reference) are asked together by ProxyState.
    state = Sidecar(Settings(), environ={}).state
    assert state.router is not None
    assert state.refusal() is not None and state.refusal()[0] == "not_ready"  # type: ignore[index]
    state.router.update(0, "ready", "ws://127.0.0.1:9000")
    assert state.refusal() is None
    state.admission.draining = True
    assert state.refusal()[0] == "draining"  # type: ignore[index]


def test_a_key_at_its_wait_cap_pushes_out_its_own_oldest_wait() -> None:
    admission = Admission(0, 0.0, max_resume_waits=100, max_resume_waits_per_key=2)
    first, _ = admission.begin_wait("a")
    second, _ = admission.begin_wait("a")
    other, _ = admission.begin_wait("b")
    third, evicted = admission.begin_wait("a")
    assert evicted is first and first.evicted, "the key's oldest wait goes"
    assert not (second.evicted or third.evicted or other.evicted)
    assert list(admission.waits) == [second, other, third]


def test_at_the_cap_in_all_the_key_with_the_most_waits_loses_its_oldest() -> None:
    admission = Admission(0, 0.0, max_resume_waits=4, max_resume_waits_per_key=100)
    owner_silent, _ = admission.begin_wait("owner")  # the oldest wait of all
    flood = [admission.begin_wait("flood")[0] for _ in range(3)]
    owners_resume, evicted = admission.begin_wait("owner")
    assert evicted is flood[0], "not the owner's: the flooding key's oldest"
    assert not owner_silent.evicted and not owners_resume.evicted
    assert len(admission.waits) == 4


def test_a_wait_ends_once_and_frees_its_place() -> None:
    admission = Admission(0, 0.0, max_resume_waits=1, max_resume_waits_per_key=1)
    wait, _ = admission.begin_wait("a")
    admission.end_wait(wait)
    admission.end_wait(wait)  # the finally after an early end: no-op
    assert not admission.waits
    again, evicted = admission.begin_wait("a")
    assert evicted is None and not again.evicted


async def test_an_evicted_wait_stops_reading_at_once() -> None:
    admission = Admission(0, 0.0, max_resume_waits=1, max_resume_waits_per_key=1)
    wait, _ = admission.begin_wait("a")
    never = asyncio.Event()

    class Silent:
        async def receive(self) -> object:
            await never.wait()
            return object()

    reading = asyncio.ensure_future(wait.receive(Silent(), 3600.0))
    await asyncio.sleep(0)
    admission.begin_wait("a")
    async with asyncio.timeout(1.0):
        assert await reading is None
    assert await wait.receive(Silent(), 3600.0) is None, "evicted before reading: none"


def test_a_key_may_wait_once_for_each_session_it_could_resume() -> None:
    admission = Admission(0, 0.0, max_resume_waits=100, max_resume_waits_per_key=1)
    waits = [admission.begin_wait("a", 3) for _ in range(3)]
    assert [evicted for _, evicted in waits] == [None, None, None], "three calls back at once"
    _, evicted = admission.begin_wait("a", 3)
    assert evicted is waits[0][0]
