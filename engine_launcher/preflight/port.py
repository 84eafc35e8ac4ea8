"""The ``port`` check: the engine's fixed port is free on its host.

Binds the port the way the engine's server does (``SO_REUSEADDR``, so a port in
TIME_WAIT counts as free) and lets go at once; imports nothing.
"""

from __future__ import annotations

import socket

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.results import (
    CheckResult,
    fail_result,
    pass_result,
    skip_result,
)

__all__ = ["check_port"]


def check_port(config: EngineConfig, port_check: bool) -> CheckResult:
    name = "port"
    if config.kind == "external":
        return skip_result(name, "engine kind 'external' runs no child")
    if not port_check:
        return skip_result(name, "not checked (--no-port-check)")
    port = config.effective_port()
    if port is None:
        return skip_result(name, "no fixed port: a free one is picked at start")
    host = config.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # Like the engine's server: a port in TIME_WAIT is still usable.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return fail_result(name, f"cannot bind {shown}: {exc.strerror or exc}")
    return pass_result(name, f"{shown} is free")
