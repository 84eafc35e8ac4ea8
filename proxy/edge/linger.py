"""The lingering close after an error answer before the upgrade.

Closing a socket while the client's bytes are still unread makes the kernel
reset the connection, and a client still sending then loses the answer it has
not read yet. So after an error answer the edge (proxy/edge/guard.py,
whose docstring states the limits) shuts the write side, reads and drops what
the client still sends until it closes, falls quiet for
``lingering_timeout`` or ``lingering_time`` has passed, and only then closes
the socket. Past ``max_lingering_bytes`` reading stops (TCP flow control holds
the client at no cost) and the socket waits for ``lingering_time``. A
lingering connection counts against ``max_pending_handshakes``.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Linger", "LingerGuard", "LingerLimits"]


class LingerLimits(Protocol):
    """The edge's limits a lingering close reads."""

    @property
    def lingering_time(self) -> float: ...

    @property
    def lingering_timeout(self) -> float: ...

    @property
    def max_lingering_bytes(self) -> int: ...


class LingerGuard(Protocol):
    """What a lingering close reports to the edge (``EdgeGuard``)."""

    @property
    def limits(self) -> LingerLimits: ...

    lingering: int

    def lingered(self, outcome: str) -> None:
        """One lingering close ended with ``outcome``."""


class Linger:
    """One connection's lingering close.

    Args:
        transport: the connection, its answer written; now owned by this object.
        guard: the edge's limits (read once, here) and counts.
    """

    __slots__ = (
        "_loop",
        "_timer",
        "deadline",
        "guard",
        "heard",
        "outcome",
        "paused",
        "received",
        "transport",
    )

    def __init__(self, transport: asyncio.Transport, guard: LingerGuard) -> None:
        self._loop = asyncio.get_running_loop()
        limits = guard.limits
        self.transport = transport
        self.guard = guard
        now = self._loop.time()
        self.deadline = now + limits.lingering_time
        self.heard = now
        self.received = 0
        #: Reading stopped at max_lingering_bytes; the deadline ends it.
        self.paused = False
        #: How it ended; empty while it lingers.
        self.outcome = ""
        guard.lingering += 1
        if transport.can_write_eof():  # FIN after the answer (TLS: the close does it)
            transport.write_eof()
        if not transport.is_reading():  # aiohttp may have paused it (a declined upgrade's tail)
            transport.resume_reading()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(
            self._next_check(), self._check
        )

    def _next_check(self) -> float:
        if self.paused:  # nothing is heard any more: only the deadline is left
            return self.deadline
        return min(self.deadline, self.heard + self.guard.limits.lingering_timeout)

    def discard(self, data: bytes) -> None:
        """Bytes the client still sent: dropped, counted against ``max_lingering_bytes``.

        Past the cap reading stops (the client's sends stall on a full TCP
        window) and the socket waits for ``lingering_time``, so that a client
        still sending has that long to read the answer before the reset.
        """
        if self.outcome or self.paused:
            return
        self.received += len(data)
        self.heard = self._loop.time()
        if self.received > self.guard.limits.max_lingering_bytes:
            self.paused = True
            self.transport.pause_reading()
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(self.deadline, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.outcome:  # ended, but its answer is still unsent at the deadline
            self.transport.abort()
            return
        now = self._loop.time()
        if now >= self.deadline:
            self.end("byte_limit" if self.paused else "time_limit")
        elif now >= self.heard + self.guard.limits.lingering_timeout:
            self.end("quiet")
        else:
            self._timer = self._loop.call_at(self._next_check(), self._check)

    def end(self, outcome: str) -> None:
        """Close the socket now; count ``outcome`` (the first one only)."""
        if self.outcome:
            return
        self.outcome = outcome
        self.guard.lingered(outcome)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self.transport
        transport.close()
        if transport.get_write_buffer_size():
            # close() waits for the answer to be sent; a client that reads
            # nothing would hold the socket: no longer than the deadline.
            self._timer = self._loop.call_at(max(self.deadline, self._loop.time()), self._check)

    def lost(self, exc: BaseException | None) -> None:
        """The socket is gone (closed here, or reset by the client)."""
        self.end("reset" if exc is not None else "client_closed")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard.lingering -= 1
