"""Listening sockets systemd passes (socket activation, ``sd_listen_fds(3)``).

:func:`listen_fds` reads ``LISTEN_PID``/``LISTEN_FDS``/``LISTEN_FDNAMES`` as
``sd_listen_fds_with_names`` does, without I/O; :meth:`ListenFds.by_listener`
says which listener each descriptor is. :func:`take_passed_sockets` is the
thin shell: it unsets the variables, marks the descriptors close-on-exec (the
engine child never gets them), checks each is a listening TCP socket and wraps
it. Why, and what a restart behind a held socket does: docs/design.md, Socket
activation.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Final

from proxy.errors import ProxyError

__all__ = [
    "ADMIN_FDNAME",
    "CLIENT_FDNAME",
    "LISTEN_VARIABLES",
    "SD_LISTEN_FDS_START",
    "ActivationError",
    "ListenFds",
    "PassedSockets",
    "listen_fds",
    "take_passed_sockets",
]

#: The first passed descriptor (``SD_LISTEN_FDS_START`` in sd-daemon.h).
SD_LISTEN_FDS_START: Final = 3
#: What ``sd_listen_fds(1)`` unsets, whether or not the sockets were for us.
LISTEN_VARIABLES: Final = ("LISTEN_PID", "LISTEN_PIDFDID", "LISTEN_FDS", "LISTEN_FDNAMES")
#: ``FileDescriptorName=`` of the client listener's socket (``listen``).
CLIENT_FDNAME: Final = "client"
#: ``FileDescriptorName=`` of the admin listener's socket (``admin_listen``).
ADMIN_FDNAME: Final = "admin"
#: The listener (as :class:`~proxy.server.Sidecar` names it) of each known name.
_LISTENER_OF: Final = {CLIENT_FDNAME: "listen", ADMIN_FDNAME: "admin"}
_DECIMAL: Final = re.compile(r"[0-9]+")
_FAMILIES: Final = {socket.AF_INET: "IPv4", socket.AF_INET6: "IPv6"}


class ActivationError(ProxyError, ValueError):
    """The sockets systemd passed cannot be used; ``str()`` is the one line to print.

    Args:
        problem: what is wrong.
        fd: the descriptor it is about; None: the ``LISTEN_*`` variables themselves.
        name: that descriptor's name (``LISTEN_FDNAMES``).
    """

    problem: str
    fd: int | None
    name: str | None

    def __init__(self, problem: str, *, fd: int | None = None, name: str | None = None) -> None:
        self.problem = problem
        self.fd = fd
        self.name = name
        super().__init__(problem if fd is None else f"fd {fd} (name {name!r}): {problem}")


@dataclass(frozen=True, slots=True)
class ListenFds:
    """The descriptors passed to this process (from fd 3 on) and their names.

    A name is the socket unit's ``FileDescriptorName=`` (``LISTEN_FDNAMES``);
    ``unknown`` for each when the variable is not set, as systemd says.
    """

    fds: tuple[int, ...]
    names: tuple[str, ...]

    def by_listener(self) -> dict[str, tuple[int, ...]]:
        """``{"listen": fds, "admin": fds}`` for the listeners that were passed a socket.

        Descriptors named ``client`` are the client listener's, ``admin`` the
        admin listener's (several each: one per address, e.g. IPv4 and IPv6).
        With none named ``client``, the first of the others is the client
        listener's. A listener that gets none binds its own address.

        Raises:
            ActivationError: a descriptor that would be neither (nobody would
                accept on a socket systemd listens on).
        """
        roles: dict[str, list[int]] = {}
        spare: list[tuple[int, str]] = []
        for fd, name in zip(self.fds, self.names, strict=True):
            listener = _LISTENER_OF.get(name)
            if listener is None:
                spare.append((fd, name))
            else:
                roles.setdefault(listener, []).append(fd)
        if "listen" not in roles and spare:
            roles["listen"] = [spare.pop(0)[0]]
        if spare:
            fd, name = spare[0]
            raise ActivationError(
                "neither the client nor the admin listener's: name its socket "
                f"FileDescriptorName={CLIENT_FDNAME} or {ADMIN_FDNAME}",
                fd=fd,
                name=name,
            )
        return {listener: tuple(fds) for listener, fds in roles.items()}


def _number(environ: Mapping[str, str], key: str) -> int:
    text = environ[key]
    if not _DECIMAL.fullmatch(text):
        raise ActivationError(f"{key}={environ[key]!r} is not a decimal number")
    return int(text)


def listen_fds(
    environ: Mapping[str, str], *, pid: int, pidfd_id: int | None = None
) -> ListenFds | None:
    """What ``sd_listen_fds_with_names`` reads from ``environ``, for process ``pid``.

    Args:
        environ: the process environment (not changed here).
        pid: this process's id: sockets passed to another (``LISTEN_PID``) are not ours.
        pidfd_id: this process's pidfd inode number where the kernel has one
            (pidfs); compared with ``LISTEN_PIDFDID`` when both are known.

    Returns:
        None when nothing was passed to this process: no ``LISTEN_PID``, another
        process's, or no ``LISTEN_FDS``.

    Raises:
        ActivationError: a variable is malformed, ``LISTEN_FDS`` is not
            positive, or the names are not one per descriptor (``-EINVAL``).
    """
    if "LISTEN_PID" not in environ:
        return None
    listen_pid = _number(environ, "LISTEN_PID")
    if listen_pid <= 0:
        raise ActivationError(f"LISTEN_PID={environ['LISTEN_PID']!r} is not a process id")
    if listen_pid != pid:
        return None  # passed to another process (our parent's, say): not for us
    if "LISTEN_PIDFDID" in environ:
        wanted = _number(environ, "LISTEN_PIDFDID")
        if pidfd_id is not None and wanted != pidfd_id:
            return None  # the same pid, another process (the pid was reused)
    if "LISTEN_FDS" not in environ:
        return None
    count = _number(environ, "LISTEN_FDS")
    if count <= 0:
        raise ActivationError(f"LISTEN_FDS={environ['LISTEN_FDS']!r}: no descriptors")
    fds = tuple(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    if "LISTEN_FDNAMES" not in environ:
        return ListenFds(fds, ("unknown",) * count)
    text = environ["LISTEN_FDNAMES"]
    names = tuple(text.split(":")) if text else ()
    if len(names) != count:
        raise ActivationError(
            f"LISTEN_FDNAMES={text!r} names {len(names)} descriptors, LISTEN_FDS={count}"
        )
    return ListenFds(fds, names)


@dataclass(frozen=True, slots=True)
class PassedSockets:
    """The listening sockets systemd passed, per listener (``listen``, ``admin``)."""

    sockets: Mapping[str, tuple[socket.socket, ...]]
    names: Mapping[int, str]

    def describe(self, listener: str) -> str:
        """``socket from systemd (fd 3 'client')`` for log lines and ``/debug/summary``."""
        fds = ", ".join(
            f"fd {sock.fileno()} {self.names.get(sock.fileno(), '')!r}"
            for sock in self.sockets.get(listener, ())
        )
        return f"socket from systemd ({fds})"


def _own_pidfd_id() -> int | None:
    """This process's pidfd inode number, where each process has its own (pidfs)."""
    try:
        own = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return None
    try:
        other = os.pidfd_open(os.getppid())
    except OSError:
        os.close(own)
        return None
    try:
        mine, theirs = os.fstat(own).st_ino, os.fstat(other).st_ino
    finally:
        os.close(own)
        os.close(other)
    # Before pidfs every pidfd was the one anonymous inode: no id to compare.
    return mine if mine != theirs else None


def _listening_socket(fd: int, name: str) -> socket.socket:
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ActivationError(os.strerror(exc.errno or 0), fd=fd, name=name) from None
    if not stat.S_ISSOCK(mode):
        raise ActivationError("not a socket", fd=fd, name=name)
    sock = socket.socket(fileno=fd)
    problem = None
    if sock.family not in _FAMILIES:
        problem = f"family {sock.family.name}, not TCP over IPv4 or IPv6 (ListenStream=)"
    elif sock.type != socket.SOCK_STREAM:
        problem = f"type {sock.type.name}, not a stream socket (ListenStream=)"
    elif not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        problem = "a socket that does not listen"
    if problem is not None:
        sock.detach()  # closed at exit with the others; nothing of ours to close here
        raise ActivationError(problem, fd=fd, name=name)
    return sock


def take_passed_sockets(environ: MutableMapping[str, str]) -> PassedSockets | None:
    """Take the listening sockets systemd passed to this process, as ``sd_listen_fds(1)``.

    Unsets the ``LISTEN_*`` variables in ``environ`` (pass ``os.environ``)
    whatever they held, so no child (the engine, preflight's checks) sees
    them, and marks every passed descriptor close-on-exec before anything
    else, so no child inherits one. Call it once, before any child starts.

    Returns:
        None when nothing was passed to this process.

    Raises:
        ActivationError: malformed variables, a descriptor that is not open, not
            a listening TCP socket, or named for neither listener.
    """
    try:
        pidfd_id = _own_pidfd_id() if "LISTEN_PIDFDID" in environ else None
        passed = listen_fds(environ, pid=os.getpid(), pidfd_id=pidfd_id)
    finally:
        for key in LISTEN_VARIABLES:
            environ.pop(key, None)
    if passed is None:
        return None
    for fd, name in zip(passed.fds, passed.names, strict=True):
        try:
            os.set_inheritable(fd, False)
        except OSError as exc:
            raise ActivationError(os.strerror(exc.errno or 0), fd=fd, name=name) from None
    names = dict(zip(passed.fds, passed.names, strict=True))
    sockets = {
        listener: tuple(_listening_socket(fd, names[fd]) for fd in fds)
        for listener, fds in passed.by_listener().items()
    }
    return PassedSockets(sockets, names)
