"""The ``omni-sidecar`` command as real processes.

``serve`` runs on free loopback ports (a :class:`tests.children.SidecarChild`);
readiness is ``/readyz`` = 200 under a deadline; the engine child is found
through ``/proc`` (its parent pid), so the tests can check that SIGTERM leaves
nothing behind. Every process a test starts is stopped in its ``finally`` if
it is still there; one-shot commands run as asyncio subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from engine_launcher.exit_statuses import EXIT_CONFIG, EXIT_LISTEN, EXIT_STATUSES
from proxy.cli import version
from proxy.native import CORE_BUILD
from proxy.probe import ProbeOptions, run_probe
from tests.children import SidecarChild
from tests.conftest import DEADLINE, free_port, http_ok
from tests.integration.helpers import children_of, clean_env, cli_argv, cmdline, run_cli

#: A quick built-in simulator: 3 chunks of 200 ms, unpaced.
_FAST_SIMULATOR = "--realtime-factor 0 --chunk-ms 200 --response-seconds 0.6"


class Serve(SidecarChild):
    """``serve --log-level info *args`` on free loopback ports, logging to ``tmp_path``."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None) -> None:
        port = free_port()
        super().__init__(
            "--log-level", "info", *args,
            port=port, base_env=env or clean_env(), log_path=tmp_path / f"serve-{port}.log",
            ready_timeout=DEADLINE * 2, stop_grace=DEADLINE,
        )  # fmt: skip

    async def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return await self.exited(DEADLINE)


@contextlib.asynccontextmanager
async def serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[Serve]:
    """Started, not yet ready (``await srv.ready()``); stopped on exit."""
    srv = Serve(tmp_path, *args, env=env)
    srv.start()
    try:
        yield srv
    finally:
        await srv.astop()


def _simulator_port(pid: int) -> str:
    argv = cmdline(pid)
    assert "engine_launcher.simulator" in argv, argv
    return argv[argv.index("--port") + 1]


def _simulators_on(port: str) -> list[int]:
    """Live simulator processes listening on ``port`` (from their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = cmdline(int(entry.name))
        if "engine_launcher.simulator" not in argv or "--port" not in argv:
            continue
        if argv[argv.index("--port") + 1] == port:
            with contextlib.suppress(OSError):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
    return found


async def test_serve_with_the_builtin_simulator_probe_then_sigterm(tmp_path: Path) -> None:
    async with serve(tmp_path, "--engine-simulator-args", _FAST_SIMULATOR) as srv:
        await srv.ready()
        children = children_of(srv.proc.pid)
        assert len(children) == 1, children
        engine_port = _simulator_port(children[0])

        rc, out, err = await run_cli(
            "probe", srv.ws_url, "--json", "--no-realtime", "--input-seconds", "0.2"
        )
        assert rc == 0, f"probe failed: {err}\n{srv.log_tail()}"
        result = json.loads(out)
        assert result["completed"] is True
        assert result["response_statuses"] == ["completed"]
        assert result["audio_frames"] == 3
        assert result["session_closed_reason"] == "client_close"

        metrics_url = f"http://127.0.0.1:{srv.admin_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(metrics_url) as resp:
            assert resp.status == 200
            text = await resp.text()
        assert 'omni_sidecar_sessions_total{outcome="client_closed"} 1.0' in text

        assert await srv.terminate() == 0, srv.log_tail()
    assert _simulators_on(engine_port) == []
    assert "engine_launcher.simulator" not in cmdline(children[0])


async def test_serve_expects_the_behaviour_of_the_release_preflight_found(tmp_path: Path) -> None:
    """docs/design.md, Engine capabilities: serve's preflight reads the engine's release
    (here the simulator's --engine-version) and the process shows it."""
    args = _FAST_SIMULATOR + " --engine-version 0.32"
    async with serve(tmp_path, "--engine-simulator-args", args) as srv:
        await srv.ready()
        metrics_url = f"http://127.0.0.1:{srv.admin_port}/metrics"
        summary_url = f"http://127.0.0.1:{srv.admin_port}/debug/summary"
        async with aiohttp.ClientSession() as http:
            async with http.get(metrics_url) as resp:
                text = await resp.text()
            async with http.get(summary_url) as resp:
                summary = await resp.json()
        assert await srv.terminate() == 0, srv.log_tail()
    assert 'omni_sidecar_engine_info{source="preflight",version="0.32"} 1.0' in text
    assert summary["engine_capabilities"]["truncate_needs_audio_item"] is True
    assert "engine behaviour: vLLM-Omni 0.32 from preflight" in srv.log()
    # Which build runs, said the same way everywhere (docs/design.md, Performance).
    assert re.search(rf'omni_sidecar_build_info{{core="{CORE_BUILD}",version="[^"]+"}} 1.0', text)
    assert summary["build"] == CORE_BUILD
    assert f"(core: {CORE_BUILD};" in srv.log()
    pure_line = "runs the pure-Python build" in srv.log()
    assert pure_line is (CORE_BUILD == "python"), srv.log_tail()


async def test_print_config_shows_values_and_their_sources(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text('max_pending_output_bytes = 1048576\n[engine]\nkind = "simulator"\n')
    rc, out, err = await run_cli(
        "serve", "--config", str(config), "--print-config", "--max-sessions", "7",
        env=clean_env(OMNI_SIDECAR_DRAIN_TIMEOUT="3", OMNI_SIDECAR_MAX_SESSIONS="5"),
    )  # fmt: skip
    assert rc == 0, err
    lines = out.splitlines()
    assert "max_sessions = 7  # flag --max-sessions" in lines  # the flag beats the env
    assert "drain_timeout = 3.0  # env OMNI_SIDECAR_DRAIN_TIMEOUT" in lines
    assert f"max_pending_output_bytes = 1048576  # file {config}" in lines
    assert f'engine.kind = "simulator"  # file {config}' in lines
    assert 'listen = "127.0.0.1:8000"  # default' in lines


async def test_a_bad_env_value_exits_non_zero_naming_key_and_source(tmp_path: Path) -> None:
    port = free_port()
    rc, _, err = await run_cli(
        "serve", "--listen", f"127.0.0.1:{port}",
        env=clean_env(OMNI_SIDECAR_MAX_SESSIONS="abc"),
    )  # fmt: skip
    assert rc != 0
    assert "max_sessions" in err
    assert "env OMNI_SIDECAR_MAX_SESSIONS" in err
    assert "'abc'" in err
    assert not await http_ok(f"http://127.0.0.1:{port}/healthz")


async def test_serve_with_upstream_attaches_without_a_child(simulator, tmp_path: Path) -> None:
    sim = await simulator(*_FAST_SIMULATOR.split())
    async with serve(tmp_path, "--upstream", sim.ws_url) as srv:
        await srv.ready()
        assert children_of(srv.proc.pid) == []
        result = await run_probe(
            ProbeOptions(url=srv.ws_url, realtime=False, input_seconds=0.2, timeout=DEADLINE)
        )
        assert result.completed
        assert result.audio_frames == 3
        assert await srv.terminate() == 0, srv.log_tail()
    # The external engine is not ours to stop.
    assert sim.proc.poll() is None
    assert await http_ok(sim.http_url + "/health")


# -- exit statuses: one per cause, one line on stderr, no traceback ------------------------


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


async def test_listen_port_in_use_exits_4_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, _, err = await run_cli(
            "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen", "127.0.0.1:0"
        )
    assert rc == EXIT_LISTEN == 4, err
    line = _one_line(err)
    assert f"127.0.0.1:{port} (listen)" in line
    assert "in use" in line


async def test_admin_port_in_use_exits_4_and_leaves_no_engine() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, _, err = await run_cli(
            "serve", "--listen", "127.0.0.1:0", "--admin-listen", f"127.0.0.1:{port}"
        )
    assert rc == 4, err
    assert f"127.0.0.1:{port} (admin_listen)" in _one_line(err)


async def test_a_value_the_core_rejects_exits_2_before_listening(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text("max_tombstones = 0\n")
    port = free_port()
    rc, _, err = await run_cli("serve", "--config", str(config), "--listen", f"127.0.0.1:{port}")
    assert rc == EXIT_CONFIG == 2, err
    line = _one_line(err)
    assert "max_tombstones" in line
    assert f"file {config}" in line
    assert not await http_ok(f"http://127.0.0.1:{port}/healthz")


async def test_an_empty_api_keys_file_exits_2_naming_key_and_source(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# no keys yet\n")
    rc, _, err = await run_cli(
        "serve", "--listen", "127.0.0.1:0", env=clean_env(OMNI_SIDECAR_API_KEYS_FILE=str(keys))
    )
    assert rc == 2, err
    line = _one_line(err)
    assert "api_keys_file" in line
    assert "env OMNI_SIDECAR_API_KEYS_FILE" in line


async def test_serve_help_lists_every_exit_status() -> None:
    rc, out, _ = await run_cli("serve", "--help")
    assert rc == 0
    for code, meaning in EXIT_STATUSES.items():
        assert f"  {code}  {meaning}" in out


# -- --version and --print-config --------------------------------------------------------


async def test_version() -> None:
    rc, out, err = await run_cli("--version")
    assert rc == 0, err
    assert out.strip() == f"omni-sidecar {version()} ({CORE_BUILD} build)"


async def test_python_dash_m_omni_sidecar_is_the_same_command() -> None:
    """The package runs as ``python -m proxy`` as well as ``omni-sidecar``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--version",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    async with asyncio.timeout(DEADLINE):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert out.decode().strip() == f"omni-sidecar {version()} ({CORE_BUILD} build)"


async def test_print_config_round_trips_through_config(tmp_path: Path) -> None:
    env = clean_env(
        OMNI_SIDECAR_MAX_SESSIONS="9",
        OMNI_SIDECAR_API_KEYS="sekrit-1",
        OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS="--chunk-ms 20",
        OMNI_SIDECAR_LOG_FORMAT="json",
    )
    rc, first, err = await run_cli("serve", "--print-config", "--drain-timeout", "4", env=env)
    assert rc == 0, err
    assert "sekrit" not in first
    assert '# upstream = "ws://127.0.0.1:8091"  # (unset) default' in first.splitlines()
    config = tmp_path / "printed.toml"
    config.write_text(first)
    rc, second, err = await run_cli("serve", "--config", str(config), "--print-config")
    assert rc == 0, err

    def values(text: str) -> list[str]:
        return [line.split("  # ", 1)[0] for line in text.splitlines()]

    assert values(second) == values(first)
    assert f"max_sessions = 9  # file {config}" in second.splitlines()


async def test_print_config_piped_to_head_exits_0_quietly() -> None:
    argv = " ".join(shlex.quote(a) for a in cli_argv("serve", "--print-config"))
    proc = await asyncio.create_subprocess_shell(
        f"set -o pipefail; {argv} | head -1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
        executable="/bin/bash",
    )
    async with asyncio.timeout(DEADLINE):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert len(out.decode().splitlines()) == 1
    assert err.decode() == ""


async def test_print_config_into_a_closed_pipe_exits_0_without_a_traceback() -> None:
    # Deterministic form of `| head -1`: the reader is gone before the first write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = await asyncio.create_subprocess_exec(
            *cli_argv("serve", "--print-config"),
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env=clean_env(),
        )
    finally:
        os.close(write_end)
    async with asyncio.timeout(DEADLINE):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert err.decode() == ""


async def test_log_format_json_writes_one_object_per_line(tmp_path: Path) -> None:
    async with serve(tmp_path, "--log-format", "json") as srv:
        await srv.ready()
        assert await srv.terminate() == 0, srv.log_tail()
    lines = [line for line in srv.log().splitlines() if line.strip()]
    assert len(lines) >= 3, lines
    for line in lines:
        entry = json.loads(line)
        assert {"ts", "level", "logger", "message"} <= entry.keys(), entry
    messages = [json.loads(line)["message"] for line in lines]
    assert any(m.startswith("omni-sidecar ready") for m in messages), messages
    child = [json.loads(line) for line in lines if '"engine_launcher.child"' in line]
    assert child, lines  # the simulator's own lines, one JSON object each
    assert all(entry["message"].startswith("engine: ") for entry in child), child
