"""Running the checks: which ones, in what order, and the engine's release on the way.

:func:`cheap_checks` runs the three that import nothing heavy (port, deploy
YAML, model); :func:`run_checks` runs all six; :func:`run_checks_and_version`
also reports the engine's vllm-omni version from the same look at its
interpreter (docs/design.md, Engine capabilities).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.gpus import check_gpu_memory, check_gpus
from engine_launcher.preflight.interpreter import Interpreter
from engine_launcher.preflight.model import check_model
from engine_launcher.preflight.packages import check_deploy_config, check_vllm
from engine_launcher.preflight.port import check_port
from engine_launcher.preflight.results import CheckResult
from proxy.core.engine_releases import RELEASES

__all__ = ["cheap_checks", "engine_package_version", "run_checks", "run_checks_and_version"]


def cheap_checks(
    config: EngineConfig, *, port_check: bool = True, environ: Mapping[str, str] | None = None
) -> list[CheckResult]:
    """The checks that import nothing heavy: port, deploy YAML, model directory.

    Args:
        config: The engine settings.
        port_check: Whether to check that the engine's port is free (off when
            checking a host whose engine is already running).
        environ: The sidecar's environment (default ``os.environ``); the
            engine sees it updated with ``config.env``.

    Returns:
        One result per check, in the order above.
    """
    env = _environ(environ)
    deploy, _ = check_deploy_config(config, Interpreter(config, gpus=False))
    return [check_port(config, port_check), deploy, check_model(config, env)]


def run_checks(
    config: EngineConfig, *, port_check: bool = True, environ: Mapping[str, str] | None = None
) -> list[CheckResult]:
    """Every check: :func:`cheap_checks`, then vllm versions, GPUs and GPU memory.

    Only the GPU checks import torch (and only for ``kind = "vllm-omni"``); with
    ``engine.python`` set to another interpreter, that one is asked instead.
    """
    return run_checks_and_version(config, port_check=port_check, environ=environ)[0]


def run_checks_and_version(
    config: EngineConfig, *, port_check: bool = True, environ: Mapping[str, str] | None = None
) -> tuple[list[CheckResult], str | None]:
    """:func:`run_checks`, and the engine's vllm-omni version (one look at its interpreter).

    The version tells the sidecar which engine behaviour to expect
    (docs/design.md, Engine capabilities); see :func:`engine_package_version`.
    """
    env = _environ(environ)
    interpreter = Interpreter(config, gpus=config.kind == "vllm-omni")
    deploy, deploy_path = check_deploy_config(config, interpreter)
    gpus_result, gpus = check_gpus(config, env, interpreter)
    results = [
        check_port(config, port_check),
        deploy,
        check_model(config, env),
        check_vllm(config, interpreter),
        gpus_result,
        check_gpu_memory(config, env, deploy_path, gpus),
    ]
    return results, _package_version(config, interpreter)


def engine_package_version(config: EngineConfig) -> str | None:
    """The ``vllm-omni`` version in the engine's interpreter (None: not installed, that
    interpreter cannot be run, or a kind whose version cannot be known: external,
    command). For the built-in simulator, the release it stands in for
    (``--engine-version`` in ``engine.simulator_args``, by default the oldest release)."""
    return _package_version(config, Interpreter(config, gpus=False))


#: The simulator's release when ``simulator_args`` name none: its default is the oldest
#: release (engine_launcher/simulator/flags.py; tests/proxy/core/test_engine_releases.py).
_SIMULATOR_DEFAULT_VERSION: Final = RELEASES[0].version.value


def _package_version(config: EngineConfig, interpreter: Interpreter) -> str | None:
    if config.kind == "simulator":
        return _simulator_version(config.simulator_args)
    if config.kind != "vllm-omni" or interpreter.error is not None:
        return None
    return interpreter.version("vllm-omni")


def _simulator_version(args: tuple[str, ...]) -> str:
    """``--engine-version X`` / ``--engine-version=X`` of the simulator's flags (last wins)."""
    found = _SIMULATOR_DEFAULT_VERSION
    for index, arg in enumerate(args):
        if arg == "--engine-version" and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith("--engine-version="):
            found = arg.partition("=")[2]
    return found


def _environ(environ: Mapping[str, str] | None) -> dict[str, str]:
    return dict(os.environ if environ is None else environ)
