"""``RelayLimits``: the bounds and deadlines of one session's I/O shell, as one value.

The core gets its limits as ``SessionSettings``; the shell around it (the
relay, its writer and its timers) gets these. Built from the settings by the
edge for every session (``RelayLimits.from_settings``), or directly in tests.
Durations are seconds, sizes bytes; 0 turns a timer or bound off where it says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.settings import Settings

__all__ = ["RelayLimits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLimits:
    """What the relay may spend and wait for (the settings of the same names).

    Attributes:
        close_timeout: seconds a closing session has to deliver its final
            events (then the socket is aborted); also the bound on each close
            handshake.
        drain_timeout: seconds to deliver what is queued when the engine is lost.
        upstream_close_timeout: seconds to wait for the engine's ``session.closed``.
        write_buffer_bytes: the client write bound (``client_write_buffer_bytes``).
        max_session_duration: seconds a session may last; 0 = off.
        client_idle_timeout: seconds without a client event; 0 = off.
        heartbeat_interval: keepalive interval on both sides; 0 = off.
    """

    close_timeout: float
    drain_timeout: float
    upstream_close_timeout: float
    write_buffer_bytes: int = 64 * 1024
    max_session_duration: float = 0.0
    client_idle_timeout: float = 0.0
    heartbeat_interval: float = 0.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RelayLimits:
        return cls(
            close_timeout=settings.close_timeout,
            drain_timeout=settings.drain_timeout,
            upstream_close_timeout=settings.upstream_close_timeout,
            write_buffer_bytes=settings.client_write_buffer_bytes,
            max_session_duration=settings.max_session_duration,
            client_idle_timeout=settings.client_idle_timeout,
            heartbeat_interval=settings.heartbeat_interval,
        )
