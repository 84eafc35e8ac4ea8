"""The GPU checks: ``gpus`` (torch sees CUDA devices, and their free memory) and ``gpu_memory``.

``gpu_memory`` adds up the deploy YAML's ``gpu_memory_utilization`` per device
(stage ``devices`` are indices into the engine's ``CUDA_VISIBLE_DEVICES``,
mapped to this process's) and FAILs when a device has not that much free.
Only these checks import torch, through the
:class:`~engine_launcher.preflight.interpreter.Interpreter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine_launcher.engine_config import EngineConfig
from engine_launcher.preflight.deploy import read_deploy_spec
from engine_launcher.preflight.interpreter import Interpreter
from engine_launcher.preflight.results import (
    CUDA_VISIBLE_DEVICES,
    GIB,
    CheckResult,
    engine_env,
    fail_result,
    not_vllm_omni,
    pass_result,
    skip_result,
)

__all__ = ["GpuMemory", "check_gpu_memory", "check_gpus"]


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One CUDA device as torch sees it from this process."""

    index: int
    free_bytes: int
    total_bytes: int


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def check_gpus(
    config: EngineConfig, environ: Mapping[str, str], interpreter: Interpreter
) -> tuple[CheckResult, list[GpuMemory] | None]:
    name = "gpus"
    skipped = not_vllm_omni(name, config)
    if skipped is not None:
        return skipped, None
    if interpreter.error is not None:
        return skip_result(name, f"GPUs not checked: {interpreter.error} (see vllm)"), None
    if interpreter.locate("torch") is None:
        return fail_result(
            name,
            f"torch is not installed in {interpreter.where}: pip install vllm-omni (it brings "
            "the CUDA build of torch it needs)",
        ), None
    facts = interpreter.gpu()
    visible = environ.get(CUDA_VISIBLE_DEVICES)
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    version = facts.version or "?"
    if facts.error is not None:
        return fail_result(name, facts.error), None
    if facts.devices is None:
        return fail_result(
            name,
            f"torch {version} sees no CUDA device{where}: vllm-omni needs an NVIDIA GPU "
            "(check nvidia-smi, the driver, CUDA_VISIBLE_DEVICES)",
        ), None
    gpus = [GpuMemory(i, free, total) for i, (free, total) in enumerate(facts.devices)]
    if not gpus:
        return fail_result(name, f"torch {version} reports CUDA but no device{where}"), None
    listing = "; ".join(
        f"{g.index}: {_gib(g.free_bytes)} free of {_gib(g.total_bytes)}" for g in gpus
    )
    return pass_result(name, f"{len(gpus)} visible{where}: {listing}"), gpus


def _local_index(
    engine_device: str, engine_visible: str | None, our_visible: str | None
) -> int | str:
    """Map a stage device (an index into the engine's CUDA_VISIBLE_DEVICES) to the
    index torch uses in this process; a string says why it cannot be mapped."""
    engine_list = [d.strip() for d in engine_visible.split(",")] if engine_visible else None
    try:
        logical = int(engine_device)
    except ValueError:
        return f"stage device {engine_device!r} is not an index"
    if engine_list is None:
        physical = str(logical)
    elif logical < len(engine_list):
        physical = engine_list[logical]
    else:
        return f"stage device {logical} but CUDA_VISIBLE_DEVICES={engine_visible} lists {len(engine_list)}"
    if our_visible:
        ours = [d.strip() for d in our_visible.split(",")]
        if physical in ours:
            return ours.index(physical)
        return f"GPU {physical} is not visible to this process (CUDA_VISIBLE_DEVICES={our_visible})"
    try:
        return int(physical)
    except ValueError:
        return f"cannot map GPU {physical!r} without CUDA_VISIBLE_DEVICES here"


def check_gpu_memory(
    config: EngineConfig,
    environ: Mapping[str, str],
    deploy_path: Path | None,
    gpus: list[GpuMemory] | None,
) -> CheckResult:
    name = "gpu_memory"
    skipped = not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    if gpus is None:
        return skip_result(name, "no GPU information (see gpus)")
    if deploy_path is None:
        return skip_result(name, "deploy YAML not readable (see deploy_config): stages not checked")
    try:
        spec = read_deploy_spec(deploy_path)
    except (OSError, ValueError) as exc:
        return skip_result(name, f"cannot read {deploy_path}: {exc}")
    asked = [s for s in spec.stages if s.gpu_memory_utilization is not None]
    if not asked:
        return skip_result(name, f"{deploy_path.name} sets no gpu_memory_utilization")
    engine_visible = engine_env(config, environ).get(CUDA_VISIBLE_DEVICES)
    our_visible = environ.get(CUDA_VISIBLE_DEVICES)
    demand: dict[int, float] = {}
    stages_on: dict[int, list[int]] = {}
    for stage in asked:
        for device in stage.devices or ("0",):
            index = _local_index(device, engine_visible, our_visible)
            if isinstance(index, str):
                return fail_result(name, f"stage {stage.stage_id}: {index}")
            assert stage.gpu_memory_utilization is not None
            demand[index] = demand.get(index, 0.0) + stage.gpu_memory_utilization
            stages_on.setdefault(index, []).append(stage.stage_id)
    by_index = {g.index: g for g in gpus}
    parts = []
    for index in sorted(demand):
        stages = ",".join(str(s) for s in stages_on[index])
        fraction = demand[index]
        gpu = by_index.get(index)
        if gpu is None:
            return fail_result(
                name, f"stages {stages} need GPU {index} but {len(gpus)} GPU(s) are visible"
            )
        if fraction > 1.0 + 1e-9:
            return fail_result(
                name, f"GPU {index}: stages {stages} ask for {fraction:.2f} of its memory"
            )
        needed = fraction * gpu.total_bytes
        if gpu.free_bytes < needed:
            return fail_result(
                name,
                f"GPU {index}: stages {stages} ask for {fraction:.2f} x {_gib(gpu.total_bytes)} "
                f"= {_gib(needed)} but {_gib(gpu.free_bytes)} is free",
            )
        parts.append(
            f"GPU {index}: stages {stages} ask {fraction:.2f} = {_gib(needed)}, "
            f"{_gib(gpu.free_bytes)} free"
        )
    return pass_result(name, "; ".join(parts))
