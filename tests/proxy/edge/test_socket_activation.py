"""Sockets systemd passes (proxy/edge/socket_activation.py), as ``sd_listen_fds(3)`` reads them.

The pure part (:func:`listen_fds`, :meth:`ListenFds.by_listener`) is a table
of environments; the shell (:func:`take_passed_sockets`) runs in a fresh
Python process that inherits real descriptors at 3, 4, ... through
tests/fakes/listen_fds.py, as a process started by systemd does, and reports
what it took, what it left in its environment and whether each descriptor is
still inheritable. The sidecar serving on them: tests/integration/test_socket_activation.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.edge.socket_activation import (
    SD_LISTEN_FDS_START,
    ActivationError,
    ListenFds,
    listen_fds,
)
from tests.children import clean_env
from tests.conftest import DEADLINE

PID = 4242
LAUNCHER = Path(__file__).resolve().parents[2] / "fakes" / "listen_fds.py"


def env(**values: str) -> dict[str, str]:
    return {"LISTEN_PID": str(PID), **values}


#: Environments near the valid ones (ours or another pid, small counts, known names) and not.
ENVIRONMENTS = st.fixed_dictionaries(
    {},
    optional={
        "LISTEN_PID": st.one_of(st.just(str(PID)), st.text(max_size=6)),
        "LISTEN_FDS": st.one_of(st.integers(-1, 6).map(str), st.text(max_size=4)),
        "LISTEN_FDNAMES": st.lists(
            st.sampled_from(["client", "admin", "unknown", "omni-sidecar.socket", ""]), max_size=6
        ).map(":".join),
        "LISTEN_PIDFDID": st.one_of(st.just("77"), st.text(max_size=4)),
    },
)


class TestListenFds:
    def test_nothing_passed(self) -> None:
        assert listen_fds({}, pid=PID) is None
        assert listen_fds({"LISTEN_FDS": "1"}, pid=PID) is None, "no LISTEN_PID: not ours"
        assert listen_fds(env(), pid=PID) is None, "no LISTEN_FDS"

    def test_passed_to_another_process_is_ignored(self) -> None:
        # Checked before LISTEN_FDS is read, as sd_listen_fds does: not even an error.
        assert listen_fds(env(LISTEN_FDS="1"), pid=PID + 1) is None
        assert listen_fds(env(LISTEN_FDS="garbage"), pid=PID + 1) is None

    def test_one_descriptor_from_3_named_unknown(self) -> None:
        assert listen_fds(env(LISTEN_FDS="1"), pid=PID) == ListenFds((3,), ("unknown",))
        assert SD_LISTEN_FDS_START == 3

    def test_names_one_per_descriptor(self) -> None:
        passed = listen_fds(env(LISTEN_FDS="2", LISTEN_FDNAMES="client:admin"), pid=PID)
        assert passed == ListenFds((3, 4), ("client", "admin"))

    @pytest.mark.parametrize(
        "values",
        [
            {"LISTEN_PID": "abc", "LISTEN_FDS": "1"},
            {"LISTEN_PID": "", "LISTEN_FDS": "1"},
            {"LISTEN_PID": "0", "LISTEN_FDS": "1"},
            {"LISTEN_PID": "-4242", "LISTEN_FDS": "1"},
            {"LISTEN_PID": "+4242", "LISTEN_FDS": "1"},
            {"LISTEN_PID": "4_242", "LISTEN_FDS": "1"},
            env(LISTEN_FDS="0"),
            env(LISTEN_FDS="-1"),
            env(LISTEN_FDS=""),
            env(LISTEN_FDS="two"),
            env(LISTEN_FDS="1", LISTEN_FDNAMES="client:admin"),
            env(LISTEN_FDS="2", LISTEN_FDNAMES="client"),
            env(LISTEN_FDS="1", LISTEN_FDNAMES=""),
            env(LISTEN_FDS="1", LISTEN_PIDFDID="x"),
        ],
        ids=[
            "pid-garbage", "pid-empty", "pid-zero", "pid-negative", "pid-plus",
            "pid-underscore", "fds-zero", "fds-negative", "fds-empty", "fds-garbage",
            "more-names", "fewer-names", "empty-names", "pidfdid-garbage",
        ],
    )  # fmt: skip
    def test_malformed_is_an_error(self, values: dict[str, str]) -> None:
        with pytest.raises(ActivationError):
            listen_fds(values, pid=PID)

    def test_pidfd_id_when_both_are_known(self) -> None:
        values = env(LISTEN_FDS="1", LISTEN_PIDFDID="77")
        assert listen_fds(values, pid=PID, pidfd_id=77) == ListenFds((3,), ("unknown",))
        assert listen_fds(values, pid=PID, pidfd_id=78) is None, "a reused pid"
        assert listen_fds(values, pid=PID, pidfd_id=None) is not None, "no pidfs: pid only"

    @given(ENVIRONMENTS)
    def test_any_environment_is_read_or_refused(self, values: dict[str, str]) -> None:
        try:
            passed = listen_fds(values, pid=PID)
            roles = passed.by_listener() if passed is not None else {}
        except ActivationError:
            return
        assert passed is None or len(passed.fds) == len(passed.names) >= 1
        taken = [fd for fds in roles.values() for fd in fds]
        assert sorted(taken) == sorted(set(taken)), "a descriptor serves one listener"
        assert passed is None or sorted(taken) == list(passed.fds), "each one is used"


class TestByListener:
    @pytest.mark.parametrize(
        ("names", "expected"),
        [
            (("unknown",), {"listen": (3,)}),
            (("omni-sidecar.socket",), {"listen": (3,)}),
            (("client",), {"listen": (3,)}),
            (("admin",), {"admin": (3,)}),
            (("client", "admin"), {"listen": (3,), "admin": (4,)}),
            (("admin", "client"), {"admin": (3,), "listen": (4,)}),
            (("client", "client"), {"listen": (3, 4)}),
            (("admin", "unknown"), {"admin": (3,), "listen": (4,)}),
            (("client", "admin", "client", "admin"), {"listen": (3, 5), "admin": (4, 6)}),
        ],
    )
    def test_which_listener(
        self, names: tuple[str, ...], expected: dict[str, tuple[int, ...]]
    ) -> None:
        fds = tuple(range(3, 3 + len(names)))
        assert ListenFds(fds, names).by_listener() == expected

    @pytest.mark.parametrize(
        "names", [("unknown", "unknown"), ("client", "other"), ("x", "admin", "y")]
    )
    def test_a_socket_nobody_would_accept_on_is_an_error(self, names: tuple[str, ...]) -> None:
        fds = tuple(range(3, 3 + len(names)))
        with pytest.raises(ActivationError, match="FileDescriptorName=client or admin") as caught:
            ListenFds(fds, names).by_listener()
        spare = [(fd, n) for fd, n in zip(fds, names, strict=True) if n not in ("client", "admin")]
        assert (caught.value.fd, caught.value.name) == spare[0 if "client" in names else 1]


# -- the shell, in a process started as systemd starts one ------------------------------------

#: Runs in the child: take the sockets, report what happened.
REPORT = """
import json, os, sys
from proxy.edge.socket_activation import ActivationError, take_passed_sockets
os.environ.update(json.loads(sys.argv[1]))
try:
    passed = take_passed_sockets(os.environ)
except ActivationError as exc:
    report = {"error": str(exc)}
else:
    report = {"passed": None if passed is None else {
        name: [[s.fileno(), s.family.name, s.getsockname()[1], s.get_inheritable()]
               for s in sockets]
        for name, sockets in passed.sockets.items()}}
report["environ"] = sorted(k for k in os.environ if k.startswith("LISTEN_"))
opened = [fd for fd in (3, 4) if os.path.exists(f"/proc/self/fd/{fd}")]
report["inheritable"] = {fd: os.get_inheritable(fd) for fd in opened}
print(json.dumps(report))
"""


def run_passed(
    fds: Sequence[tuple[int, str]], *, pid: str | None = None, **overrides: str
) -> dict[str, Any]:
    """Start the report with ``fds`` at 3, 4, ... (named), as systemd would; its report."""
    options = [f"{fd}={name}" if name else str(fd) for fd, name in fds]
    if pid is not None:
        options += ["--pid", pid]
    argv = [sys.executable, str(LAUNCHER), *options, "--", sys.executable, "-c", REPORT]
    done = subprocess.run(
        [*argv, json.dumps(overrides)],
        pass_fds=[fd for fd, _ in fds],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as sockets:
        yield sockets


def listening(stack: ExitStack, family: int = socket.AF_INET) -> socket.socket:
    sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
    if family == socket.AF_UNIX:
        sock.bind("")  # autobind: an abstract address
    else:
        sock.bind(("127.0.0.1" if family == socket.AF_INET else "::1", 0))
    sock.listen(8)
    return sock


class TestTakePassedSockets:
    def test_client_and_admin_close_on_exec_and_the_variables_gone(self, stack: ExitStack) -> None:
        client, admin = listening(stack), listening(stack)
        report = run_passed([(client.fileno(), "client"), (admin.fileno(), "admin")])
        assert report["passed"] == {
            "listen": [[3, "AF_INET", client.getsockname()[1], False]],
            "admin": [[4, "AF_INET", admin.getsockname()[1], False]],
        }
        assert report["environ"] == [], "LISTEN_* unset: no child sees them"
        assert report["inheritable"] == {"3": False, "4": False}

    def test_ipv6(self, stack: ExitStack) -> None:
        if not socket.has_ipv6:
            pytest.skip("no IPv6")
        try:
            sock = listening(stack, socket.AF_INET6)
        except OSError:
            pytest.skip("no IPv6 loopback")
        report = run_passed([(sock.fileno(), "")])
        assert report["passed"]["listen"][0][:2] == [3, "AF_INET6"]

    def test_passed_to_another_process(self, stack: ExitStack) -> None:
        sock = listening(stack)
        report = run_passed([(sock.fileno(), "client")], pid="1")
        assert report["passed"] is None
        assert report["environ"] == [], "unset all the same, as sd_listen_fds(1) does"
        assert report["inheritable"] == {"3": True}, "not ours: left as it was"

    @pytest.mark.parametrize(
        ("kind", "problem"),
        [
            ("udp", "type SOCK_DGRAM, not a stream socket (ListenStream=)"),
            ("not-listening", "a socket that does not listen"),
            ("unix", "family AF_UNIX, not TCP over IPv4 or IPv6 (ListenStream=)"),
            ("pipe", "not a socket"),
        ],
    )
    def test_a_descriptor_that_cannot_be_served_on(
        self, stack: ExitStack, kind: str, problem: str
    ) -> None:
        fd: int
        if kind == "udp":
            udp = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            udp.bind(("127.0.0.1", 0))
            fd = udp.fileno()
        elif kind == "not-listening":
            tcp = stack.enter_context(socket.socket())
            tcp.bind(("127.0.0.1", 0))
            fd = tcp.fileno()
        elif kind == "unix":
            fd = listening(stack, socket.AF_UNIX).fileno()
        else:
            read, write = os.pipe()
            stack.callback(os.close, read)
            stack.callback(os.close, write)
            fd = read
        report = run_passed([(fd, "client")])
        assert report["error"] == f"fd 3 (name 'client'): {problem}", report
        assert report["environ"] == []

    def test_a_descriptor_that_is_not_open(self, stack: ExitStack) -> None:
        sock = listening(stack)
        report = run_passed([(sock.fileno(), "")], LISTEN_FDS="2")
        assert report["error"] == "fd 4 (name 'unknown'): Bad file descriptor", report
