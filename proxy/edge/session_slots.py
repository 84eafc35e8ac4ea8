"""The client listener's session slots (docs/design.md, Admission and lifecycle).

What is the edge's own: ``max_sessions`` slots and the ``admission_timeout``
wait for one, per-address counts (``max_sessions_per_ip``), and the
sidecar's own shutdown (``draining``). Whether the engines admit is not kept
here: ``ProxyState.router`` (proxy/edge/state.py) is the one reference to the
engines layer's :class:`~engine_launcher.admission.EngineAdmission`.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Admission"]


class Admission:
    """Session slots, per-address counts and the sidecar's own shutdown.

    Args:
        max_sessions: concurrent sessions; 0 = unlimited.
        admission_timeout: seconds to wait for a free slot before refusing.
        max_sessions_per_ip: concurrent sessions per client address; 0 = unlimited.
    """

    def __init__(
        self,
        max_sessions: int,
        admission_timeout: float,
        *,
        max_sessions_per_ip: int = 0,
    ) -> None:
        self.max_sessions = max_sessions
        self.admission_timeout = admission_timeout
        self.max_sessions_per_ip = max_sessions_per_ip
        self.per_ip: dict[str, int] = {}
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

    async def release(self) -> None:
        self.active -= 1
        async with self._freed:
            self._freed.notify_all()

    async def wait_idle(self) -> None:
        """Wait until no session holds a slot (handshakes in flight included)."""
        async with self._freed:
            await self._freed.wait_for(lambda: self.active == 0)
