"""``omni-sidecar preflight`` checks (engine_launcher/preflight/).

Two machines are played: this one as it is (no vllm, vllm_omni or torch
installed: those checks FAIL saying what to install, exit status 3) and an
"installed" one, made by
putting tests/fakes/preflight_modules first on ``sys.path``. There ``torch``
is a stand-in whose ``torch.cuda`` answers from ``FAKE_DEVICES``; ``vllm``
and ``vllm_omni`` raise when imported, so any test that passes also proves
preflight only located them; their versions come from ``*.dist-info``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_launcher import preflight
from engine_launcher.preflight import (
    CheckStatus,
    StageSpec,
    add_preflight_arguments,
    cheap_checks,
    engine_config_from_file,
    interpreter,
    main_preflight,
    read_deploy_spec,
    run_checks,
    scan_deploy_yaml,
)
from proxy.settings import EngineConfig, load
from tests.children import free_port

ROOT = Path(__file__).resolve().parents[3]
FAKES = ROOT / "tests" / "fakes" / "preflight_modules"
DEPLOY = FAKES / "vllm_omni" / "deploy"
STAND_INS = ("torch", "torch.cuda", "vllm", "vllm_omni")
GIB = 1024**3
PASS, FAIL, SKIP, WARN = CheckStatus.PASS, CheckStatus.FAIL, CheckStatus.SKIP, CheckStatus.WARN
NAMES = ["port", "deploy_config", "model", "vllm", "gpus", "gpu_memory"]


def minicpmo(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "kind": "vllm-omni",
        "model": "openbmb/MiniCPM-o-4_5",
        "deploy_config": "minicpmo_4_5.yaml",
        "port": free_port(),
        "extra_args": ("--trust-remote-code",),
    }
    values.update(overrides)
    return EngineConfig(**values)


def by_name(results: list[preflight.CheckResult]) -> dict[str, preflight.CheckResult]:
    assert [r.name for r in results] == NAMES[: len(results)]
    return {r.name: r for r in results}


def hf_cache(tmp_path: Path, repo_id: str) -> dict[str, str]:
    """An HF_HOME whose hub cache holds a snapshot of ``repo_id``."""
    snapshot = (
        tmp_path / "hf" / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abc"
    )
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return {"HF_HOME": str(tmp_path / "hf")}


@pytest.fixture
def not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine without vllm, vllm_omni and torch, even where they are installed."""
    real = interpreter.find_package_spec
    monkeypatch.setattr(
        interpreter, "find_package_spec", lambda name: None if name in STAND_INS else real(name)
    )


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in packages first on sys.path; yields the fake ``torch.cuda``."""
    for name in STAND_INS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(FAKES))
    cuda = importlib.import_module("torch.cuda")  # a fresh copy: FAKE_DEVICES at its default
    yield cuda
    for name in STAND_INS:
        sys.modules.pop(name, None)


# -- this machine: nothing installed -------------------------------------------------------


def test_not_installed_fails_saying_what_to_install(not_installed: None, tmp_path: Path) -> None:
    results = by_name(run_checks(minicpmo(), environ={"HF_HOME": str(tmp_path / "hf")}))
    assert results["port"].status is PASS
    assert results["deploy_config"].status is SKIP
    assert results["deploy_config"].reason == (
        "vllm_omni is not installed here: cannot look up minicpmo_4_5.yaml in its deploy/"
    )
    assert results["model"].status is WARN
    assert "the engine downloads it at start" in results["model"].reason
    assert (results["vllm"].status, results["vllm"].reason) == (
        FAIL,
        (
            f"vllm_omni is not installed in {sys.executable}: pip install vllm-omni, or set "
            "engine.python to the interpreter that has it"
        ),
    )
    assert (results["gpus"].status, results["gpus"].reason) == (
        FAIL,
        (
            f"torch is not installed in {sys.executable}: pip install vllm-omni (it brings the "
            "CUDA build of torch it needs)"
        ),
    )
    assert results["gpu_memory"].status is SKIP


def test_not_installed_main_exits_3(
    not_installed: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    ns = argparse.Namespace(config=None, port_check=True)
    assert main_preflight(ns, minicpmo(), environ={"HF_HOME": str(tmp_path)}, out=out) == 3
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "PASS port",
        "SKIP deploy_config",
        "WARN model",
        "FAIL vllm",
        "FAIL gpus",
        "SKIP gpu_memory",
    ]
    assert capsys.readouterr().err == "omni-sidecar preflight: FAIL (vllm, gpus)\n"


def test_other_kinds_do_not_need_vllm(not_installed: None) -> None:
    out = io.StringIO()
    assert main_preflight(argparse.Namespace(), EngineConfig(), environ={}, out=out) == 0


def test_other_engine_kinds_skip_everything_engine_specific() -> None:
    results = by_name(run_checks(EngineConfig(), environ={}))
    assert results["port"].reason == "no fixed port: a free one is picked at start"
    for name in NAMES[1:]:
        assert results[name].status is SKIP
        assert results[name].reason == "engine kind is 'simulator' (checked only for vllm-omni)"
    external = run_checks(EngineConfig(kind="external", upstream="ws://127.0.0.1:1"), environ={})
    assert external[0].reason == "engine kind 'external' runs no child"


# -- the installed machine --------------------------------------------------------------------


def test_installed_all_pass(installed: Any, tmp_path: Path) -> None:
    env = {**hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5"), "HF_HUB_OFFLINE": "1"}
    results = by_name(run_checks(minicpmo(), environ=env))
    assert {r.status for r in results.values()} == {PASS}, results
    assert results["deploy_config"].reason == str(DEPLOY / "minicpmo_4_5.yaml")
    assert results["model"].reason.startswith("openbmb/MiniCPM-o-4_5 is in the HF cache: ")
    assert results["vllm"].reason == "vllm-omni 0.30.0 with vllm 0.30.2"
    assert results["gpus"].reason == "1 visible: 0: 78.0 GiB free of 80.0 GiB"
    assert results["gpu_memory"].reason == (
        "GPU 0: stages 0,1,2 ask 0.88 = 70.4 GiB, 78.0 GiB free"
    )
    # Located, never imported (the stand-ins raise on import).
    assert "vllm" not in sys.modules and "vllm_omni" not in sys.modules


def test_the_engine_package_version_comes_with_the_checks(installed: Any, tmp_path: Path) -> None:
    """docs/design.md, Engine capabilities: the sidecar expects this version's behaviour."""
    env = hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5")
    results, version = preflight.run_checks_and_version(minicpmo(), environ=env)
    assert version == "0.30.0"
    assert by_name(results)["vllm"].reason == "vllm-omni 0.30.0 with vllm 0.30.2"
    assert preflight.engine_package_version(minicpmo()) == "0.30.0"
    assert preflight.run_checks_and_version(EngineConfig(), environ=env)[1] == "0.30", "simulator"
    simulated = EngineConfig(simulator_args=("--engine-version", "0.32", "--realtime-factor", "0"))
    assert preflight.engine_package_version(simulated) == "0.32"
    simulated = EngineConfig(simulator_args=("--engine-version=0.31",))
    assert preflight.engine_package_version(simulated) == "0.31"
    external = EngineConfig(kind="external", upstream="ws://127.0.0.1:9")
    assert preflight.engine_package_version(external) is None


def test_installed_main_prints_one_line_per_check(
    installed: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    env = hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5")
    code = main_preflight(argparse.Namespace(port_check=True), minicpmo(), environ=env, out=out)
    assert code == 0
    assert [line.split(" ", 1)[0] for line in out.getvalue().splitlines()] == ["PASS"] * 6
    assert capsys.readouterr().err == "omni-sidecar preflight: PASS\n"


def test_installed_but_not_downloaded_is_a_warning(
    installed: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    env = {"HF_HOME": str(tmp_path / "empty")}
    assert main_preflight(argparse.Namespace(), minicpmo(), environ=env, out=out) == 0
    statuses = [line.split(" ", 1)[0] for line in out.getvalue().splitlines()]
    assert statuses == ["PASS", "PASS", "WARN", "PASS", "PASS", "PASS"]
    assert capsys.readouterr().err == "omni-sidecar preflight: PASS with warnings (model)\n"


def test_not_enough_free_memory_fails(installed: Any, tmp_path: Path) -> None:
    installed.FAKE_DEVICES = [(60 * GIB, 80 * GIB)]
    out = io.StringIO()
    env = hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5")
    assert main_preflight(argparse.Namespace(), minicpmo(), environ=env, out=out) == 3
    assert out.getvalue().splitlines()[-1] == (
        "FAIL gpu_memory: GPU 0: stages 0,1,2 ask for 0.88 x 80.0 GiB = 70.4 GiB but 60.0 GiB "
        "is free"
    )


def test_no_cuda_fails_gpus(installed: Any) -> None:
    installed.FAKE_DEVICES = []
    results = by_name(run_checks(minicpmo(env={"CUDA_VISIBLE_DEVICES": "0"}), environ={}))
    assert results["gpus"].status is FAIL
    assert results["gpus"].reason == (
        "torch 2.9.0+fake sees no CUDA device: vllm-omni needs an NVIDIA GPU "
        "(check nvidia-smi, the driver, CUDA_VISIBLE_DEVICES)"
    )
    assert results["gpu_memory"].status is SKIP


def qwen(**overrides: Any) -> EngineConfig:
    return minicpmo(
        model="Qwen/Qwen3-Omni-30B-A3B-Instruct",
        deploy_config="qwen3_omni_duplex.yaml",
        **overrides,
    )


def test_overlay_on_two_gpus(installed: Any) -> None:
    installed.FAKE_DEVICES = [(79 * GIB, 80 * GIB), (79 * GIB, 80 * GIB)]
    results = by_name(run_checks(qwen(env={"CUDA_VISIBLE_DEVICES": "0,1"}), environ={}))
    assert results["deploy_config"].status is PASS
    assert results["deploy_config"].reason.endswith(
        "qwen3_omni_duplex.yaml (base qwen3_omni_moe.yaml)"
    )
    assert results["gpu_memory"].status is PASS
    assert results["gpu_memory"].reason == (
        "GPU 0: stages 0 ask 0.90 = 72.0 GiB, 79.0 GiB free; "
        "GPU 1: stages 1,2 ask 0.70 = 56.0 GiB, 79.0 GiB free"
    )


def test_two_gpu_layout_on_one_gpu_fails(installed: Any) -> None:
    results = by_name(run_checks(qwen(), environ={}))
    assert results["gpu_memory"].status is FAIL
    assert results["gpu_memory"].reason == "stages 1,2 need GPU 1 but 1 GPU(s) are visible"


def test_engine_cuda_visible_devices_are_mapped(installed: Any) -> None:
    """Stage device 0 of an engine with CUDA_VISIBLE_DEVICES=2,3 is physical GPU 2."""
    installed.FAKE_DEVICES = [(79 * GIB, 80 * GIB)] * 2 + [
        (10 * GIB, 80 * GIB),
        (79 * GIB, 80 * GIB),
    ]
    results = by_name(run_checks(qwen(env={"CUDA_VISIBLE_DEVICES": "2,3"}), environ={}))
    assert results["gpu_memory"].status is FAIL
    assert results["gpu_memory"].reason.startswith("GPU 2: stages 0 ask for 0.90")
    # This process sees only "3,2": physical 2 is its device 1.
    installed.FAKE_DEVICES = [(79 * GIB, 80 * GIB), (79 * GIB, 80 * GIB)]
    ours = {"CUDA_VISIBLE_DEVICES": "3,2"}
    results = by_name(run_checks(qwen(env={"CUDA_VISIBLE_DEVICES": "2,3"}), environ=ours))
    assert results["gpu_memory"].reason == (
        "GPU 0: stages 1,2 ask 0.70 = 56.0 GiB, 79.0 GiB free; "
        "GPU 1: stages 0 ask 0.90 = 72.0 GiB, 79.0 GiB free"
    )  # GPU numbers are this process's torch indices, as in the gpus line
    results = by_name(run_checks(qwen(env={"CUDA_VISIBLE_DEVICES": "4,5"}), environ=ours))
    assert results["gpu_memory"].reason == (
        "stage 0: GPU 4 is not visible to this process (CUDA_VISIBLE_DEVICES=3,2)"
    )
    results = by_name(run_checks(qwen(env={"CUDA_VISIBLE_DEVICES": "0"}), environ={}))
    assert results["gpu_memory"].reason == (
        "stage 1: stage device 1 but CUDA_VISIBLE_DEVICES=0 lists 1"
    )


def test_overlay_memory_fractions_add_up(installed: Any) -> None:
    installed.FAKE_DEVICES = [(79 * GIB, 80 * GIB)]
    config = minicpmo(
        model="nvidia/NVIDIA-NemotronLabs-VoiceChat-11B",
        deploy_config="nemotron_labs_voicechat_duplex.yaml",
    )
    results = by_name(run_checks(config, environ={}))
    assert results["gpu_memory"].reason == "GPU 0: stages 0,1,2 ask 0.80 = 64.0 GiB, 79.0 GiB free"


def test_fractions_over_one_fail(installed: Any, tmp_path: Path) -> None:
    yaml = tmp_path / "greedy.yaml"
    yaml.write_text(
        "stages:\n  - stage_id: 0\n    gpu_memory_utilization: 0.7\n"
        "  - stage_id: 1\n    gpu_memory_utilization: 0.4\n"
    )
    results = by_name(run_checks(minicpmo(deploy_config=str(yaml)), environ={}))
    assert results["deploy_config"].status is PASS
    assert results["gpu_memory"].reason == "GPU 0: stages 0,1 ask for 1.10 of its memory"


def test_cheap_checks_import_nothing_heavy(installed: Any, tmp_path: Path) -> None:
    sys.modules.pop("torch", None)
    results = cheap_checks(minicpmo(), environ=hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5"))
    assert [(r.name, r.status) for r in results] == [
        ("port", PASS),
        ("deploy_config", PASS),
        ("model", PASS),
    ]
    assert "torch" not in sys.modules


# -- deploy YAML lookup -------------------------------------------------------------------------


def test_unknown_bare_name_suggests_close_ones(installed: Any) -> None:
    results = by_name(cheap_checks(minicpmo(deploy_config="minicpmo_45.yaml"), environ={}))
    assert results["deploy_config"].status is FAIL
    assert results["deploy_config"].reason == (
        f"minicpmo_45.yaml not found in {DEPLOY}; did you mean minicpmo_4_5.yaml?"
    )


def test_deploy_path(tmp_path: Path) -> None:
    present = tmp_path / "mine.yaml"
    present.write_text("stages:\n  - stage_id: 0\n    gpu_memory_utilization: 0.5\n")
    result = cheap_checks(minicpmo(deploy_config=str(present)), environ={})[1]
    assert (result.status, result.reason) == (PASS, str(present))
    result = cheap_checks(minicpmo(deploy_config=str(tmp_path / "absent.yaml")), environ={})[1]
    assert result.status is FAIL
    assert result.reason == f"{tmp_path / 'absent.yaml'} does not exist or is not a file"


def test_deploy_overlay_with_missing_base(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("base_config: nowhere.yaml\nstages:\n  - stage_id: 0\n")
    result = cheap_checks(minicpmo(deploy_config=str(overlay)), environ={})[1]
    assert result.status is FAIL
    assert result.reason == f"{overlay}: base_config nowhere.yaml not found next to overlay.yaml"


def test_deploy_not_set_skips() -> None:
    result = cheap_checks(minicpmo(deploy_config=None), environ={})[1]
    assert (result.status, result.reason) == (
        SKIP,
        "not set: vLLM-Omni uses the model's default deploy config",
    )


# -- vllm versions ------------------------------------------------------------------------------


def test_version_mismatch_fails(
    installed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older = tmp_path / "vllm-0.29.1.dist-info"
    older.mkdir()
    (older / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.29.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = by_name(run_checks(minicpmo(), environ={}))["vllm"]
    assert (result.status, result.reason) == (
        FAIL,
        "vllm-omni 0.30.0 needs vllm 0.30.x, found 0.29.1",
    )


def test_vllm_omni_without_vllm_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm_omni"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    monkeypatch.delitem(sys.modules, "vllm_omni", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = interpreter.find_package_spec
    monkeypatch.setattr(
        interpreter, "find_package_spec", lambda n: None if n == "vllm" else real(n)
    )
    result = by_name(run_checks(minicpmo(), environ={}))["vllm"]
    assert result.status is FAIL
    assert result.reason.startswith("vllm_omni is installed but vllm is not: pip install ")


def test_an_engine_python_that_cannot_run_fails(not_installed: None) -> None:
    results = by_name(run_checks(minicpmo(python="/opt/vllm/bin/python"), environ={}))
    assert results["vllm"].status is FAIL
    assert results["vllm"].reason.startswith("engine.python /opt/vllm/bin/python cannot be run: ")
    assert results["vllm"].reason.endswith(
        ": set engine.python to the interpreter that has vllm-omni"
    )
    for name in ("deploy_config", "gpus"):
        assert results[name].status is SKIP
        assert "engine.python /opt/vllm/bin/python cannot be run" in results[name].reason


def test_another_engine_python_is_asked_not_ours(not_installed: None, tmp_path: Path) -> None:
    """Ours has nothing installed; the engine's interpreter (a wrapper that puts the
    stand-ins on its path) has everything: its packages and GPUs are what count."""
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKES}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    config = minicpmo(python=str(wrapper))
    env = hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5")
    results = by_name(run_checks(config, environ=env))
    assert {r.status for r in results.values()} == {PASS}, results
    assert results["deploy_config"].reason == str(DEPLOY / "minicpmo_4_5.yaml")
    assert results["vllm"].reason == "vllm-omni 0.30.0 with vllm 0.30.2"
    assert results["gpus"].reason == "1 visible: 0: 78.0 GiB free of 80.0 GiB"
    assert "torch" not in sys.modules  # ours was never imported
    assert preflight.engine_package_version(config) == "0.30.0", "theirs, not ours"
    # The same interpreter as ours is ours: nothing installed, so it fails.
    same = by_name(run_checks(minicpmo(python=sys.executable), environ={}))
    assert same["vllm"].status is FAIL


# -- model ---------------------------------------------------------------------------------------


def test_local_model_directory(tmp_path: Path) -> None:
    model = tmp_path / "MiniCPM-o-4_5"

    def check() -> preflight.CheckResult:
        return cheap_checks(minicpmo(model=str(model)), environ={})[2]

    assert (check().status, check().reason) == (FAIL, f"model directory {model} does not exist")
    model.mkdir()
    assert (check().status, check().reason) == (FAIL, f"model directory {model} has no config.json")
    (model / "config.json").write_text("{}")
    assert (check().status, check().reason) == (PASS, f"local directory {model}")


def test_offline_needs_the_model_in_the_hf_cache(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty")}
    result = cheap_checks(minicpmo(env={"HF_HUB_OFFLINE": "1"}), environ=env)[2]
    assert result.status is FAIL
    assert result.reason.startswith(
        f"HF_HUB_OFFLINE=1 but openbmb/MiniCPM-o-4_5 is not in the HF cache {tmp_path / 'empty'}"
    )
    transformers = cheap_checks(minicpmo(), environ={**env, "TRANSFORMERS_OFFLINE": "1"})[2]
    assert transformers.status is FAIL
    assert transformers.reason.startswith("TRANSFORMERS_OFFLINE=1 but openbmb/MiniCPM-o-4_5 ")
    assert "huggingface-cli download openbmb/MiniCPM-o-4_5" in transformers.reason
    online = cheap_checks(minicpmo(), environ=env)[2]
    assert online.status is WARN
    cached = cheap_checks(
        minicpmo(),
        environ={**hf_cache(tmp_path, "openbmb/MiniCPM-o-4_5"), "HF_HUB_OFFLINE": "true"},
    )[2]
    assert cached.status is PASS


# -- port ----------------------------------------------------------------------------------------


def test_busy_port_fails_and_can_be_skipped() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cheap_checks(minicpmo(port=port), environ={})[0]
        assert result.status is FAIL
        assert result.reason.startswith(f"cannot bind 127.0.0.1:{port}: ")
        skipped = cheap_checks(minicpmo(port=port), port_check=False, environ={})[0]
        assert (skipped.status, skipped.reason) == (SKIP, "not checked (--no-port-check)")
    assert cheap_checks(minicpmo(port=port), environ={})[0].status is PASS


# -- deploy YAML reader --------------------------------------------------------------------------


def test_scan_reads_top_level_stages_only() -> None:
    base, stages = scan_deploy_yaml((DEPLOY / "minicpmo_4_5.yaml").read_text())
    assert base is None
    assert stages == {
        0: {"max_num_seqs": "4", "gpu_memory_utilization": "0.55", "devices": "0"},
        1: {"max_num_seqs": "4", "gpu_memory_utilization": "0.15", "devices": "0"},
        2: {"gpu_memory_utilization": "0.18", "devices": "0"},
    }  # platforms.npu.stages (0.99) is not a top-level stage


def test_scan_block_list_forms() -> None:
    text = (
        "base_config: 'base.yaml'  # a comment\n"
        "stages:\n"
        "- stage_id: 0\n"
        '  devices: "0,1"\n'
        "  nested:\n"
        "    gpu_memory_utilization: 0.99\n"
        "-\n"
        "  stage_id: 1\n"
        "  gpu_memory_utilization: 0.3 # trailing\n"
        "  name: 'a # not a comment'\n"
        "other: 1\n"
        "  - stage_id: 9\n"
    )
    base, stages = scan_deploy_yaml(text)
    assert base == "base.yaml"
    assert stages == {
        0: {"devices": "0,1"},
        1: {"gpu_memory_utilization": "0.3", "name": "a # not a comment"},
    }


def test_scan_rejects_a_stage_without_id() -> None:
    with pytest.raises(ValueError, match="no stage_id"):
        scan_deploy_yaml("stages:\n  - gpu_memory_utilization: 0.5\n")


def test_read_deploy_spec_merges_overlays() -> None:
    spec = read_deploy_spec(DEPLOY / "qwen3_omni_duplex.yaml")
    assert [p.name for p in spec.files] == ["qwen3_omni_duplex.yaml", "qwen3_omni_moe.yaml"]
    assert spec.stages == (
        StageSpec(0, 0.9, ("0",)),
        StageSpec(1, 0.6, ("1",)),
        StageSpec(2, 0.1, ("1",)),
    )


def test_read_deploy_spec_refuses_loops(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base_config: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base_config: a.yaml\n")
    with pytest.raises(ValueError, match="circular"):
        read_deploy_spec(tmp_path / "a.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_scan_agrees_with_pyyaml(name: str) -> None:
    yaml = pytest.importorskip("yaml")
    text = (DEPLOY / name).read_text()
    data = yaml.safe_load(text)
    expected = {
        int(s["stage_id"]): {
            k: str(v) for k, v in s.items() if not isinstance(v, (dict, list)) and k != "stage_id"
        }
        for s in data.get("stages", [])
    }
    assert scan_deploy_yaml(text) == (data.get("base_config"), expected)


# -- CLI glue ------------------------------------------------------------------------------------


def test_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_preflight_arguments(parser)
    assert vars(parser.parse_args([])) == {"config": None, "port_check": True}
    ns = parser.parse_args(["--config", "x.toml", "--no-port-check"])
    assert (ns.config, ns.port_check) == ("x.toml", False)


@pytest.mark.parametrize(
    "name",
    [
        "minicpmo_4_5.toml",
        "qwen3_omni_duplex.toml",
        "nemotron_voicechat.toml",
        "omni-sidecar.example.toml",
    ],
)
def test_engine_table_reads_like_the_proxy_loader(name: str) -> None:
    path = str(ROOT / "configs" / name)
    assert engine_config_from_file(path) == load(None, {}, path).settings.engine


def test_main_reads_the_config_file(not_installed: None, tmp_path: Path) -> None:
    ns = argparse.ArgumentParser()
    add_preflight_arguments(ns)
    args = ns.parse_args(
        ["--config", str(ROOT / "configs" / "minicpmo_4_5.toml"), "--no-port-check"]
    )
    out = io.StringIO()
    assert main_preflight(args, environ={"HF_HOME": str(tmp_path)}, out=out) == 3
    assert out.getvalue().splitlines()[0] == "SKIP port: not checked (--no-port-check)"


def test_main_config_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nkind = 'vllm-omni'\n")  # no model
    assert main_preflight(argparse.Namespace(config=str(bad))) == 2
    assert "model: required when engine kind is 'vllm-omni'" in capsys.readouterr().err
    bad.write_text("[engine]\nmodle = 'x'\n")
    assert main_preflight(argparse.Namespace(config=str(bad))) == 2
    assert "modle" in capsys.readouterr().err
