"""Preflight: can this machine start the configured engine? (``omni-sidecar preflight``)

A vLLM-Omni start takes many minutes before it can fail on a missing deploy
YAML, a busy port or a GPU without room, so these checks run first and say in
one line each what they found, and for a FAIL what to install or set.
:func:`cheap_checks` runs the first three, :func:`run_checks` all of them;
``serve`` runs them before it starts the engine. The checks, their verdicts
and what they may import: docs/design.md, Engine launcher. One check family
per module; this package re-exports their public names.
"""

from __future__ import annotations

from engine_launcher.preflight.deploy import (
    DeploySpec,
    StageSpec,
    read_deploy_spec,
    scan_deploy_yaml,
)
from engine_launcher.preflight.gpus import GpuMemory
from engine_launcher.preflight.preflight_cli import (
    add_preflight_arguments,
    engine_config_from_file,
    main_preflight,
)
from engine_launcher.preflight.results import CheckResult, CheckStatus
from engine_launcher.preflight.runner import (
    cheap_checks,
    engine_package_version,
    run_checks,
    run_checks_and_version,
)

__all__ = [
    "CheckResult",
    "CheckStatus",
    "DeploySpec",
    "GpuMemory",
    "StageSpec",
    "add_preflight_arguments",
    "cheap_checks",
    "engine_config_from_file",
    "engine_package_version",
    "main_preflight",
    "read_deploy_spec",
    "run_checks",
    "run_checks_and_version",
    "scan_deploy_yaml",
]
