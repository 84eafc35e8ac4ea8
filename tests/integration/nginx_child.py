"""Our own nginx on loopback, for tests of the shipped nginx examples.

``main_config`` wraps one site file (a ``deploy/nginx`` example with its ports
and paths replaced) in a minimal ``nginx.conf`` whose pid, logs and temp
directories all live under the test's own prefix; ``nginx`` runs it in the
foreground in its own process group and stops only that group;
``wait_answering`` waits for it to answer over plain HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEADLINE, http_ok, wait_until

__all__ = ["main_config", "nginx", "wait_answering"]


def main_config(prefix: Path, site: Path) -> Path:
    """Write ``prefix/nginx.conf`` including ``site``; return its path."""
    main = prefix / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""
    main.write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\nevents {{ worker_connections 256; }}\n"
        "http {\n"
        f"  access_log {prefix}/access.log;\n"
        f"  client_body_temp_path {prefix}/body;\n  proxy_temp_path {prefix}/proxy;\n"
        f"  fastcgi_temp_path {prefix}/fastcgi;\n  uwsgi_temp_path {prefix}/uwsgi;\n"
        f"  scgi_temp_path {prefix}/scgi;\n"
        f"  include {site};\n"
        "}\n"
    )
    return main


@contextlib.contextmanager
def nginx(prefix: Path, config: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run nginx with ``config``; on exit SIGQUIT (then SIGKILL) its own group."""
    process = subprocess.Popen(
        ["nginx", "-p", str(prefix), "-c", str(config), "-e", str(prefix / "error.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGQUIT)
            try:
                process.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=DEADLINE)


async def wait_answering(process: subprocess.Popen[bytes], prefix: Path, url: str) -> None:
    """Wait until ``url`` answers 200 through nginx; fail with its error log if it exits first.

    Args:
        process: The nginx child from ``nginx``.
        prefix: Its prefix, where ``error.log`` lives.
        url: A plain-HTTP URL served through nginx.
    """

    async def up() -> bool:
        if process.poll() is not None:
            pytest.fail("nginx exited:\n" + (prefix / "error.log").read_text())
        return await http_ok(url)

    await wait_until(up, what="nginx answering")
