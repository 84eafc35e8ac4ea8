"""The child-process harness itself (tests/children.py): readiness, failures, stopping.

Each case starts its own small child (the simulator, nginx, redis-server, or
a Python one-liner) and checks what the harness promises its callers: a
failure names what it waited on and quotes the child's log (and nginx's error
log); stop is the stop signal, then SIGKILL after the grace, the child is
reaped, nothing of its process group is left behind, and no other process is
signalled. Ports come from below the kernel's ephemeral range, one slice per
worker, so no client's connect takes a port between the pick and the bind.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.children import (
    ChildNotReady,
    ChildProcess,
    NginxChild,
    RedisChild,
    SimulatorChild,
    child_pids,
    free_port,
    is_alive,
    port_pool,
)
from tests.conftest import DEADLINE, wait_until

#: A child that ignores SIGTERM, says so, and idles (SIGKILL is the only way out).
_STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring SIGTERM', flush=True); time.sleep(60)"
)


def test_a_child_that_exits_fails_with_its_status_and_log(tmp_path: Path) -> None:
    sim = SimulatorChild("--no-such-flag", log_path=tmp_path / "sim.log", ready_timeout=DEADLINE)
    with pytest.raises(ChildNotReady) as failed, sim:
        pass
    text = str(failed.value)
    assert "simulator exited with 2" in text, text
    assert "/health 200" in text and "--no-such-flag" in text, text
    assert sim.returncode == 2


async def test_a_child_never_ready_fails_at_the_deadline_and_is_stopped(tmp_path: Path) -> None:
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", _STUBBORN], ready_port=free_port(), ready_path=None,
        log_path=tmp_path / "stubborn.log", ready_timeout=2.0, stop_grace=0.3,
    )  # fmt: skip
    with pytest.raises(ChildNotReady) as failed:
        async with child:
            pass
    text = str(failed.value)
    assert "stubborn not ready after 2.0 s" in text and "to accept TCP" in text, text
    assert "ignoring SIGTERM" in text, text
    # It ignored SIGTERM for the grace, then SIGKILL: reaped, not left behind.
    assert child.returncode == -signal.SIGKILL


def test_stop_is_sigterm_first_and_reaps(tmp_path: Path) -> None:
    with SimulatorChild(log_path=tmp_path / "sim.log", ready_timeout=DEADLINE) as sim:
        assert sim.running()
    assert sim.returncode == 0  # the simulator exits 0 on SIGTERM: no SIGKILL was needed


async def test_async_stop_of_a_stubborn_child_kills_after_the_grace(tmp_path: Path) -> None:
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", _STUBBORN], ready_port=0, ready_path=None,
        log_path=tmp_path / "stubborn.log", stop_grace=0.3,
    )  # fmt: skip
    child.start()
    await wait_until(lambda: "ignoring SIGTERM" in child.log(), what="the handler installed")
    assert await child.astop() == -signal.SIGKILL
    assert not child.running()


#: A child that starts a grandchild in its own process group, says its pid, and exits
#: on SIGTERM without stopping it (as a careless server would leave a helper behind).
_PARENT = (
    "import signal, subprocess, sys, time\n"
    "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('helper', helper.pid, flush=True)\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "time.sleep(60)\n"
)


def _helper_pid(child: ChildProcess) -> int:
    for line in child.log().splitlines():
        if line.startswith("helper "):
            return int(line.split()[1])
    raise AssertionError(f"no helper line in {child.log()!r}")


async def test_stop_leaves_nothing_of_its_group_and_touches_nothing_else(tmp_path: Path) -> None:
    parent = ChildProcess(
        "parent", [sys.executable, "-c", _PARENT], ready=lambda: "helper " in parent.log(),
        ready_what="the helper's pid", log_path=tmp_path / "parent.log", stop_grace=DEADLINE,
    )  # fmt: skip
    bystander = ChildProcess(
        "bystander", [sys.executable, "-c", _PARENT], ready=lambda: "helper " in bystander.log(),
        ready_what="the helper's pid", log_path=tmp_path / "bystander.log", stop_grace=DEADLINE,
    )  # fmt: skip
    async with bystander, parent:
        helper = _helper_pid(parent)
        assert is_alive(helper)
        assert await parent.astop() == 0  # it exited on SIGTERM: no SIGKILL was needed
        assert not is_alive(helper), "its helper, in its process group, went with it"
        # Another child (and its helper) was not signalled.
        assert bystander.running() and is_alive(_helper_pid(bystander))
    assert not is_alive(_helper_pid(bystander))


def test_a_readiness_predicate_that_never_holds_fails_with_what_it_waited_for(
    tmp_path: Path,
) -> None:
    child = ChildProcess(
        "quiet", [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"],
        ready=lambda: False, ready_what="a condition that never holds",
        log_path=tmp_path / "quiet.log", ready_timeout=1.0, stop_grace=DEADLINE,
    )  # fmt: skip
    with pytest.raises(ChildNotReady) as failed, child:
        pass
    text = str(failed.value)
    assert "quiet not ready after 1.0 s (waited for a condition that never holds)" in text, text
    assert "up" in text, text
    assert child.returncode == -signal.SIGTERM


needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")


def _nginx_config(prefix: Path, port: int, extra: str = "") -> Path:
    config = prefix / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""
    config.write_text(
        f"{user}daemon off;\nworker_processes 2;\npid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\nevents {{ worker_connections 64; }}\n"
        f"http {{ access_log off; client_body_temp_path {prefix}/body; {extra}\n"
        f"  server {{ listen 127.0.0.1:{port}; location / {{ return 200 'ok'; }} }} }}\n"
    )
    return config


@needs_nginx
async def test_nginx_is_ready_when_it_answers_and_stops_with_its_workers(tmp_path: Path) -> None:
    port = free_port()
    nginx = NginxChild(
        tmp_path, _nginx_config(tmp_path, port), ready_port=port, ready_path="/",
        ready_timeout=DEADLINE, stop_grace=DEADLINE,
    )  # fmt: skip
    async with nginx:
        workers = child_pids(nginx.pid)
        assert len(workers) == 2, workers
    assert nginx.returncode == 0  # SIGQUIT: a graceful exit
    assert not any(is_alive(pid) for pid in workers)


@needs_nginx
def test_nginx_that_refuses_its_config_fails_with_its_error_log(tmp_path: Path) -> None:
    port = free_port()
    config = _nginx_config(tmp_path, port, extra="no_such_directive on;")
    nginx = NginxChild(tmp_path, config, ready_port=port, ready_timeout=DEADLINE)
    with pytest.raises(ChildNotReady) as failed, nginx:
        pass
    text = str(failed.value)
    assert "nginx exited with 1" in text and "to accept TCP" in text, text
    assert f"-- {tmp_path / 'error.log'} ends:" in text, text
    assert 'unknown directive "no_such_directive"' in text, text


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
async def test_redis_is_ready_when_it_answers_ping(tmp_path: Path) -> None:
    async with RedisChild(tmp_path, ready_timeout=DEADLINE, stop_grace=DEADLINE) as redis:
        reader, writer = await asyncio.open_connection("127.0.0.1", redis.port)
        writer.write(b"PING\r\n")
        assert await asyncio.wait_for(reader.readline(), DEADLINE) == b"+PONG\r\n"
        writer.close()
    assert redis.returncode == 0


def test_ports_come_from_below_the_ephemeral_range_one_slice_per_worker() -> None:
    """The ephemeral range is where every connect takes its source port: a port
    picked there can be taken before the child binds it ("Address already in use")."""
    first = port_pool("gw0", "2", "32768\t60999\n")
    second = port_pool("gw1", "2", "32768\t60999\n")
    assert first.start >= 1024 and first.stop <= second.start and second.stop <= 32768
    assert len(first) == len(second) >= 1000
    assert port_pool("gw0", "1", "32768 60999").stop == 32768
    # no room below the range, or no reading: the kernel's pick
    assert len(port_pool("gw0", "1", "1030 60999")) == 0
    assert len(port_pool("gw0", "1", "")) == 0
    assert len(port_pool("gw5", "2", "32768 60999")) == 0


def test_free_port_hands_out_this_workers_ports_that_bind_and_not_twice() -> None:
    pool = port_pool()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    if len(pool):
        assert all(port in pool for port in ports)
    held = []
    for port in ports:  # each was free when handed out, and still is
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        held.append(sock)
    for sock in held:
        sock.close()
