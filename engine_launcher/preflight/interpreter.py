"""The interpreter the engine runs under, as the package and GPU checks see it.

Ours is asked in-process: packages are located with ``importlib.util.find_spec``
and versioned with ``importlib.metadata``, never imported (importing vllm_omni
imports torch, vLLM and transformers); only :meth:`Interpreter.gpu` imports
torch. When ``engine.python`` names another interpreter it is run once with a
small script that reports the same facts as JSON, so its installation is
checked, not ours.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from engine_launcher.engine_config import EngineConfig

__all__ = ["Interpreter", "find_package_spec"]


def _foreign_python(config: EngineConfig) -> str | None:
    """The engine's interpreter when it is not this one (then its packages are not ours)."""
    if config.python is None:
        return None
    theirs = Path(shutil.which(config.python) or config.python).absolute()
    if theirs == Path(sys.executable).absolute():
        return None
    return config.python


def find_package_spec(name: str) -> Any:
    """``find_spec`` of a top-level package: locates it without importing it."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


#: What the engine's interpreter reports when it is not ours (``engine.python``):
#: the same facts the local checks read, printed as one JSON object. Locating
#: never imports vllm or vllm_omni; torch is imported only with ``--gpus``.
_FACTS_SCRIPT: Final = """\
import importlib.metadata, importlib.util, json, sys
def locate(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return list(spec.submodule_search_locations or []) or [spec.origin or name]
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
facts = {
    "executable": sys.executable,
    "locate": {n: locate(n) for n in ("vllm_omni", "vllm", "torch")},
    "version": {n: version(n) for n in ("vllm-omni", "vllm")},
}
if "--gpus" in sys.argv and facts["locate"]["torch"] is not None:
    gpu = {"version": None, "devices": None, "error": None}
    try:
        import torch
        gpu["version"] = getattr(torch, "__version__", "?")
        if torch.cuda.is_available():
            gpu["devices"] = [
                [int(x) for x in torch.cuda.mem_get_info(i)]
                for i in range(int(torch.cuda.device_count()))
            ]
    except Exception as exc:
        stage = "import torch failed" if gpu["version"] is None else "CUDA query failed"
        gpu["error"] = f"{stage}: {type(exc).__name__}: {exc}"
    facts["gpu"] = gpu
print(json.dumps(facts))
"""
#: How long the engine's interpreter may take to answer (importing torch is slow).
_FACTS_TIMEOUT: Final = 120.0


@dataclass(frozen=True, slots=True)
class _GpuFacts:
    """torch's view: ``devices`` None when CUDA is not available; ``error`` when it broke."""

    version: str | None
    devices: list[tuple[int, int]] | None
    error: str | None


class Interpreter:
    """The interpreter the engine runs under, as the package and GPU checks see it.

    Ours (``engine.python`` unset or this interpreter) is asked in-process.
    Another one is run once with :data:`_FACTS_SCRIPT`, so that its packages
    and GPUs are checked rather than skipped; when it cannot be run, ``error``
    says why and the checks FAIL or SKIP on it.
    """

    def __init__(self, config: EngineConfig, *, gpus: bool) -> None:
        self.foreign = _foreign_python(config)
        self.where = sys.executable if self.foreign is None else self.foreign
        self.error: str | None = None
        self._facts: dict[str, Any] = {}
        if self.foreign is not None and config.kind == "vllm-omni":
            self._ask(self.foreign, gpus=gpus)

    def _ask(self, python: str, *, gpus: bool) -> None:
        argv = [python, "-c", _FACTS_SCRIPT] + (["--gpus"] if gpus else [])
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=_FACTS_TIMEOUT, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.error = f"engine.python {python} cannot be run: {exc}"
            return
        try:
            facts = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout else None
        except (ValueError, IndexError):
            facts = None
        if done.returncode != 0 or not isinstance(facts, dict):
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            self.error = f"engine.python {python} exited {done.returncode}: {last}"
            return
        self._facts = facts
        self.where = str(facts.get("executable") or python)

    def locate(self, name: str) -> list[str] | None:
        """Where a top-level package is (its folders), or None when it is not installed."""
        if self.foreign is not None:
            found = self._facts.get("locate", {}).get(name)
            return [str(p) for p in found] if found else None
        spec = find_package_spec(name)
        if spec is None:
            return None
        return [str(p) for p in (spec.submodule_search_locations or [])] or [str(spec.origin)]

    def version(self, dist: str) -> str | None:
        if self.foreign is not None:
            found = self._facts.get("version", {}).get(dist)
            return None if found is None else str(found)
        return _dist_version(dist)

    def gpu(self) -> _GpuFacts:
        if self.foreign is not None:
            raw = self._facts.get("gpu") or {}
            devices = raw.get("devices")
            return _GpuFacts(
                raw.get("version"),
                None if devices is None else [(int(f), int(t)) for f, t in devices],
                raw.get("error"),
            )
        try:
            torch = importlib.import_module("torch")  # the one heavy import, and only here
        except Exception as exc:  # noqa: BLE001 - a broken CUDA install surfaces here
            return _GpuFacts(None, None, f"import torch failed: {type(exc).__name__}: {exc}")
        version = str(getattr(torch, "__version__", "?"))
        try:
            if not torch.cuda.is_available():
                return _GpuFacts(version, None, None)
            devices = []
            for index in range(int(torch.cuda.device_count())):
                free, total = torch.cuda.mem_get_info(index)
                devices.append((int(free), int(total)))
        except Exception as exc:  # noqa: BLE001 - any CUDA error is a FAIL line, not a crash
            return _GpuFacts(version, None, f"CUDA query failed: {type(exc).__name__}: {exc}")
        return _GpuFacts(version, devices, None)
