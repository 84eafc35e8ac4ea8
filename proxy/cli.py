"""The ``omni-sidecar`` command: ``serve``, ``probe``, ``preflight`` and ``drain``.

Every way ``serve`` can fail has its own exit status and one line on stderr,
never a traceback, so systemd (``RestartPreventExitStatus=2 3 4``) and
operators can tell the causes apart; :data:`EXIT_STATUSES` lists them and
``serve --help`` prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from engine_launcher.exit_statuses import (
    EXIT_CONFIG,
    EXIT_LISTEN,
    EXIT_PREFLIGHT,
    EXIT_STATUSES,
)
from engine_launcher.preflight import (
    CheckStatus,
    add_preflight_arguments,
    main_preflight,
    run_checks_and_version,
)
from proxy import probe
from proxy.errors import ConfigError
from proxy.logs import configure as configure_logging
from proxy.native import CORE_BUILD
from proxy.settings import (
    CONFIG_PATH_ENV,
    LoadedSettings,
    add_cli_arguments,
    flag_values,
    format_settings,
    load,
)

__all__ = [
    "main",
    "version",
]


def version() -> str:
    """The installed package's version (``0+unknown`` in a bare source checkout)."""
    try:
        return metadata.version("omni-sidecar")
    except metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0+unknown"


def _serve_epilog() -> str:
    lines = ["exit statuses (one line on stderr, no traceback):"]
    lines += [f"  {code}  {meaning}" for code, meaning in EXIT_STATUSES.items()]
    lines += [
        "",
        "signals: SIGTERM/SIGINT drain and stop (a second one skips the drain); SIGHUP",
        "reloads the config file and environment (flags still win) and applies the",
        "settings marked live; see docs/design.md, Reload.",
    ]
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-sidecar",
        description="Backpressure- and cancellation-aware proxy for vLLM-Omni realtime engines.",
    )
    parser.add_argument(
        "--version", action="version", version=f"omni-sidecar {version()} ({CORE_BUILD} build)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the proxy (in front of the built-in simulator unless configured otherwise)",
        description="Run the proxy. Every setting is also read from the config file and "
        "from OMNI_SIDECAR_<KEY> environment variables (defaults < file < env < flags).",
        epilog=_serve_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE", help="TOML config file")
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print every setting and its source as TOML that --config accepts, then exit",
    )
    add_cli_arguments(serve)
    probe_parser = commands.add_parser(
        "probe", help="run one realtime session against URL and print what it measured"
    )
    probe.add_probe_arguments(probe_parser)
    preflight_parser = commands.add_parser(
        "preflight",
        help="check the engine setup (packages, GPUs, deploy YAML, model, port) before a long load",
    )
    add_preflight_arguments(preflight_parser)
    add_cli_arguments(preflight_parser)
    drain = commands.add_parser(
        "drain",
        help="drain one engine replica: admit nothing more to it, let its sessions "
        "finish, then restart it",
        description="Ask a running sidecar's admin listener to drain one engine replica "
        "(POST /engines/K/drain). The admin address and token come from the same config "
        "file and environment as serve's unless given here.",
    )
    drain.add_argument("--engine", type=int, required=True, metavar="K", help="replica index")
    drain.add_argument("--config", metavar="FILE", help="TOML config file")
    drain.add_argument("--admin", metavar="URL", help="admin base URL, e.g. http://127.0.0.1:9100")
    return parser


#: Seconds the drain request may take (it only starts the drain).
DRAIN_REQUEST_TIMEOUT = 10.0


def _drain(ns: argparse.Namespace) -> int:
    """POST /engines/K/drain; 0 when the drain began, 1 otherwise (the answer on stderr)."""
    import urllib.error
    import urllib.request

    from proxy.settings import parse_listen

    try:
        settings = load({}, os.environ, _config_path(ns)).settings
    except ConfigError as exc:
        _config_error(exc)
        return EXIT_CONFIG
    base = ns.admin
    if not base:
        host, port = parse_listen(settings.admin_listen)
        host = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    request = urllib.request.Request(f"{base.rstrip('/')}/engines/{ns.engine}/drain", method="POST")
    if settings.admin_token:
        request.add_header("Authorization", f"Bearer {settings.admin_token}")
    try:
        with urllib.request.urlopen(request, timeout=DRAIN_REQUEST_TIMEOUT) as response:
            print(response.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"omni-sidecar: drain refused ({exc.code}): {exc.read().decode()}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"omni-sidecar: cannot reach the admin listener at {base}: {exc}", file=sys.stderr)
    return 1


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _config_path(ns: argparse.Namespace) -> str | None:
    return getattr(ns, "config", None) or os.environ.get(CONFIG_PATH_ENV) or None


def _load(ns: argparse.Namespace) -> LoadedSettings | None:
    try:
        return load(flag_values(ns), os.environ, _config_path(ns))
    except ConfigError as exc:
        _config_error(exc)
        return None


def _config_error(exc: ConfigError) -> None:
    print(f"omni-sidecar: configuration error: {exc}", file=sys.stderr)


def _print_config(loaded: LoadedSettings) -> int:
    try:
        sys.stdout.write(format_settings(loaded))
        sys.stdout.flush()
    except BrokenPipeError:
        # `serve --print-config | head -1`: the reader left, which is fine.
        # Point stdout at /dev/null so the interpreter's final flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from proxy.edge.socket_activation import ActivationError, take_passed_sockets

    try:
        # First: the LISTEN_* variables go and the sockets turn close-on-exec
        # before any child (preflight's, the engine) could inherit them.
        passed = take_passed_sockets(os.environ)
    except ActivationError as exc:
        print(f"omni-sidecar: systemd socket activation: {exc}", file=sys.stderr)
        return EXIT_LISTEN
    loaded = _load(ns)
    if loaded is None:
        return EXIT_CONFIG
    if ns.print_config:
        return _print_config(loaded)
    from proxy.compat import AiohttpHookMissing, require_hooks
    from proxy.server import serve
    from proxy.startup import validate_runtime

    try:
        # Every aiohttp internal the relay uses must be there, before anything binds.
        require_hooks()
    except AiohttpHookMissing as exc:
        print(f"omni-sidecar: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        validate_runtime(loaded)
    except ConfigError as exc:
        _config_error(exc)
        return EXIT_CONFIG
    configure_logging(loaded.settings.log_level, loaded.settings.log_format)
    engine_version: str | None = None
    if loaded.settings.engine.kind != "external":
        # Say why before a long model load fails, not after: the same checks as preflight.
        results, engine_version = run_checks_and_version(loaded.settings.engine)
        failures = [r for r in results if r.status is CheckStatus.FAIL]
        for result in failures:
            logging.getLogger("omni_sidecar").error("preflight: %s", result.line())
        if failures:
            return EXIT_PREFLIGHT
    _install_uvloop()
    flags, path = flag_values(ns), _config_path(ns)

    def reload() -> LoadedSettings:
        # The same load as at start: the file and env again, the original flags on top.
        return load(flags, os.environ, path)

    try:
        return asyncio.run(
            serve(loaded.settings, reload=reload, engine_version=engine_version, passed=passed)
        )
    except ConfigError as exc:  # found while building the app (e.g. an empty keys file)
        _config_error(exc)
        return EXIT_CONFIG


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "preflight":
        loaded = _load(ns)
        if loaded is None:
            return EXIT_CONFIG
        return main_preflight(ns, loaded.settings.engine)
    if ns.command == "probe":
        _install_uvloop()
        return probe.main_probe(ns)
    if ns.command == "drain":
        return _drain(ns)
    parser.print_help()
    return EXIT_CONFIG


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
