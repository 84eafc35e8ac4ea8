"""What the relay and an engine link expect of each other.

The link pushes engine frames into the relay (:class:`UpstreamHandler`) as
they are parsed, and the relay's answer to a frame is the list of frames to
send back at once (a playback ack that was due, say): no flag and no second
call to pull them. The relay sends through the link without awaiting
(:meth:`UpstreamLink.send_nowait`), whichever implementation it is, so a
client frame is handled the same way whether it was pushed by aiohttp's
parser or read from its queue; it awaits only to respect the engine's flow
control (:meth:`UpstreamLink.wait_drained`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Final, Protocol

__all__ = [
    "CLEAN_CLOSES",
    "NO_COMMANDS",
    "NO_STATUS",
    "UpstreamConnectError",
    "UpstreamHandler",
    "UpstreamLink",
]

#: Engine close codes that are a clean end (anything else: engine_unavailable).
#: 1005: a Close frame without a code (RFC 6455 §7.1.5), as aiohttp also takes it.
CLEAN_CLOSES: Final = frozenset({1000, 1001, 1005})
#: A Close frame without a code, as the receiver reports it (RFC 6455 §7.1.5).
NO_STATUS: Final = 1005
#: What :meth:`UpstreamHandler.upstream_text` returns when nothing is to be sent.
NO_COMMANDS: Final[Sequence[str]] = ()


class UpstreamHandler(Protocol):
    """What the link calls for each engine frame (the relay)."""

    def upstream_text(self, text: str) -> Sequence[str]:
        """One engine text message.

        Returns:
            The frames to send to the engine now, in order (usually
            :data:`NO_COMMANDS`); the link sends them without waiting.
        """

    def upstream_binary(self, size: int) -> None:
        """One engine binary message (not part of the protocol: dropped)."""

    def upstream_alive(self) -> None:
        """A control frame arrived (the keepalive's proof of life)."""


class UpstreamLink(Protocol):
    """What the relay needs of its engine connection."""

    @property
    def backlog(self) -> Sized:
        """Engine frames parsed and not yet handed over (a live view)."""

    @property
    def closed(self) -> bool: ...

    @property
    def close_code(self) -> int | None: ...

    @property
    def write_paused(self) -> bool:
        """Input toward the engine is above its mark (``send_nowait`` still queues)."""

    #: Called when a paused link drained (set by the relay).
    on_drained: Callable[[], None] | None

    async def wait_drained(self) -> None:
        """Return once the link is not write-paused (at once when it is not)."""

    def input_backlog(self) -> int:
        """Bytes written toward the engine that it has not taken yet."""

    def send_nowait(self, text: str) -> None:
        """Queue a text frame; it is written at the end of the loop tick.

        A connection that went away drops it silently (the relay learns of the
        end from :meth:`run`).
        """

    async def send(self, text: str) -> None:
        """:meth:`send_nowait`, then wait while the link is above its write mark."""

    async def first_text(self, timeout: float) -> str | None:
        """The engine's first text frame, without taking it (``run`` hands it over first).

        Returns:
            It, once it arrived within ``timeout`` seconds (before ``run``);
            None when nothing came in time, the first frame is not text, or
            the connection ended without one.
        """

    async def run(self, handler: UpstreamHandler) -> bool:
        """Hand engine frames to ``handler`` until the connection ends.

        Returns:
            True when the engine closed cleanly (close code 1000 or 1001).
        """

    async def ping(self) -> None: ...

    def abort(self) -> None:
        """Drop the connection now."""

    async def close(self) -> None: ...


class UpstreamConnectError(Exception):
    """The engine WebSocket could not be opened (refused, timed out, not 101)."""
