"""The ``omni-sidecar`` command: ``serve`` and ``probe``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from engine_launcher.preflight import (
    CheckStatus,
    add_preflight_arguments,
    main_preflight,
    run_checks,
)
from proxy import probe
from proxy.config import (
    CONFIG_PATH_ENV,
    LoadedSettings,
    add_cli_arguments,
    flag_values,
    format_settings,
    load,
)
from proxy.errors import ConfigError

__all__ = ["main"]

EXIT_CONFIG: int = 2
#: A cheap preflight check failed before the engine was started.
EXIT_PREFLIGHT: int = 3


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-sidecar",
        description="Backpressure- and cancellation-aware proxy for vLLM-Omni realtime engines.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the proxy (in front of the built-in simulator unless configured otherwise)",
        description="Run the proxy. Every setting is also read from the config file and "
        "from OMNI_SIDECAR_<KEY> environment variables (defaults < file < env < flags).",
    )
    serve.add_argument("--config", metavar="FILE", help="TOML config file")
    serve.add_argument(
        "--print-config", action="store_true", help="print every setting and its source, then exit"
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
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _load(ns: argparse.Namespace) -> LoadedSettings | None:
    path = getattr(ns, "config", None) or os.environ.get(CONFIG_PATH_ENV) or None
    try:
        return load(flag_values(ns), os.environ, path)
    except ConfigError as exc:
        print(f"omni-sidecar: configuration error: {exc}", file=sys.stderr)
        return None


def _serve(ns: argparse.Namespace) -> int:
    loaded = _load(ns)
    if loaded is None:
        return EXIT_CONFIG
    if ns.print_config:
        print(format_settings(loaded))
        return 0
    _configure_logging(loaded.settings.log_level)
    if loaded.settings.engine.kind != "external":
        # Say why before a long model load fails, not after: the same checks as preflight.
        failures = [r for r in run_checks(loaded.settings.engine) if r.status is CheckStatus.FAIL]
        for result in failures:
            logging.getLogger("omni_sidecar").error("preflight: %s", result.line())
        if failures:
            return EXIT_PREFLIGHT
    _install_uvloop()
    from proxy.server import serve

    try:
        return asyncio.run(serve(loaded.settings))
    except ConfigError as exc:  # found while building the app (e.g. an empty keys file)
        print(f"omni-sidecar: configuration error: {exc}", file=sys.stderr)
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
    parser.print_help()
    return EXIT_CONFIG


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
