"""sd_notify over ``NOTIFY_SOCKET`` (systemd's Type=notify protocol); a no-op without it."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier", "watchdog_interval"]


class Notifier:
    """Sends datagrams like ``READY=1`` to the socket systemd gave us.

    Args:
        environ: where to read ``NOTIFY_SOCKET`` (pass ``os.environ``).
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        address = environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address or None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram. Returns False when disabled or failed.

        Never blocks: it runs on the event loop, and a datagram socket whose
        reader is behind (its queue holds ``net.unix.max_dgram_qlen`` datagrams,
        10 by default) would stall a blocking send, and every session with it.
        Such a datagram is dropped (False), as is one to a socket that is gone.
        """
        if self.address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        # Non-blocking: called from the event loop, and a receiver whose queue
        # is full (a stalled manager) must cost a dropped datagram, not a hang.
        kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        try:
            with socket.socket(socket.AF_UNIX, kind) as sock:
                sock.connect(self.address)
                sock.send(payload)
        except OSError:  # BlockingIOError included: the reader is behind
            return False
        return True

    def status(self, text: str) -> bool:
        return self.notify("STATUS=" + text.replace("\n", " "))


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None."""
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2_000_000 if value > 0 else None
