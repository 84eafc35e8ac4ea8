"""The ``omni-sidecar preflight`` subcommand: its flags, its output, its exit status.

One line per check on stdout, the verdict on stderr; exit status 0 (warnings
allowed), 3 on a FAIL (``serve`` exits with it too), 2 when the config file
cannot be read. Without settings from the CLI, the ``[engine]`` table of
``--config`` is read as it stands (:func:`engine_config_from_file`).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Mapping
from typing import Any, TextIO

from engine_launcher.engine_config import EngineConfig, EngineConfigError
from engine_launcher.exit_statuses import EXIT_CONFIG, EXIT_OK, EXIT_PREFLIGHT
from engine_launcher.preflight.results import CheckStatus
from engine_launcher.preflight.runner import run_checks

__all__ = [
    "add_preflight_arguments",
    "engine_config_from_file",
    "main_preflight",
]


def add_preflight_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``omni-sidecar preflight``: ``--config FILE`` and ``--no-port-check``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config file whose [engine] table is checked (default: the built-in simulator)",
    )
    parser.add_argument(
        "--no-port-check",
        dest="port_check",
        action="store_false",
        help="do not check that the engine's port is free (an engine is already running)",
    )


def main_preflight(
    ns: argparse.Namespace,
    config: EngineConfig | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run every check, print one line per check; exit status 3 on any FAIL.

    Args:
        ns: Parsed flags from :func:`add_preflight_arguments`.
        config: The engine settings. The CLI passes ``settings.engine`` from
            ``proxy.settings.load`` (file < env < flags); without it the
            ``[engine]`` table of ``ns.config`` is read as it stands.
        environ: As in :func:`run_checks`.
        out: Where the lines go (default stdout).

    Returns:
        0 when nothing failed (warnings allowed), 3 when a check failed, 2
        when the config file cannot be read.
    """
    stream = sys.stdout if out is None else out
    if config is None:
        try:
            config = engine_config_from_file(getattr(ns, "config", None))
        except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as exc:
            print(f"omni-sidecar preflight: configuration error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    results = run_checks(config, port_check=getattr(ns, "port_check", True), environ=environ)
    for result in results:
        print(result.line(), file=stream)
    failed = [r.name for r in results if r.status is CheckStatus.FAIL]
    warned = [r.name for r in results if r.status is CheckStatus.WARN]
    if failed:
        print(f"omni-sidecar preflight: FAIL ({', '.join(failed)})", file=sys.stderr)
        return EXIT_PREFLIGHT
    verdict = f"PASS with warnings ({', '.join(warned)})" if warned else "PASS"
    print(f"omni-sidecar preflight: {verdict}", file=sys.stderr)
    return EXIT_OK


def engine_config_from_file(path: str | None) -> EngineConfig:
    """The ``[engine]`` table of a TOML config file as an :class:`EngineConfig`.

    No env or flag precedence (that is ``proxy.settings.load``'s job); a
    top-level ``upstream`` turns the default simulator into ``external`` as it
    does there.

    Raises:
        OSError: The file cannot be read.
        tomllib.TOMLDecodeError: It is not TOML.
        EngineConfigError: A value is invalid (``ValueError``).
        TypeError: An unknown key in ``[engine]``.
    """
    if path is None:
        return EngineConfig()
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    table = data.get("engine", {})
    if not isinstance(table, dict):
        raise EngineConfigError("engine", "expected a table ([engine])")
    values: dict[str, Any] = dict(table)
    upstream = data.get("upstream")
    if upstream is not None and values.get("kind", "simulator") == "simulator":
        values.update(kind="external", upstream=upstream)
    try:
        return EngineConfig(**values)
    except TypeError as exc:
        raise TypeError(f"{path}: [engine]: {exc}") from None
