"""sd_notify (engine_launcher/systemd.py) and the systemd unit that relies on it.

systemd's Type=notify protocol (sd_notify(3)): newline-separated
``KEY=VALUE`` assignments in one datagram to the socket named by
``NOTIFY_SOCKET``; a leading ``@`` names a socket in the abstract namespace.
Each test binds the receiving end itself and asserts the exact bytes sent.
The unit files (deploy/systemd/omni-sidecar.service and the .socket unit that
holds the client listener across restarts) are checked for the settings the
sidecar depends on and, where the binary exists, with ``systemd-analyze
verify`` (Debian package ``systemd``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_launcher.systemd import Notifier, watchdog_interval
from proxy.settings import EngineConfig, Settings

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "omni-sidecar.service"
SOCKET_UNIT = UNIT.with_suffix(".socket")
INSTALLED_EXEC = "/opt/omni-sidecar/venv/bin/omni-sidecar"


def receive(sock: socket.socket) -> bytes:
    sock.settimeout(5.0)
    return sock.recv(65536)


def assert_nothing_sent(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(65536)


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in tmp_path and its NOTIFY_SOCKET value."""
    path = tmp_path / "notify"
    if len(os.fsencode(path)) >= 108:  # sun_path limit; pytest paths can be long
        pytest.skip(f"tmp_path too long for an AF_UNIX address: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield sock, str(path)
    finally:
        sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"omni-sidecar-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        yield sock, "@" + name
    finally:
        sock.close()


class TestNotifier:
    def test_ready(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        assert notifier.enabled
        assert notifier.address == address
        assert notifier.notify("READY=1") is True
        assert receive(sock) == b"READY=1"

    def test_several_assignments_in_one_datagram(
        self, notify_socket: tuple[socket.socket, str]
    ) -> None:
        sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        assert notifier.notify("READY=1", "STATUS=serving; engine simulator ready")
        assert receive(sock) == b"READY=1\nSTATUS=serving; engine simulator ready"
        assert notifier.notify("STOPPING=1", "STATUS=draining")
        assert receive(sock) == b"STOPPING=1\nSTATUS=draining"

    def test_status_is_one_line(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        assert notifier.status("engine restarting in 1.0 s:\nexited with status 1")
        assert receive(sock) == b"STATUS=engine restarting in 1.0 s: exited with status 1"

    def test_extend_timeout_and_watchdog(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        notifier.notify("STATUS=engine starting (15 s): connect", "EXTEND_TIMEOUT_USEC=35000000")
        assert (
            receive(sock) == b"STATUS=engine starting (15 s): connect\nEXTEND_TIMEOUT_USEC=35000000"
        )
        notifier.notify("WATCHDOG=1")
        assert receive(sock) == b"WATCHDOG=1"

    def test_utf8(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, address = notify_socket
        Notifier({"NOTIFY_SOCKET": address}).status("ready after 1.0 s — ok")
        assert receive(sock) == "STATUS=ready after 1.0 s — ok".encode()

    def test_abstract_namespace(self, abstract_socket: tuple[socket.socket, str]) -> None:
        sock, address = abstract_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        assert notifier.address == "\0" + address[1:]
        assert notifier.notify("READY=1")
        assert receive(sock) == b"READY=1"

    @pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}], ids=["unset", "empty"])
    def test_no_op_without_notify_socket(self, environ: dict[str, str]) -> None:
        notifier = Notifier(environ)
        assert not notifier.enabled
        assert notifier.address is None
        assert notifier.notify("READY=1") is False
        assert notifier.status("x") is False

    def test_a_reader_that_is_behind_never_blocks_the_sender(
        self, notify_socket: tuple[socket.socket, str]
    ) -> None:
        """The sender runs on the event loop: once the reader's queue is full, a
        notification is dropped (False) at once instead of waiting for room."""
        sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        started = time.monotonic()
        sent = [notifier.status(f"n={n}") for n in range(200)]
        assert time.monotonic() - started < 2.0
        assert sent[0] is True and sent[-1] is False
        assert receive(sock) == b"STATUS=n=0"

    def test_nothing_to_send(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, address = notify_socket
        assert Notifier({"NOTIFY_SOCKET": address}).notify() is False
        assert_nothing_sent(sock)

    @pytest.mark.timeout(10)
    def test_a_manager_that_does_not_read_costs_a_datagram_not_a_hang(
        self, notify_socket: tuple[socket.socket, str]
    ) -> None:
        # The notifier runs on the event loop: a full receive queue must not block it.
        _sock, address = notify_socket
        notifier = Notifier({"NOTIFY_SOCKET": address})
        results = [notifier.notify(f"STATUS=filler {i} " + "x" * 1000) for i in range(2000)]
        assert results[0] is True, "the first datagrams are queued"
        assert results[-1] is False, "the queue filled: later ones are dropped, not waited for"

    def test_missing_socket_is_not_an_error(self, tmp_path: Path) -> None:
        notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
        assert notifier.enabled
        assert notifier.notify("READY=1") is False

    def test_reads_only_the_mapping_it_was_given(
        self, notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        sock, address = notify_socket
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        assert Notifier({}).notify("READY=1") is False
        assert_nothing_sent(sock)


class TestWatchdogInterval:
    def test_half_of_watchdog_usec(self) -> None:
        assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
        assert watchdog_interval({"WATCHDOG_USEC": "1"}) == 5e-7

    def test_for_this_process_only(self) -> None:
        mine = {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}
        assert watchdog_interval(mine) == 30.0
        other = {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid() + 1)}
        assert watchdog_interval(other) is None

    @pytest.mark.parametrize(
        "environ",
        [
            {},
            {"WATCHDOG_USEC": ""},
            {"WATCHDOG_USEC": "0"},
            {"WATCHDOG_USEC": "-5"},
            {"WATCHDOG_USEC": "sixty"},
            {"WATCHDOG_PID": str(os.getpid())},
        ],
        ids=["unset", "empty", "zero", "negative", "garbage", "pid-only"],
    )
    def test_off(self, environ: dict[str, str]) -> None:
        assert watchdog_interval(environ) is None


# -- deploy/systemd/omni-sidecar.service ----------------------------------------------------


def unit_settings(text: str) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values; systemd allows a key more than once."""
    section = ""
    values: dict[tuple[str, str], list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        values.setdefault((section, key.strip()), []).append(value.strip())
    return values


@pytest.fixture(scope="module")
def unit() -> dict[tuple[str, str], list[str]]:
    return unit_settings(UNIT.read_text())


class TestUnitFile:
    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("Type", "notify"),
            ("NotifyAccess", "main"),
            ("ExecStart", f"{INSTALLED_EXEC} serve --config /etc/omni-sidecar/config.toml"),
            ("EnvironmentFile", "-/etc/omni-sidecar/env"),
            ("User", "omni-sidecar"),
            ("TimeoutStartSec", "1500"),
            ("TimeoutStopSec", "90"),
            ("WatchdogSec", "60"),
            ("Restart", "on-failure"),
            ("RestartSec", "5"),
            ("KillMode", "mixed"),
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "read-only"),
            ("PrivateTmp", "yes"),
        ],
    )
    def test_service_setting(
        self, unit: dict[tuple[str, str], list[str]], key: str, value: str
    ) -> None:
        assert unit[("Service", key)] == [value]

    def test_gpu_devices_stay_reachable(self, unit: dict[tuple[str, str], list[str]]) -> None:
        assert ("Service", "PrivateDevices") not in unit
        assert ("Service", "DeviceAllow") not in unit
        assert unit.get(("Service", "DevicePolicy"), ["auto"]) == ["auto"]
        # Triton / torch.compile need writable executable memory.
        assert ("Service", "MemoryDenyWriteExecute") not in unit

    def test_hf_cache_is_writable(self, unit: dict[tuple[str, str], list[str]]) -> None:
        writable = " ".join(unit[("Service", "ReadWritePaths")]).split()
        env = dict(v.split("=", 1) for v in unit[("Service", "Environment")])
        assert any(env["HF_HOME"].startswith(path + "/") for path in writable)
        assert env["HOME"] in writable

    def test_stop_timeout_covers_drain_and_grace(
        self, unit: dict[tuple[str, str], list[str]]
    ) -> None:
        settings = Settings()
        budget = settings.drain_timeout + EngineConfig().stop_grace + settings.close_timeout
        assert float(unit[("Service", "TimeoutStopSec")][0]) > budget

    def test_start_timeout_covers_the_engine_startup(
        self, unit: dict[tuple[str, str], list[str]]
    ) -> None:
        assert float(unit[("Service", "TimeoutStartSec")][0]) > EngineConfig().startup_timeout

    def test_config_errors_are_not_restarted(self, unit: dict[tuple[str, str], list[str]]) -> None:
        from engine_launcher.exit_statuses import EXIT_CONFIG, EXIT_LISTEN, EXIT_PREFLIGHT

        expected = f"{EXIT_CONFIG} {EXIT_PREFLIGHT} {EXIT_LISTEN}"
        assert unit[("Service", "RestartPreventExitStatus")] == [expected]

    def test_reload_sends_sighup(self, unit: dict[tuple[str, str], list[str]]) -> None:
        assert unit[("Service", "ExecReload")] == ["/bin/kill -HUP $MAINPID"]

    def test_wants_the_socket_unit_where_installed(
        self, unit: dict[tuple[str, str], list[str]]
    ) -> None:
        # Started alone, the service would bind `listen` itself and the socket unit,
        # started later, could not: it starts the socket first (a no-op if not installed).
        assert "omni-sidecar.socket" in unit[("Unit", "Wants")][0].split()

    @pytest.mark.parametrize(
        "units", [("omni-sidecar.service",), ("omni-sidecar.socket", "omni-sidecar.service")]
    )
    def test_systemd_analyze_verify(self, tmp_path: Path, units: tuple[str, ...]) -> None:
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            pytest.skip("systemd-analyze not found (Debian package: systemd)")
        executable = Path(sys.executable).with_name("omni-sidecar")
        if not executable.exists():
            pytest.skip(f"{executable} not installed (pip install -e .)")
        text = UNIT.read_text()
        assert text.count(f"ExecStart={INSTALLED_EXEC} ") == 1
        # verify checks that ExecStart exists: point it at this venv's script.
        copy = tmp_path / "omni-sidecar.service"
        copy.write_text(text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={executable} "))
        if "omni-sidecar.socket" in units:
            # Beside its service, as installed (verify finds Service= there).
            (tmp_path / "omni-sidecar.socket").write_text(SOCKET_UNIT.read_text())
        result = subprocess.run(
            [analyze, "verify", *(str(tmp_path / name) for name in units)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        about_unit = [
            line for line in (result.stdout + result.stderr).splitlines() if "omni-sidecar" in line
        ]
        assert result.returncode == 0, result.stdout + result.stderr
        # Unknown keys are only warnings ("Unknown key ..., ignoring"): none allowed.
        assert about_unit == []


# -- deploy/systemd/omni-sidecar.socket -----------------------------------------------------


@pytest.fixture(scope="module")
def socket_unit() -> dict[tuple[str, str], list[str]]:
    return unit_settings(SOCKET_UNIT.read_text())


class TestSocketUnit:
    """The client listener's socket, held while the service restarts (docs/operations.md)."""

    def test_listens_where_the_service_would(
        self, socket_unit: dict[tuple[str, str], list[str]]
    ) -> None:
        assert socket_unit[("Socket", "ListenStream")] == [Settings().listen]

    def test_names_the_client_listener(self, socket_unit: dict[tuple[str, str], list[str]]) -> None:
        from proxy.edge.socket_activation import CLIENT_FDNAME

        assert socket_unit[("Socket", "FileDescriptorName")] == [CLIENT_FDNAME]
        assert socket_unit[("Socket", "Service")] == [UNIT.name]

    def test_a_backlog_for_the_restart(self, socket_unit: dict[tuple[str, str], list[str]]) -> None:
        # Connections wait there through a drain and a start: more than the 128 of our own bind.
        from proxy.edge.listener import BACKLOG

        assert int(socket_unit[("Socket", "Backlog")][0]) > BACKLOG
        # Accept=yes would start one sidecar per connection.
        assert socket_unit.get(("Socket", "Accept"), ["no"]) == ["no"]

    def test_started_at_boot(self, socket_unit: dict[tuple[str, str], list[str]]) -> None:
        assert socket_unit[("Install", "WantedBy")] == ["sockets.target"]
