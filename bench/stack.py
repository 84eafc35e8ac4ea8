"""Start the paths under test on loopback: engine, nginx, omni-sidecar, bare relay.

``Stack`` starts one engine (the bench engine, or the project's simulator) on
the load core and, in front of it, each proxy on the proxy core:

* ``direct``: the client talks to the engine itself;
* ``nginx``: Debian's nginx as a plain WebSocket proxy, one worker, generated
  config (standard Upgrade/Connection map, default 4k ``proxy_buffer_size``),
  run as our own process with ``-p tmpdir -c conf -g 'daemon off;'``;
* ``sidecar``: ``omni-sidecar serve --upstream ws://engine`` as a real process;
* ``bare``: :mod:`bench.bare_relay`, aiohttp + uvloop forwarding frames only;
* ``bare-picows``: the same with a picows engine link (the ceiling for the
  sidecar's own design: aiohttp toward clients, picows toward the engine).

Each proxy is pinned to ``PROXY_CPU`` when it is measured. Only one proxy is
measured at a time, but all of them stay up for the scenario (idle ones cost
nothing).

Every process is a :mod:`tests.children` harness, the one the tests start
their children with (the sidecar, the simulator and nginx are its subclasses;
the bench engine and the bare relays come from :func:`bench.common.start`),
pinned and niced by :func:`bench.common.started`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench.common import (
    LOAD_CPU,
    PROXY_CPU,
    ROOT,
    child_env,
    cpu_prefix,
    free_port,
    log_path_for,
    python,
    start,
    started,
)
from tests.children import ChildProcess, NginxChild, SidecarChild, SimulatorChild

__all__ = ["CONFIGS", "Stack", "ensure_nginx", "start_sidecar", "start_simulator"]

CONFIGS: Final = ("direct", "nginx", "bare", "bare-picows", "sidecar")

_NGINX_CONF: Final = """\
worker_processes 1;
worker_rlimit_nofile 65536;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 30000; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_read_timeout 3600s;
      proxy_send_timeout 3600s;
      proxy_buffer_size {buffer};
    }}
  }}
}}
"""


def ensure_nginx() -> str:
    """Path of nginx; installs Debian's package when missing (we run as root here)."""
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if found:
        return found
    print("nginx not found: apt-get install -y nginx-light", file=sys.stderr, flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=False, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "nginx-light"], check=True, timeout=600)
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    return found


def nginx_version() -> str:
    try:
        out = subprocess.run([ensure_nginx(), "-v"], capture_output=True, timeout=10, check=False)
        return out.stderr.decode().strip().split("/")[-1]
    except Exception:  # noqa: BLE001
        return "?"


@dataclass
class Stack:
    """Engine plus proxies. ``sidecar_args`` are extra ``serve`` flags."""

    engine: str = "bench"  # or "simulator"
    simulator_args: list[str] = field(default_factory=list)
    sidecar_args: list[str] = field(default_factory=list)
    configs: tuple[str, ...] = CONFIGS
    nginx_buffer: str = "4k"
    #: Another checkout whose sidecar runs as config "baseline" (an earlier commit).
    baseline_tree: Path | None = None
    procs: dict[str, ChildProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> Stack:  # noqa: PYI034 - final in practice
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        engine_port = free_port()
        self.ports["direct"] = engine_port
        if self.engine == "bench":
            argv = [python(), "-m", "bench.engine", "--port", str(engine_port)]
            self.procs["engine"] = start("engine", argv, cpu=LOAD_CPU, ready_port=engine_port)
        else:
            self.procs["engine"] = start_simulator(engine_port, *self.simulator_args)
        upstream = f"ws://127.0.0.1:{engine_port}"
        if "nginx" in self.configs:
            port = free_port()
            tmp = Path(tempfile.mkdtemp(prefix="omni-bench-nginx-"))
            (tmp / "body").mkdir()
            (tmp / "proxy").mkdir()
            conf = tmp / "nginx.conf"
            conf.write_text(
                _NGINX_CONF.format(
                    tmp=tmp, port=port, upstream=engine_port, buffer=self.nginx_buffer
                )
            )
            # SIGTERM (fast shutdown), not the graceful SIGQUIT: a client may still be connected.
            self.procs["nginx"] = started(
                NginxChild(
                    tmp, conf, ready_port=port, directives="daemon off; user root;",
                    executable=ensure_nginx(), env=child_env(), log_path=log_path_for("nginx"),
                    cwd=ROOT, prefix=cpu_prefix(PROXY_CPU), stop_signal=signal.SIGTERM,
                    stop_grace=5.0,
                )
            )  # fmt: skip
            self.ports["nginx"] = port
        if "bare" in self.configs:
            port = free_port()
            self.procs["bare"] = start(
                "bare",
                [python(), "-m", "bench.bare_relay", "--port", str(port), "--upstream", upstream],
                cpu=PROXY_CPU,
                ready_port=port,
            )
            self.ports["bare"] = port
        if "bare-picows" in self.configs:
            port = free_port()
            self.procs["bare-picows"] = start(
                "bare-picows",
                [
                    python(),
                    "-m",
                    "bench.bare_relay",
                    "--port",
                    str(port),
                    "--upstream",
                    upstream,
                    "--upstream-client",
                    "picows",
                ],
                cpu=PROXY_CPU,
                ready_port=port,
            )
            self.ports["bare-picows"] = port
        if "sidecar" in self.configs:
            sidecar = start_sidecar("sidecar", upstream, *self.sidecar_args)
            self.procs["sidecar"] = sidecar
            self.ports["sidecar"] = sidecar.port
            self.ports["sidecar_admin"] = sidecar.admin_port
        if "baseline" in self.configs:
            assert self.baseline_tree is not None, "the baseline path needs --baseline-tree"
            baseline = start_sidecar(
                "baseline", upstream, *self.sidecar_args, tree=self.baseline_tree
            )
            self.procs["baseline"] = baseline
            self.ports["baseline"] = baseline.port

    def url(self, config: str, query: str = "") -> str:
        base = f"ws://127.0.0.1:{self.ports[config]}/v1/realtime"
        return base + ("?" + query if query else "")

    def stats_url(self) -> str:
        return f"ws://127.0.0.1:{self.ports['direct']}/stats"

    def proxy_pids(self, config: str) -> list[int]:
        proc = self.procs.get(config)
        return proc.pids() if proc is not None else []

    def engine_pid(self) -> int:
        return self.procs["engine"].pid

    def watch_args(self, config: str) -> list[str]:
        args = ["--watch", f"engine={self.engine_pid()}"]
        pids = self.proxy_pids(config)
        if pids:
            args += ["--watch", "proxy=" + ",".join(str(p) for p in pids)]
        return args

    def stop(self) -> None:
        for name in ("sidecar", "baseline", "bare", "bare-picows", "nginx", "engine"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if not proc.running():
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{proc.log_tail()}")


def start_sidecar(name: str, upstream: str, *args: str, tree: Path | None = None) -> SidecarChild:
    """``omni-sidecar serve`` in front of ``upstream`` on loopback ports, as every scenario runs it.

    Pinned to the proxy core; ready once its listener accepts TCP (the
    benchmarks' condition: ``--upstream`` engines are up before it). ``tree``:
    run another checkout's sidecar instead (:func:`tree_command`).
    """
    env = child_env()
    command = None
    if tree is not None:
        command = tree_command(tree)
        env["PYTHONPATH"] = str(tree.resolve())
    child = SidecarChild(
        "--upstream", upstream, "--max-sessions", "0", "--log-level", "warning", *args,
        base_env=env, log_path=log_path_for(name), cwd=ROOT if tree is None else tree,
        command=command,
        prefix=cpu_prefix(PROXY_CPU), ready_path=None, ready_timeout=30.0, stop_grace=5.0,
        name=name,
    )  # fmt: skip
    return started(child)


def tree_command(tree: Path) -> list[str]:
    """The ``omni-sidecar`` command of the checkout at ``tree``, run by this interpreter.

    Read from that checkout's ``pyproject.toml`` (``[project.scripts]``), so a
    tree from before the package was renamed runs as it did; the caller puts
    ``tree`` first on ``PYTHONPATH``. Both trees need the same dependencies.
    """
    scripts = tomllib.loads((tree / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    module, _, function = scripts["omni-sidecar"].partition(":")
    return [
        python(),
        "-c",
        f"import sys; from {module} import {function}; sys.exit({function}(sys.argv[1:]))",
    ]


def start_simulator(port: int, *args: str) -> SimulatorChild:
    """The project's simulator as the stack's engine, on the load core, ready on ``/health``."""
    child = SimulatorChild(
        *args, port=port, env=child_env(), log_path=log_path_for("engine"), cwd=ROOT,
        prefix=cpu_prefix(LOAD_CPU), python=python(), stop_grace=5.0, name="engine",
    )  # fmt: skip
    return started(child)


def root() -> Path:
    return ROOT
