"""``omni-sidecar preflight`` and ``serve``'s preflight, as real child processes.

On a host without vLLM-Omni (no ``vllm_omni``, ``vllm`` or ``torch``, no GPU)
the MiniCPM-o config must FAIL with exit status 3 and one line per failure
saying what to install or set, and ``serve`` must exit 3 before it spawns the
engine. With the stand-in packages of ``tests/fakes/preflight_modules`` on
``PYTHONPATH`` (an "installed" host) the same command passes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import clean_env, run_cli

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "minicpmo_4_5.toml")
FAKES = ROOT / "tests" / "fakes" / "preflight_modules"
MODEL = "openbmb/MiniCPM-o-4_5"

needs_bare_host = pytest.mark.skipif(
    any(importlib.util.find_spec(n) is not None for n in ("vllm_omni", "vllm", "torch")),
    reason="this host has vLLM-Omni or torch installed",
)


def lines_by_check(stdout: str) -> dict[str, str]:
    """``{"vllm": "FAIL vllm: ..."}`` from preflight's one line per check."""
    found = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        found[rest.split(":", 1)[0]] = line
        assert status in ("PASS", "WARN", "FAIL", "SKIP"), line
    return found


def hf_cache(tmp_path: Path) -> Path:
    snapshot = tmp_path / "hf" / "hub" / f"models--{MODEL.replace('/', '--')}" / "snapshots" / "a1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return tmp_path / "hf"


@needs_bare_host
async def test_preflight_on_this_host_fails_with_exit_3(tmp_path: Path) -> None:
    env = clean_env(HF_HOME=str(tmp_path / "empty"))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    code, out, err = await run_cli("preflight", "--config", CONFIG, "--no-port-check", env=env)
    print(out + err)
    assert code == 3
    checks = lines_by_check(out)
    assert list(checks) == ["port", "deploy_config", "model", "vllm", "gpus", "gpu_memory"]
    assert checks["vllm"] == (
        f"FAIL vllm: vllm_omni is not installed in {sys.executable}: pip install vllm-omni, "
        "or set engine.python to the interpreter that has it"
    )
    assert checks["gpus"].startswith(f"FAIL gpus: torch is not installed in {sys.executable}: ")
    assert checks["model"].startswith(f"WARN model: {MODEL} is not in the HF cache ")
    assert err.strip().splitlines()[-1] == "omni-sidecar preflight: FAIL (vllm, gpus)"
    assert "Traceback" not in err


@needs_bare_host
async def test_preflight_offline_without_the_model_fails_it_too(tmp_path: Path) -> None:
    env = clean_env(HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1")
    code, out, _ = await run_cli("preflight", "--config", CONFIG, "--no-port-check", env=env)
    assert code == 3
    model = lines_by_check(out)["model"]
    assert model.startswith(f"FAIL model: HF_HUB_OFFLINE=1 but {MODEL} is not in the HF cache ")
    assert f"huggingface-cli download {MODEL}" in model


async def test_preflight_passes_where_the_engine_is_installed(tmp_path: Path) -> None:
    """The stand-ins on PYTHONPATH: vllm-omni 0.30.0, vllm 0.30.2, one 80 GiB GPU."""
    env = clean_env(PYTHONPATH=str(FAKES), HF_HOME=str(hf_cache(tmp_path)), HF_HUB_OFFLINE="1")
    code, out, err = await run_cli("preflight", "--config", CONFIG, "--no-port-check", env=env)
    print(out + err)
    assert code == 0, out + err
    checks = lines_by_check(out)
    assert checks["port"] == "SKIP port: not checked (--no-port-check)"
    assert [checks[n].split(" ", 1)[0] for n in list(checks)[1:]] == ["PASS"] * 5
    assert err.strip().splitlines()[-1] == "omni-sidecar preflight: PASS"


@needs_bare_host
async def test_serve_runs_the_same_checks_and_exits_3_before_spawning(tmp_path: Path) -> None:
    env = clean_env(HF_HOME=str(tmp_path / "empty"))
    code, _out, err = await run_cli(
        "serve",
        "--config",
        CONFIG,
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        env=env,
    )
    print(err)
    assert code == 3
    assert "preflight: FAIL vllm: vllm_omni is not installed in " in err
    assert "preflight: FAIL gpus: torch is not installed in " in err
    assert "starting engine" not in err  # nothing was spawned
    assert "Traceback" not in err
