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
GPUs (:class:`_Interpreter`), so its installation is checked, not ours.
Package presence and
versions come from ``importlib.util.find_spec`` and ``importlib.metadata``:
vllm and vllm_omni are never imported (importing vllm_omni imports torch,
vLLM and transformers). Only the GPU check imports torch.

The deploy YAML is read with PyYAML when it is importable, otherwise with a
small reader of the one subset the check needs (top-level ``base_config`` and
the ``stages:`` list's ``stage_id``, ``gpu_memory_utilization``, ``devices``).
Stage ``devices`` are indices into the engine's ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Final, TextIO

from omni_sidecar.settings import EngineConfig, EngineConfigError

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

GIB: Final = 1024**3
EXIT_OK: Final = 0
#: A check failed: the engine cannot start here (``serve`` exits with it too).
EXIT_FAILED: Final = 3
EXIT_CONFIG: Final = 2
CUDA_VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
#: How deep ``base_config`` overlays may chain.
_MAX_BASE_DEPTH: Final = 8
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
#: Environment variables that stop the engine from downloading a model.
_OFFLINE_VARS: Final = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


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


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What one deploy stage asks of the GPUs."""

    stage_id: int
    gpu_memory_utilization: float | None = None
    devices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeploySpec:
    """The parts of a deploy YAML preflight reads (after ``base_config`` merging)."""

    path: Path
    stages: tuple[StageSpec, ...] = ()
    files: tuple[Path, ...] = field(default=())  # the overlay chain, overlay first


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One CUDA device as torch sees it from this process."""

    index: int
    free_bytes: int
    total_bytes: int


def _pass(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.PASS, reason)


def _fail(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.FAIL, reason)


def _skip(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.SKIP, reason)


def _warn(name: str, reason: str) -> CheckResult:
    return CheckResult(name, CheckStatus.WARN, reason)


# -- public entry points ---------------------------------------------------------------------


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
    deploy, _ = _check_deploy_config(config, _Interpreter(config, gpus=False))
    return [_check_port(config, port_check), deploy, _check_model(config, env)]


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
    interpreter = _Interpreter(config, gpus=config.kind == "vllm-omni")
    deploy, deploy_path = _check_deploy_config(config, interpreter)
    gpus_result, gpus = _check_gpus(config, env, interpreter)
    results = [
        _check_port(config, port_check),
        deploy,
        _check_model(config, env),
        _check_vllm(config, interpreter),
        gpus_result,
        _check_gpu_memory(config, env, deploy_path, gpus),
    ]
    return results, _package_version(config, interpreter)


def engine_package_version(config: EngineConfig) -> str | None:
    """The ``vllm-omni`` version in the engine's interpreter (None: not installed, that
    interpreter cannot be run, or a kind whose version cannot be known: external,
    command). For the built-in simulator, the release it stands in for
    (``--engine-version`` in ``engine.simulator_args``, 0.30 by default)."""
    return _package_version(config, _Interpreter(config, gpus=False))


#: The simulator's release when ``simulator_args`` name none (its own default).
_SIMULATOR_DEFAULT_VERSION: Final = "0.30"


def _package_version(config: EngineConfig, interpreter: _Interpreter) -> str | None:
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
            ``omni_sidecar.settings.load`` (file < env < flags); without it the
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
        return EXIT_FAILED
    verdict = f"PASS with warnings ({', '.join(warned)})" if warned else "PASS"
    print(f"omni-sidecar preflight: {verdict}", file=sys.stderr)
    return EXIT_OK


def engine_config_from_file(path: str | None) -> EngineConfig:
    """The ``[engine]`` table of a TOML config file as an :class:`EngineConfig`.

    No env or flag precedence (that is ``omni_sidecar.settings.load``'s job); a
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


# -- individual checks ---------------------------------------------------------------------------


def _environ(environ: Mapping[str, str] | None) -> dict[str, str]:
    return dict(os.environ if environ is None else environ)


def _engine_env(config: EngineConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What the engine child sees: our environment updated with ``config.env``."""
    return {**environ, **config.env_dict()}


def _not_vllm_omni(name: str, config: EngineConfig) -> CheckResult | None:
    if config.kind != "vllm-omni":
        return _skip(name, f"engine kind is {config.kind!r} (checked only for vllm-omni)")
    return None


def _foreign_python(config: EngineConfig) -> str | None:
    """The engine's interpreter when it is not this one (then its packages are not ours)."""
    if config.python is None:
        return None
    theirs = Path(shutil.which(config.python) or config.python).absolute()
    if theirs == Path(sys.executable).absolute():
        return None
    return config.python


def _find_spec(name: str) -> Any:
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


class _Interpreter:
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
        spec = _find_spec(name)
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


def _check_port(config: EngineConfig, port_check: bool) -> CheckResult:
    name = "port"
    if config.kind == "external":
        return _skip(name, "engine kind 'external' runs no child")
    if not port_check:
        return _skip(name, "not checked (--no-port-check)")
    port = config.effective_port()
    if port is None:
        return _skip(name, "no fixed port: a free one is picked at start")
    host = config.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # Like the engine's server: a port in TIME_WAIT is still usable.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return _fail(name, f"cannot bind {shown}: {exc.strerror or exc}")
    return _pass(name, f"{shown} is free")


def _deploy_dir(interpreter: _Interpreter) -> Path | None:
    found = interpreter.locate("vllm_omni")
    if not found:
        return None
    return Path(found[0]) / "deploy"


def _is_bare_name(value: str) -> bool:
    return os.sep not in value and "/" not in value and not value.startswith("~")


def _check_deploy_config(
    config: EngineConfig, interpreter: _Interpreter
) -> tuple[CheckResult, Path | None]:
    """The check, and the YAML's path when it was found."""
    name = "deploy_config"
    skipped = _not_vllm_omni(name, config)
    if skipped is not None:
        return skipped, None
    value = config.deploy_config
    if value is None:
        return _skip(name, "not set: vLLM-Omni uses the model's default deploy config"), None
    if _is_bare_name(value):
        if interpreter.error is not None:
            return _skip(name, f"cannot look up {value}: {interpreter.error}"), None
        folder = _deploy_dir(interpreter)
        if folder is None:
            here = "here" if interpreter.foreign is None else f"in {interpreter.where}"
            return _skip(
                name, f"vllm_omni is not installed {here}: cannot look up {value} in its deploy/"
            ), None
        path = folder / value
        if not path.is_file():
            known = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
            close = difflib.get_close_matches(value, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            return _fail(name, f"{value} not found in {folder}{hint}"), None
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            return _fail(name, f"{path} does not exist or is not a file"), None
    try:
        spec = read_deploy_spec(path)
    except FileNotFoundError as exc:
        return _fail(name, f"{path}: {exc}"), None
    except (OSError, ValueError) as exc:
        return _fail(name, f"{path} cannot be read: {exc}"), None
    chain = " <- ".join(p.name for p in spec.files[1:])
    return _pass(name, f"{path}" + (f" (base {chain})" if chain else "")), path


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


def _check_model(config: EngineConfig, environ: Mapping[str, str]) -> CheckResult:
    name = "model"
    skipped = _not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    model = config.model
    assert model is not None  # EngineConfig requires it for vllm-omni
    if _looks_local(model):
        path = Path(model).expanduser()
        if not path.exists():
            return _fail(name, f"model directory {path} does not exist")
        if not path.is_dir():
            return _fail(name, f"model path {path} is not a directory")
        if not (path / "config.json").is_file():
            return _fail(name, f"model directory {path} has no config.json")
        return _pass(name, f"local directory {path}")
    env = _engine_env(config, environ)
    offline = next((v for v in _OFFLINE_VARS if env.get(v, "").strip().lower() in _TRUE), None)
    cache = _hf_hub_cache(env)
    snapshot = _cached_snapshot(cache, model)
    if snapshot is not None:
        return _pass(name, f"{model} is in the HF cache: {snapshot}")
    if offline is not None:
        return _fail(
            name,
            f"{offline}=1 but {model} is not in the HF cache {cache}: download it first "
            f"(huggingface-cli download {model}) or set engine.model to a local directory",
        )
    return _warn(
        name,
        f"{model} is not in the HF cache {cache}: the engine downloads it at start "
        "(set HF_HUB_OFFLINE=1 to forbid that)",
    )


_MAJOR_MINOR: Final = re.compile(r"^(\d+)\.(\d+)")


def _check_vllm(config: EngineConfig, interpreter: _Interpreter) -> CheckResult:
    name = "vllm"
    skipped = _not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    if interpreter.error is not None:
        return _fail(
            name, f"{interpreter.error}: set engine.python to the interpreter that has vllm-omni"
        )
    if interpreter.locate("vllm_omni") is None:
        return _fail(
            name,
            f"vllm_omni is not installed in {interpreter.where}: pip install vllm-omni, or set "
            "engine.python to the interpreter that has it",
        )
    if interpreter.locate("vllm") is None:
        return _fail(
            name,
            "vllm_omni is installed but vllm is not: pip install the vllm release "
            "vllm-omni was built for (same major.minor)",
        )
    omni, vllm = interpreter.version("vllm-omni"), interpreter.version("vllm")
    if omni is None or vllm is None:
        missing = "vllm-omni" if omni is None else "vllm"
        return _skip(name, f"no package metadata for {missing}: versions not compared")
    a, b = _MAJOR_MINOR.match(omni), _MAJOR_MINOR.match(vllm)
    if a is None or b is None:
        return _skip(name, f"cannot compare versions vllm-omni {omni} and vllm {vllm}")
    if a.groups() != b.groups():
        return _fail(name, f"vllm-omni {omni} needs vllm {a.group(1)}.{a.group(2)}.x, found {vllm}")
    return _pass(name, f"vllm-omni {omni} with vllm {vllm}")


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _check_gpus(
    config: EngineConfig, environ: Mapping[str, str], interpreter: _Interpreter
) -> tuple[CheckResult, list[GpuMemory] | None]:
    name = "gpus"
    skipped = _not_vllm_omni(name, config)
    if skipped is not None:
        return skipped, None
    if interpreter.error is not None:
        return _skip(name, f"GPUs not checked: {interpreter.error} (see vllm)"), None
    if interpreter.locate("torch") is None:
        return _fail(
            name,
            f"torch is not installed in {interpreter.where}: pip install vllm-omni (it brings "
            "the CUDA build of torch it needs)",
        ), None
    facts = interpreter.gpu()
    visible = environ.get(CUDA_VISIBLE_DEVICES)
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    version = facts.version or "?"
    if facts.error is not None:
        return _fail(name, facts.error), None
    if facts.devices is None:
        return _fail(
            name,
            f"torch {version} sees no CUDA device{where}: vllm-omni needs an NVIDIA GPU "
            "(check nvidia-smi, the driver, CUDA_VISIBLE_DEVICES)",
        ), None
    gpus = [GpuMemory(i, free, total) for i, (free, total) in enumerate(facts.devices)]
    if not gpus:
        return _fail(name, f"torch {version} reports CUDA but no device{where}"), None
    listing = "; ".join(
        f"{g.index}: {_gib(g.free_bytes)} free of {_gib(g.total_bytes)}" for g in gpus
    )
    return _pass(name, f"{len(gpus)} visible{where}: {listing}"), gpus


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


def _check_gpu_memory(
    config: EngineConfig,
    environ: Mapping[str, str],
    deploy_path: Path | None,
    gpus: list[GpuMemory] | None,
) -> CheckResult:
    name = "gpu_memory"
    skipped = _not_vllm_omni(name, config)
    if skipped is not None:
        return skipped
    if gpus is None:
        return _skip(name, "no GPU information (see gpus)")
    if deploy_path is None:
        return _skip(name, "deploy YAML not readable (see deploy_config): stages not checked")
    try:
        spec = read_deploy_spec(deploy_path)
    except (OSError, ValueError) as exc:
        return _skip(name, f"cannot read {deploy_path}: {exc}")
    asked = [s for s in spec.stages if s.gpu_memory_utilization is not None]
    if not asked:
        return _skip(name, f"{deploy_path.name} sets no gpu_memory_utilization")
    engine_visible = _engine_env(config, environ).get(CUDA_VISIBLE_DEVICES)
    our_visible = environ.get(CUDA_VISIBLE_DEVICES)
    demand: dict[int, float] = {}
    stages_on: dict[int, list[int]] = {}
    for stage in asked:
        for device in stage.devices or ("0",):
            index = _local_index(device, engine_visible, our_visible)
            if isinstance(index, str):
                return _fail(name, f"stage {stage.stage_id}: {index}")
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
            return _fail(
                name, f"stages {stages} need GPU {index} but {len(gpus)} GPU(s) are visible"
            )
        if fraction > 1.0 + 1e-9:
            return _fail(name, f"GPU {index}: stages {stages} ask for {fraction:.2f} of its memory")
        needed = fraction * gpu.total_bytes
        if gpu.free_bytes < needed:
            return _fail(
                name,
                f"GPU {index}: stages {stages} ask for {fraction:.2f} x {_gib(gpu.total_bytes)} "
                f"= {_gib(needed)} but {_gib(gpu.free_bytes)} is free",
            )
        parts.append(
            f"GPU {index}: stages {stages} ask {fraction:.2f} = {_gib(needed)}, "
            f"{_gib(gpu.free_bytes)} free"
        )
    return _pass(name, "; ".join(parts))


# -- deploy YAML ---------------------------------------------------------------------------------


def read_deploy_spec(path: Path) -> DeploySpec:
    """Read a deploy YAML and the ``base_config`` files it overlays.

    Stages are merged by ``stage_id``: a key the overlay sets wins; keys it
    leaves out come from the base. A relative ``base_config`` is looked up
    next to the file that names it.

    Raises:
        FileNotFoundError: A ``base_config`` does not exist.
        OSError: A file cannot be read.
        ValueError: A value is not what the format needs, or the chain loops.
    """
    files: list[Path] = []
    layers: list[dict[int, dict[str, Any]]] = []
    current: Path | None = path
    while current is not None:
        if current in files or len(files) >= _MAX_BASE_DEPTH:
            raise ValueError(f"base_config chain too deep or circular at {current.name}")
        files.append(current)
        base, stages = _parse_deploy(current.read_text(encoding="utf-8"))
        layers.append(stages)
        if base is None:
            current = None
        else:
            candidate = Path(base).expanduser()
            current = candidate if candidate.is_absolute() else current.parent / candidate
            if not current.is_file():
                raise FileNotFoundError(f"base_config {base} not found next to {files[-1].name}")
    merged: dict[int, dict[str, Any]] = {}
    for layer in reversed(layers):  # base first, overlay last
        for stage_id, keys in layer.items():
            merged.setdefault(stage_id, {}).update(keys)
    return DeploySpec(
        path=path,
        stages=tuple(_stage(stage_id, merged[stage_id]) for stage_id in sorted(merged)),
        files=tuple(files),
    )


def _stage(stage_id: int, keys: Mapping[str, Any]) -> StageSpec:
    fraction = keys.get("gpu_memory_utilization")
    if fraction is not None:
        try:
            fraction = float(fraction)
        except (TypeError, ValueError):
            raise ValueError(
                f"stage {stage_id}: gpu_memory_utilization {fraction!r} is not a number"
            ) from None
    devices = keys.get("devices")
    parts: tuple[str, ...] = ()
    if devices is not None:
        parts = tuple(d.strip() for d in str(devices).split(",") if d.strip())
    return StageSpec(stage_id=stage_id, gpu_memory_utilization=fraction, devices=parts)


def _parse_deploy(text: str) -> tuple[str | None, dict[int, dict[str, Any]]]:
    loader = _yaml_loader()
    if loader is None:
        return scan_deploy_yaml(text)
    data = loader(text)
    if not isinstance(data, dict):
        raise ValueError("a deploy YAML must be a mapping")  # noqa: TRY004 - callers catch ValueError
    base = data.get("base_config")
    stages: dict[int, dict[str, Any]] = {}
    for item in data.get("stages") or []:
        if isinstance(item, dict) and "stage_id" in item:
            stages[_stage_id(item["stage_id"])] = {
                k: item[k] for k in ("gpu_memory_utilization", "devices") if k in item
            }
    return (None if base is None else str(base)), stages


def _yaml_loader() -> Callable[[str], Any] | None:
    if _find_spec("yaml") is None:
        return None
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        return None
    loader: Callable[[str], Any] = yaml.safe_load
    return loader


def _stage_id(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"stage_id {value!r} is not an integer") from None


def _strip_comment(line: str) -> str:
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(text: str) -> str | None:
    value = text.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value or None


def scan_deploy_yaml(text: str) -> tuple[str | None, dict[int, dict[str, Any]]]:
    """The YAML subset preflight needs, without PyYAML.

    Reads the top-level ``base_config`` and, for each item of the top-level
    ``stages:`` block list, the scalar keys at the item's own level
    (``stage_id``, ``gpu_memory_utilization``, ``devices``, ...). Nested blocks,
    other sections (``platforms:`` has its own ``stages:``) and the contents
    of flow collections are skipped.

    Returns:
        ``(base_config or None, {stage_id: {key: text}})``.

    Raises:
        ValueError: A stage item has no integer ``stage_id``.
    """
    base: str | None = None
    items: list[dict[str, Any]] = []
    in_stages = False
    dash_column: int | None = None
    key_column: int | None = None
    for raw in text.splitlines():
        line = _strip_comment(raw.replace("\t", "    "))
        body = line.strip()
        if not body or body.startswith(("---", "...")):
            continue
        column = len(line) - len(line.lstrip(" "))
        is_item = body == "-" or body.startswith("- ")
        if column == 0 and not (in_stages and is_item):
            key, _, value = body.partition(":")
            in_stages = key.strip() == "stages" and not value.strip()
            dash_column = key_column = None
            if key.strip() == "base_config":
                base = _scalar(value)
            continue
        if not in_stages:
            continue
        if is_item:
            if dash_column is None:
                dash_column = column
            if column != dash_column:
                continue  # an entry of a nested list
            rest = body[1:].lstrip(" ")
            items.append({})
            key_column = column + len(body) - len(rest) if rest else None
            if rest:
                _scan_key(rest, items[-1])
            continue
        if not items or dash_column is None or column <= dash_column:
            continue
        if key_column is None:  # "-" alone: the item's keys start on this line
            key_column = column
        if column == key_column:
            _scan_key(body, items[-1])
    stages: dict[int, dict[str, Any]] = {}
    for item in items:
        if "stage_id" not in item:
            raise ValueError("a stage has no stage_id")
        stages[_stage_id(item.pop("stage_id"))] = item
    return base, stages


def _scan_key(body: str, item: dict[str, Any]) -> None:
    key, sep, value = body.partition(":")
    key = key.strip()
    if sep and key and " " not in key and key[0] not in "'\"[{":
        parsed = _scalar(value)
        if parsed is not None:
            item[key] = parsed
