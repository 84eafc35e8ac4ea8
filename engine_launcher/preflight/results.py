"""What a preflight check says, and the helpers every check family builds it with.

A check returns one :class:`CheckResult`: PASS, WARN (works but costs time),
FAIL (the engine cannot start here; the line says what to install or set) or
SKIP (does not apply). :func:`not_vllm_omni` is the shared SKIP for engine
kinds the check is not about; :func:`engine_env` the environment the engine
child will see.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from engine_launcher.engine_config import EngineConfig

__all__ = [
    "CUDA_VISIBLE_DEVICES",
    "GIB",
    "CheckResult",
    "CheckStatus",
    "engine_env",
    "fail_result",
    "not_vllm_omni",
    "pass_result",
    "skip_result",
    "warn_result",
]

GIB: Final = 1024**3
CUDA_VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"


class CheckStatus(enum.Enum):
    PASS = "PASS"
    WARN = "WARN"  # works, but costs something (a download at start)
    FAIL = "FAIL"  # the engine cannot start: the line says what to install or set
    SKIP = "SKIP"  # does not apply here


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome.

    Args:
        name: ``port``, ``deploy_config``, ``model``, ``vllm``, ``gpus`` or ``gpu_memory``.
        status: PASS, WARN, FAIL or SKIP.
        reason: One line saying what was found (or why it was not checked).
    """

    name: str
    status: CheckStatus
    reason: str

    def line(self) -> str:
        """``PASS port: 127.0.0.1:8091 is free``."""
        return f"{self.status.value} {self.name}: {self.reason}"


def pass_result(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.PASS, reason)


def fail_result(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.FAIL, reason)


def skip_result(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.SKIP, reason)


def warn_result(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.WARN, reason)


def engine_env(config: EngineConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What the engine child sees: our environment updated with ``config.env``."""
    return {**environ, **config.env_dict()}


def not_vllm_omni(name: str, config: EngineConfig) -> CheckResult | None:
    if config.kind != "vllm-omni":
        return skip_result(name, f"engine kind is {config.kind!r} (checked only for vllm-omni)")
    return None
