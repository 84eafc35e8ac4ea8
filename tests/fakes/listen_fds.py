"""Pass inherited descriptors to a command as systemd does (``sd_listen_fds(3)``).

``python tests/fakes/listen_fds.py FD[=NAME] ... -- COMMAND ARGS...`` moves each
FD (inherited through ``pass_fds``) to 3, 4, ... in order, closes the
originals, sets ``LISTEN_FDS``, ``LISTEN_PID`` (its own pid, which the command
keeps across ``exec``) and, when any has a NAME, ``LISTEN_FDNAMES``, then execs
COMMAND. ``--pid N`` sets ``LISTEN_PID`` to N instead (sockets meant for
another process).

Unlike ``systemd-socket-activate`` (which binds its own socket and starts the
command at the first connection), the caller holds the listening socket, so
one socket can be handed to several processes in turn, as systemd does across
a restart of the service.
"""

from __future__ import annotations

import fcntl
import os
import sys

START = 3  # SD_LISTEN_FDS_START
#: Where the descriptors wait while they are moved (above any they are moved to).
PARKED = 100


def main(argv: list[str]) -> None:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    pid = str(os.getpid())
    if "--pid" in options:
        at = options.index("--pid")
        pid = options[at + 1]
        del options[at : at + 2]
    names: list[str] = []
    sources: list[int] = []
    for option in options:
        fd, _, name = option.partition("=")
        sources.append(int(fd))
        names.append(name)
    # Out of the way first, so that moving one to 3 never overwrites another still to move.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, PARKED) for fd in sources]
    for fd in sources:
        os.close(fd)
    for index, fd in enumerate(high):
        os.dup2(fd, START + index)  # inheritable, as systemd passes them
        os.close(fd)
    os.environ["LISTEN_FDS"] = str(len(sources))
    os.environ["LISTEN_PID"] = pid
    if any(names):
        os.environ["LISTEN_FDNAMES"] = ":".join(names)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
