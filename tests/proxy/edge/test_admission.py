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
