"""Golden command lines: ``build_argv`` for every shipped config (configs/*.toml).

Each model config is loaded the way ``omni-sidecar serve --config`` loads it
(``proxy.settings.load``) and must produce exactly the documented vLLM-Omni
command (docs/design.md, Engine launcher, docs/engine-protocol.md, Launching): ``PYTHON -m
vllm_omni.entrypoints.cli.main serve MODEL --omni --host 127.0.0.1 --port PORT
--deploy-config YAML [extra_args]``. ``--omni`` matters: without it the CLI
silently falls back to plain vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_launcher.launcher_errors import EngineStartError
from engine_launcher.process import build_argv
from proxy.settings import EngineConfig, load

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PY = sys.executable
ENTRY = ["-m", "vllm_omni.entrypoints.cli.main", "serve"]

GOLDEN: dict[str, tuple[list[str], dict[str, str], int]] = {
    "minicpmo_4_5.toml": (
        [
            PY,
            *ENTRY,
            "openbmb/MiniCPM-o-4_5",
            "--omni",
            "--host",
            "127.0.0.1",
            "--port",
            "8091",
            "--deploy-config",
            "minicpmo_4_5.yaml",
            "--trust-remote-code",
        ],
        {"CUDA_VISIBLE_DEVICES": "0"},
        4,
    ),
    "qwen3_omni_duplex.toml": (
        [
            PY,
            *ENTRY,
            "Qwen/Qwen3-Omni-30B-A3B-Instruct",
            "--omni",
            "--host",
            "127.0.0.1",
            "--port",
            "8091",
            "--deploy-config",
            "qwen3_omni_duplex.yaml",
            "--trust-remote-code",
        ],
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        1,
    ),
    "nemotron_voicechat.toml": (
        [
            PY,
            *ENTRY,
            "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B",
            "--omni",
            "--host",
            "127.0.0.1",
            "--port",
            "8091",
            "--deploy-config",
            "nemotron_labs_voicechat_duplex.yaml",
            "--trust-remote-code",
        ],
        {"CUDA_VISIBLE_DEVICES": "0"},
        1,
    ),
}


def test_every_model_config_has_a_golden_argv() -> None:
    shipped = {p.name for p in CONFIGS.glob("*.toml")} - {"omni-sidecar.example.toml"}
    assert shipped == set(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_argv(name: str) -> None:
    argv, env, max_sessions = GOLDEN[name]
    settings = load(None, {}, str(CONFIGS / name)).settings
    engine = settings.engine
    assert engine.kind == "vllm-omni"
    assert build_argv(engine, engine.effective_port() or 0) == argv
    assert engine.env_dict() == env
    # The sidecar refuses what the engine's duplex_session.max_sessions would.
    assert settings.max_sessions == max_sessions
    assert engine.startup_timeout >= 1200.0


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_stop_fits_the_systemd_unit(name: str) -> None:
    """deploy/systemd/omni-sidecar.service stops the unit after TimeoutStopSec=90."""
    settings = load(None, {}, str(CONFIGS / name)).settings
    assert settings.drain_timeout + settings.engine.stop_grace + settings.close_timeout < 90


def test_example_config_runs_the_simulator() -> None:
    engine = load(None, {}, str(CONFIGS / "omni-sidecar.example.toml")).settings.engine
    assert engine.kind == "simulator"
    assert build_argv(engine, 40123) == [
        PY,
        "-m",
        "engine_launcher.simulator",
        "--host",
        "127.0.0.1",
        "--port",
        "40123",
    ]


def test_vllm_omni_minimal_and_interpreter() -> None:
    config = EngineConfig(kind="vllm-omni", model="/models/minicpmo", python="/opt/vllm/bin/python")
    assert build_argv(config, config.effective_port() or 0) == [
        "/opt/vllm/bin/python",
        *ENTRY,
        "/models/minicpmo",
        "--omni",
        "--host",
        "127.0.0.1",
        "--port",
        "8091",
    ]


def test_vllm_omni_extra_args_come_last() -> None:
    config = EngineConfig(
        kind="vllm-omni",
        model="m",
        host="::1",
        port=9000,
        deploy_config="/etc/d.yaml",
        extra_args=("--served-model-name", "openbmb/MiniCPM-o-4_5", "--log-stats"),
    )
    assert build_argv(config, 9000)[4:] == [
        "m",
        "--omni",
        "--host",
        "::1",
        "--port",
        "9000",
        "--deploy-config",
        "/etc/d.yaml",
        "--served-model-name",
        "openbmb/MiniCPM-o-4_5",
        "--log-stats",
    ]


def test_simulator_args_are_appended() -> None:
    config = EngineConfig(simulator_args=("--chunk-ms", "80", "--crash-after", "2"))
    assert build_argv(config, 5555) == [
        PY,
        "-m",
        "engine_launcher.simulator",
        "--host",
        "127.0.0.1",
        "--port",
        "5555",
        "--chunk-ms",
        "80",
        "--crash-after",
        "2",
    ]


def test_command_substitutes_host_and_port() -> None:
    config = EngineConfig(
        kind="command",
        host="127.0.0.2",
        command=("/usr/bin/engine", "--bind={host}:{port}", "--port", "{port}", "literal"),
    )
    assert build_argv(config, 7001) == [
        "/usr/bin/engine",
        "--bind=127.0.0.2:7001",
        "--port",
        "7001",
        "literal",
    ]


def test_external_has_no_process() -> None:
    config = EngineConfig(kind="external", upstream="ws://127.0.0.1:8091")
    with pytest.raises(EngineStartError, match="no process"):
        build_argv(config, 8091)
