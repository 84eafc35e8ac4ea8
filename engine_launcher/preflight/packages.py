"""The checks of what is installed in the engine's interpreter: ``deploy_config`` and ``vllm``.

``deploy_config`` finds the deploy YAML (a bare name is looked up in
vllm_omni's ``deploy/`` folder, with close matches suggested) and reads it;
``vllm`` wants vllm_omni and vllm installed with equal major.minor. Both ask
the :class:`~engine_launcher.preflight.interpreter.Interpreter`, which
locates packages without importing them.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Final

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.deploy import read_deploy_spec
from engine_launcher.preflight.interpreter import Interpreter
from engine_launcher.preflight.results import (
    CheckResult,
    fail_result,
    not_vllm_omni,
    pass_result,
    skip_result,
)

__all__ = ["check_deploy_config", "check_vllm"]


def _deploy_dir(interpreter: Interpreter) -> Path | None:
    found = interpreter.locate("vllm_omni")
    if not found:
        return None
    return Path(found[0]) / "deploy"


def _is_bare_name(value: str) -> bool:
    return os.sep not in value and "/" not in value and not value.startswith("~")


def check_deploy_config(
    config: EngineConfig, interpreter: Interpreter
) -> tuple[CheckResult, Path | None]:
    """The check, and the YAML's path when it was found."""
    name = "deploy_config"
    skipped = not_vllm_omni(name, config)
    if skipped is not None:
        return skipped, None
    value = config.deploy_config
    if value is None:
        return skip_result(name, "not set: vLLM-Omni uses the model's default deploy config"), None
    if _is_bare_name(value):
        if interpreter.error is not None:
            return skip_result(name, f"cannot look up {value}: {interpreter.error}"), None
        folder = _deploy_dir(interpreter)
        if folder is None:
            here = "here" if interpreter.foreign is None else f"in {interpreter.where}"
            return skip_result(
                name, f"vllm_omni is not installed {here}: cannot look up {value} in its deploy/"
            ), None
        path = folder / value
        if not path.is_file():
            known = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
            close = difflib.get_close_matches(value, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            return fail_result(name, f"{value} not found in {folder}{hint}"), None
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            return fail_result(name, f"{path} does not exist or is not a file"), None
    try:
        spec = read_deploy_spec(path)
    except FileNotFoundError as exc:
        return fail_result(name, f"{path}: {exc}"), None
    except (OSError, ValueError) as exc:
        return fail_result(name, f"{path} cannot be read: {exc}"), None
    chain = " <- ".join(p.name for p in spec.files[1:])
    return pass_result(name, f"{path}" + (f" (base {chain})" if chain else "")), path


_MAJOR_MINOR: Final = re.compile(r"^(\d+)\.(\d+)")


def check_vllm(config: EngineConfig, interpreter: Interpreter) -> CheckResult:
    name = "vllm"
    skipped = not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    if interpreter.error is not None:
        return fail_result(
            name, f"{interpreter.error}: set engine.python to the interpreter that has vllm-omni"
        )
    if interpreter.locate("vllm_omni") is None:
        return fail_result(
            name,
            f"vllm_omni is not installed in {interpreter.where}: pip install vllm-omni, or set "
            "engine.python to the interpreter that has it",
        )
    if interpreter.locate("vllm") is None:
        return fail_result(
            name,
            "vllm_omni is installed but vllm is not: pip install the vllm release "
            "vllm-omni was built for (same major.minor)",
        )
    omni, vllm = interpreter.version("vllm-omni"), interpreter.version("vllm")
    if omni is None or vllm is None:
        missing = "vllm-omni" if omni is None else "vllm"
        return skip_result(name, f"no package metadata for {missing}: versions not compared")
    a, b = _MAJOR_MINOR.match(omni), _MAJOR_MINOR.match(vllm)
    if a is None or b is None:
        return skip_result(name, f"cannot compare versions vllm-omni {omni} and vllm {vllm}")
    if a.groups() != b.groups():
        return fail_result(
            name, f"vllm-omni {omni} needs vllm {a.group(1)}.{a.group(2)}.x, found {vllm}"
        )
    return pass_result(name, f"vllm-omni {omni} with vllm {vllm}")
