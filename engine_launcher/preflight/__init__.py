"""Preflight: can this machine start the configured engine? (``omni-sidecar preflight``)

A vLLM-Omni start takes 8-20 minutes before it can fail on a missing deploy
YAML, a busy port or a GPU without room (docs/design.md, Engine launcher), so
these checks run first and say in one line each what they found, and for a
FAIL what to install or set:

============= ============================================================ =======
check         what                                                          imports
============= ============================================================ =======
port          the engine's fixed port is free on its host                   nothing
deploy_config ``deploy_config`` exists (a bare name: in vllm_omni's deploy/) nothing
model         a local model path exists; the HF cache holds the model       nothing
              (FAIL when HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set, WARN
              otherwise: the engine downloads it)
vllm          vllm_omni and vllm installed, with equal major.minor          nothing
gpus          torch installed, CUDA devices visible, free memory of each    torch
gpu_memory    the deploy YAML's ``gpu_memory_utilization`` per device fits  (torch)
              in what is free
============= ============================================================ =======

:func:`cheap_checks` runs the first three; :func:`run_checks` runs all, and
``serve`` runs it before it starts the engine (exit status 3 on a FAIL, before
anything is spawned). For ``kind = "vllm-omni"`` a missing ``vllm_omni``,
``vllm`` or ``torch``, no CUDA device, or an uncached model on an offline
host is FAIL: that engine cannot start here. SKIP is only for checks that do
not apply (another engine kind, no fixed port, no deploy YAML set); WARN is
for what will work but cost time (a model download). When ``engine.python``
names another interpreter, that one is run once to report its packages and
GPUs (:class:`~engine_launcher.preflight.interpreter.Interpreter`), so its
installation is checked, not ours.
Package presence and
versions come from ``importlib.util.find_spec`` and ``importlib.metadata``:
vllm and vllm_omni are never imported (importing vllm_omni imports torch,
vLLM and transformers). Only the GPU check imports torch.

The deploy YAML is read with PyYAML when it is importable, otherwise with a
small reader of the one subset the check needs (top-level ``base_config`` and
the ``stages:`` list's ``stage_id``, ``gpu_memory_utilization``, ``devices``).
Stage ``devices`` are indices into the engine's ``CUDA_VISIBLE_DEVICES``.

Layout, one check family per module: ``results`` (CheckResult and the helpers
every check uses), ``interpreter`` (the engine's interpreter: packages, GPUs),
``deploy`` (reading the deploy YAML), ``port``, ``model``, ``packages``
(``deploy_config``, ``vllm``), ``gpus`` (``gpus``, ``gpu_memory``), ``runner``
(which checks run, in order) and ``cli`` (the subcommand). This package
re-exports their public names.
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
