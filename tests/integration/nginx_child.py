"""Our own nginx on loopback, for tests of the shipped nginx examples.

``main_config`` wraps one site file (a ``deploy/nginx`` example with its ports
and paths replaced) in a minimal ``nginx.conf`` whose pid, logs and temp
directories all live under the test's own prefix; ``nginx`` runs it as a
:class:`tests.children.NginxChild` (foreground, its own process group, ready
under the test deadline, its error log quoted when it fails, stopped with
SIGQUIT and then SIGKILL to that group only).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.children import NginxChild
from tests.conftest import DEADLINE

__all__ = ["main_config", "nginx"]


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


def nginx(prefix: Path, config: Path, *, port: int, ready_path: str | None = None) -> NginxChild:
    """nginx with ``config``, ready when ``port`` accepts TCP or answers 200 on ``ready_path``.

    Use it as an async context manager: entering starts it and waits (failing
    with its error log if it exits or misses the deadline); leaving stops it.
    """
    return NginxChild(
        prefix, config, ready_port=port, ready_path=ready_path,
        log_path=prefix / "nginx.out", ready_timeout=DEADLINE, stop_grace=DEADLINE,
    )  # fmt: skip
