"""The client listener's session slots (docs/design.md, Admission and lifecycle).

What is the edge's own: ``max_sessions`` slots and the ``admission_timeout``
wait for one, per-address counts (``max_sessions_per_ip``), the connections
that read their first message before taking any (``max_resume_waits``,
``max_resume_waits_per_key``: docs/design.md, Resume), and the
sidecar's own shutdown (``draining``). Whether the engines admit is not kept
here: ``ProxyState.router`` (proxy/edge/state.py) is the one reference to the
engines layer's :class:`~engine_launcher.admission.EngineAdmission`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

__all__ = ["Admission", "FirstMessageWait", "first_data"]


async def first_data(client: Any) -> Any:
    """``client``'s first message that is not a ping or a pong (a ping is answered): what
    the engine reads as the first message, since control frames never reach it. With
    ``autoping`` off aiohttp returns a ping as a message of its own."""
    while True:
        msg = await client.receive()
        if msg.type is aiohttp.WSMsgType.PING:
            with contextlib.suppress(Exception):
                await client.pong(msg.data)
        elif msg.type is not aiohttp.WSMsgType.PONG:
            return msg


class FirstMessageWait:
    """One connection reading its first message before it takes a slot (it may resume).

    :meth:`evict` ends the wait at once, as if the deadline had passed: the
    connection is then refused (its place went to a newer connection).
    """

    __slots__ = ("_scope", "evicted", "key_id")

    def __init__(self, key_id: str) -> None:
        self.key_id = key_id
        self.evicted = False
        self._scope: asyncio.Timeout | None = None

    def evict(self) -> None:
        self.evicted = True
        if self._scope is not None:
            self._scope.reschedule(asyncio.get_running_loop().time())

    async def receive(self, client: Any, timeout: float) -> Any:
        """``client``'s first message; None when none came within ``timeout`` or evicted."""
        if self.evicted:
            return None
        try:
            async with asyncio.timeout(timeout) as scope:
                self._scope = scope
                return await first_data(client)
        except TimeoutError:
            return None
        finally:
            self._scope = None


class Admission:
    """Session slots, per-address counts and the sidecar's own shutdown.

    Args:
        max_sessions: concurrent sessions; 0 = unlimited.
        admission_timeout: seconds to wait for a free slot before refusing.
        max_sessions_per_ip: concurrent sessions per client address; 0 = unlimited.
        max_resume_waits, max_resume_waits_per_key: connections reading their
            first message without a slot, in all and per API key (a key with
            more sessions a resume could take over may have as many); at a bound
            the oldest wait of that key (in all: of the key with the most) is
            evicted, so a newcomer, the owner's resume included, always waits.
    """

    def __init__(
        self,
        max_sessions: int,
        admission_timeout: float,
        *,
        max_sessions_per_ip: int = 0,
        max_resume_waits: int = 256,
        max_resume_waits_per_key: int = 16,
    ) -> None:
        self.max_sessions = max_sessions
        self.admission_timeout = admission_timeout
        self.max_sessions_per_ip = max_sessions_per_ip
        self.max_resume_waits = max_resume_waits
        self.max_resume_waits_per_key = max_resume_waits_per_key
        self.per_ip: dict[str, int] = {}
        #: Connections reading their first message without a slot, oldest first, and per key.
        self.waits: dict[FirstMessageWait, None] = {}
        self._waits_per_key: dict[str, int] = {}
        self.active = 0
        #: The sidecar is shutting down: nothing new is admitted.
        self.draining = False
        self._freed = asyncio.Condition()

    def has_slot(self) -> bool:
        """A session slot is free now (``/readyz`` asks without taking one)."""
        return self.max_sessions == 0 or self.active < self.max_sessions

    async def acquire(self) -> bool:
        """Take a slot, waiting up to ``admission_timeout``. False when none came."""
        if not self.has_slot() and self.admission_timeout > 0:
            async with self._freed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.admission_timeout):
                        await self._freed.wait_for(self.has_slot)
        if not self.has_slot():
            return False
        self.active += 1
        return True

    def acquire_ip(self, address: str) -> bool:
        """Count a session of one client address; False when it has too many."""
        if self.max_sessions_per_ip <= 0:
            return True
        count = self.per_ip.get(address, 0)
        if count >= self.max_sessions_per_ip:
            return False
        self.per_ip[address] = count + 1
        return True

    def release_ip(self, address: str) -> None:
        if self.max_sessions_per_ip <= 0:
            return
        count = self.per_ip.get(address, 0) - 1
        if count > 0:
            self.per_ip[address] = count
        else:
            self.per_ip.pop(address, None)

    def begin_wait(
        self, key_id: str, sessions: int = 0
    ) -> tuple[FirstMessageWait, FirstMessageWait | None]:
        """A connection of ``key_id`` reads its first message before taking a slot.

        Args:
            sessions: the key's sessions a resume could take over; the key may
                have as many waits at least, so all its calls come back at once.

        Returns:
            Its wait, and the wait evicted to make room for it (None: there
            was room). The oldest wait of the same key goes when the key has
            ``max_resume_waits_per_key`` (or ``sessions``); else, when
            ``max_resume_waits`` wait in all, the oldest of the key with the
            most waits. Silent connections push out each other, never a newer one.
        """
        evicted: FirstMessageWait | None = None
        per_key = max(1, self.max_resume_waits_per_key, sessions)
        if self._waits_per_key.get(key_id, 0) >= per_key:
            evicted = next(w for w in self.waits if w.key_id == key_id)
        elif len(self.waits) >= max(1, self.max_resume_waits):
            busiest = max(self._waits_per_key, key=self._waits_per_key.__getitem__)
            evicted = next(w for w in self.waits if w.key_id == busiest)
        if evicted is not None:
            self.end_wait(evicted)
            evicted.evict()
        wait = FirstMessageWait(key_id)
        self.waits[wait] = None
        self._waits_per_key[key_id] = self._waits_per_key.get(key_id, 0) + 1
        return wait, evicted

    def end_wait(self, wait: FirstMessageWait) -> None:
        """The wait is over (read, timed out or evicted); no-op the second time."""
        if self.waits.pop(wait, 0) is None:
            left = self._waits_per_key.pop(wait.key_id, 1) - 1
            if left > 0:
                self._waits_per_key[wait.key_id] = left

    async def release(self) -> None:
        self.active -= 1
        async with self._freed:
            self._freed.notify_all()

    async def wait_idle(self) -> None:
        """Wait until no session holds a slot (handshakes in flight included)."""
        async with self._freed:
            await self._freed.wait_for(lambda: self.active == 0)
