"""The client listener's accept loop: a process out of file descriptors says so.

:class:`EdgeSite` (in place of aiohttp's ``TCPSite``) binds as
``loop.create_server`` does, accepts each connection itself and hands it to
aiohttp's connection factory. When ``accept()`` fails for lack of descriptors it
spends the one it keeps in reserve to close the waiting connections at once,
counts each (``rejected_connections_total{reason="fd_limit"}``) and logs at a
bounded rate; see docs/design.md, Routes and listeners. It also serves on
sockets systemd passed, accepting only while told to (docs/design.md, Socket
activation).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

__all__ = [
    "ACCEPT_RETRY_DELAY",
    "BACKLOG",
    "FD_LIMIT_LOG_INTERVAL",
    "EdgeSite",
    "Listener",
    "bind",
]

log = logging.getLogger("omni_sidecar.edge.listener")

#: Connections the kernel queues for the listener before refusing more (connections).
BACKLOG: Final = 128
#: Seconds accepting pauses when no connection can be taken (no reserve, no memory).
ACCEPT_RETRY_DELAY: Final = 1.0
#: Seconds between two warnings about connections refused for lack of resources.
FD_LIMIT_LOG_INTERVAL: Final = 60.0
#: The ``rejected_connections_total`` reason of a connection closed for lack of descriptors.
FD_LIMIT: Final = "fd_limit"
_NO_DESCRIPTOR: Final = frozenset({errno.EMFILE, errno.ENFILE})
_NO_MEMORY: Final = frozenset({errno.ENOBUFS, errno.ENOMEM})

CountRefused = Callable[[str, int], None]
"""``refused(reason, count)``: count connections refused at the accept (no log line)."""


def bind(host: str | None, port: int, backlog: int = BACKLOG) -> list[socket.socket]:
    """Listening sockets for ``host:port``, as ``loop.create_server`` binds them.

    Raises:
        OSError: an address could not be bound (every socket opened is closed).
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _take_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class Listener:
    """Accepts on ``sockets`` and hands each connection to ``factory``'s protocol.

    Args:
        sockets: bound, listening, non-blocking sockets (owned from here on).
        factory: the protocol factory (aiohttp's ``web.Server``).
        refused: counts connections refused for lack of descriptors.
        accepting: False: take no connection until :meth:`start_accepting`.
    """

    def __init__(
        self,
        sockets: list[socket.socket],
        factory: Callable[[], Any],
        refused: CountRefused,
        *,
        accepting: bool = True,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.sockets = sockets
        self._factory = factory
        self._refused = refused
        self._reserve = _take_reserve()
        self._handovers: set[asyncio.Task[Any]] = set()
        self._paused: dict[int, asyncio.TimerHandle] = {}
        #: Connections refused since the last warning, and when that was (None: never).
        self._unreported = 0
        self._warned_at: float | None = None
        self._closed = False
        self.accepting = False
        if accepting:
            self.start_accepting()

    def start_accepting(self) -> None:
        """Take connections (again); those waiting in the backlog first."""
        if self.accepting or self._closed:
            return
        self.accepting = True
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def stop_accepting(self) -> None:
        """Take no more connections; new ones wait in the kernel's backlog.

        For a socket another process holds too (systemd's): the next process
        on it takes them.
        """
        if not self.accepting or self._closed:
            return
        self.accepting = False
        for sock in self.sockets:
            handle = self._paused.pop(sock.fileno(), None)
            if handle is not None:
                handle.cancel()
            else:
                self._loop.remove_reader(sock.fileno())

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _address = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _NO_DESCRIPTOR and self._reserve is not None:
                    self._shed(sock, exc)
                elif exc.errno in _NO_DESCRIPTOR or exc.errno in _NO_MEMORY:
                    self._pause(sock, exc)
                else:
                    log.warning("client listener: accept() failed: %s", exc)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._hand_over(conn))
            self._handovers.add(task)
            task.add_done_callback(self._handovers.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception as exc:  # noqa: BLE001 - one connection lost, never the listener
            log.debug("client listener: a connection could not be set up: %s", exc)
            conn.close()

    def _shed(self, sock: socket.socket, exc: OSError) -> None:
        """No descriptor for a new connection: close those waiting, with the reserve's."""
        assert self._reserve is not None
        os.close(self._reserve)
        self._reserve = None
        refused = 0
        try:
            while True:
                try:
                    conn, _address = sock.accept()
                except ConnectionAbortedError:
                    continue
                except OSError:  # the backlog is empty, or still no descriptor
                    break
                conn.close()
                refused += 1
        finally:
            self._reserve = _take_reserve()
        if refused:
            self._refused(FD_LIMIT, refused)
            self._report(exc, refused)
        else:
            self._pause(sock, exc)

    def _pause(self, sock: socket.socket, exc: OSError) -> None:
        """Accept nothing on ``sock`` for ACCEPT_RETRY_DELAY (the backlog holds them)."""
        self._report(exc, 0, paused=True)
        fd = sock.fileno()
        if fd in self._paused or self._closed:
            return
        self._loop.remove_reader(fd)
        self._paused[fd] = self._loop.call_later(ACCEPT_RETRY_DELAY, self._resume, sock)

    def _resume(self, sock: socket.socket) -> None:
        self._paused.pop(sock.fileno(), None)
        if self._reserve is None:
            self._reserve = _take_reserve()
        if self.accepting and not self._closed:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _report(self, exc: OSError, refused: int, *, paused: bool = False) -> None:
        """One WARNING at once, then at most one every FD_LIMIT_LOG_INTERVAL seconds."""
        self._unreported += refused
        now = self._loop.time()
        if self._warned_at is not None and now - self._warned_at < FD_LIMIT_LOG_INTERVAL:
            return
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "client listener: accept() failed (%s; RLIMIT_NOFILE %d): %s; %d connections "
            "closed at once for lack of descriptors since the %s "
            '(omni_sidecar_rejected_connections_total{reason="%s"}); next line in %.0f s '
            "at the earliest",
            errno.errorcode.get(exc.errno or 0, str(exc)),
            soft,
            f"accepting paused for {ACCEPT_RETRY_DELAY:g} s"
            if paused
            else "the waiting connections were closed at once",
            self._unreported,
            "start" if self._warned_at is None else "last such line",
            FD_LIMIT,
            FD_LIMIT_LOG_INTERVAL,
        )
        self._warned_at = now
        self._unreported = 0

    def close(self) -> None:
        """Stop accepting and close the listening sockets (live connections stay)."""
        if self._closed:
            return
        self._closed = True
        for handle in self._paused.values():
            handle.cancel()
        for sock in self.sockets:
            if self.accepting and sock.fileno() not in self._paused:
                self._loop.remove_reader(sock.fileno())
            # Only this process's descriptor: a socket systemd holds stays listening.
            sock.close()
        self._paused.clear()
        for task in self._handovers:
            task.cancel()
        if self._reserve is not None:
            with contextlib.suppress(OSError):
                os.close(self._reserve)
            self._reserve = None


class EdgeSite(web.BaseSite):
    """aiohttp's ``TCPSite`` for the client listener, with :class:`Listener` accepting.

    Args:
        runner: the client application's runner (set up).
        host, port: where to listen (port 0: a free one).
        refused: counts connections refused for lack of descriptors.
        passed: listening sockets to serve on instead of binding ``host:port``
            (systemd's; owned from here on).
        accepting: False: take no connection until :meth:`start_accepting`.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        refused: CountRefused,
        passed: tuple[socket.socket, ...] = (),
        accepting: bool = True,
    ) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self._app_runner = runner
        self._host = host
        self._port = port
        self._on_refused = refused
        self._passed = passed
        self._accepting = accepting
        self._listener: Listener | None = None

    @property
    def name(self) -> str:
        host, port = self._host, self._port
        if self._passed:
            host, port = self._passed[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def start_accepting(self) -> None:
        """See :meth:`Listener.start_accepting`."""
        self._accepting = True
        if self._listener is not None:
            self._listener.start_accepting()

    def stop_accepting(self) -> None:
        """See :meth:`Listener.stop_accepting`."""
        self._accepting = False
        if self._listener is not None:
            self._listener.stop_accepting()

    @property
    def sockets(self) -> list[socket.socket]:
        """The listening sockets (empty before ``start`` and after ``stop``)."""
        return [] if self._listener is None else list(self._listener.sockets)

    async def start(self) -> None:
        server = self._app_runner.server
        assert server is not None, "the runner is set up before its site starts"
        if self._passed:
            sockets = list(self._passed)
            for sock in sockets:
                sock.setblocking(False)
        else:
            sockets = bind(self._host, self._port)  # a bind error leaves nothing registered
        await super().start()
        self._listener = Listener(sockets, server, self._on_refused, accepting=self._accepting)

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await super().stop()
