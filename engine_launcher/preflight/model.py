"""The ``model`` check: a local model directory exists, or the HF cache holds the model.

A model missing from the cache FAILs on an offline host (``HF_HUB_OFFLINE`` /
``TRANSFORMERS_OFFLINE``) and WARNs otherwise: the engine downloads it at start.
The cache is found by huggingface_hub's own precedence; nothing is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.results import (
    CheckResult,
    engine_env,
    fail_result,
    not_vllm_omni,
    pass_result,
    warn_result,
)

__all__ = ["check_model"]


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
#: Environment variables that stop the engine from downloading a model.
_OFFLINE_VARS: Final = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _hf_hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloads, by its own precedence."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else None
    return (cache or Path("~/.cache").expanduser()) / "huggingface" / "hub"


def _cached_snapshot(cache: Path, repo_id: str) -> Path | None:
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    for snapshot in sorted(snapshots.iterdir()):
        if (snapshot / "config.json").exists():
            return snapshot
    return None


def _looks_local(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.exists(model)


def check_model(config: EngineConfig, environ: Mapping[str, str]) -> CheckResult:
    name = "model"
    skipped = not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    model = config.model
    assert model is not None  # EngineConfig requires it for vllm-omni
    if _looks_local(model):
        path = Path(model).expanduser()
        if not path.exists():
            return fail_result(name, f"model directory {path} does not exist")
        if not path.is_dir():
            return fail_result(name, f"model path {path} is not a directory")
        if not (path / "config.json").is_file():
            return fail_result(name, f"model directory {path} has no config.json")
        return pass_result(name, f"local directory {path}")
    env = engine_env(config, environ)
    offline = next((v for v in _OFFLINE_VARS if env.get(v, "").strip().lower() in _TRUE), None)
    cache = _hf_hub_cache(env)
    snapshot = _cached_snapshot(cache, model)
    if snapshot is not None:
        return pass_result(name, f"{model} is in the HF cache: {snapshot}")
    if offline is not None:
        return fail_result(
            name,
            f"{offline}=1 but {model} is not in the HF cache {cache}: download it first "
            f"(huggingface-cli download {model}) or set engine.model to a local directory",
        )
    return warn_result(
        name,
        f"{model} is not in the HF cache {cache}: the engine downloads it at start "
        "(set HF_HUB_OFFLINE=1 to forbid that)",
    )
