"""deploy/kubernetes/*.yaml: valid Kubernetes objects that agree with the sidecar they deploy.

Every manifest is checked against the Kubernetes OpenAPI schemas bundled in
``kubernetes-validate`` (strict: an unknown field fails), and the per-GPU
pool manifest (omni-sidecar-pool.yaml) against the sidecar's own config keys
(its ConfigMap loads with the real loader, which refuses unknown keys), routes
(probes and the drain hook hit routes the applications really serve) and
timeouts (the grace period covers preStop + drain + engine stop).
docs/design.md, Engine pool.

The settings a container really runs with are its ConfigMap, then the image's
``ENV`` (deploy/container/Containerfile, the stage the manifest names), then the
container's own ``env``: the environment beats the file, as in ``serve``.
The two-container manifest (omni-sidecar-native-sidecar.yaml: the engine's own
image, the sidecar image as a native sidecar) is checked the same way, and its
engine's preStop hook is run against a real sidecar: it drains live sessions
(close 1001) before it returns, which is when the engine would get SIGTERM.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from proxy.settings import load, parse_listen

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = ROOT / "deploy" / "kubernetes"
POOL = KUBERNETES / "omni-sidecar-pool.yaml"
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
#: The oldest Kubernetes the manifests promise to work on (policy/v1 PDB: 1.21+).
KUBERNETES_VERSION = "1.30.0"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _documents(POOL)}


def image_env(stage: str) -> dict[str, str]:
    """The ``ENV`` of one stage of the Containerfile (continuation lines joined, the
    stage's ``ARG`` defaults substituted)."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    env: dict[str, str] = {}
    args: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        start = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if start:
            current = start.group(1)
        elif current == stage and line.startswith("ARG "):
            args.update(pair.split("=", 1) for pair in shlex.split(line[4:]) if "=" in pair)
        elif current == stage and line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, value = pair.split("=", 1)
                env[key] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), value)
    assert env, f"no ENV in stage {stage}"
    return env


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """Plain ``env`` values (those from Secrets are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def effective_settings(config_toml: str, stage: str, container: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "config.toml"
    path.write_text(config_toml)
    return load(None, {**image_env(stage), **container_env(container)}, str(path)).settings


@pytest.fixture(scope="module")
def settings(docs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    return effective_settings(
        docs["ConfigMap"]["data"]["config.toml"],
        "engine",
        _container(docs),
        tmp_path_factory.mktemp("k8s"),
    )


def _pod(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = docs["Deployment"]["spec"]["template"]["spec"]
    return pod


def _container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = _pod(docs)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


@pytest.mark.parametrize("path", sorted(KUBERNETES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (pyproject test extra) not installed"
    )
    kinds = []
    for document in _documents(path):
        validate.validate(document, KUBERNETES_VERSION, strict=True)
        kinds.append(document["kind"])
    assert "Deployment" in kinds and "Service" in kinds


def test_a_schema_violation_is_caught() -> None:
    """The validator really checks: a misspelt field of a PDB fails strict validation."""
    validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (pyproject test extra) not installed"
    )
    pdb = next(d for d in _documents(POOL) if d["kind"] == "PodDisruptionBudget")
    broken = {**pdb, "spec": {**pdb["spec"], "maxUnavailible": 1}}
    with pytest.raises(validate.ValidationError):
        validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_config_map_is_a_pool_of_one_engine_per_gpu(settings: Any) -> None:
    assert settings.engine.kind == "vllm-omni"
    assert settings.engine.gpus == "auto"
    assert settings.engine.host == "127.0.0.1"  # engines are never exposed


def test_capacity_matches_the_gpus_the_pod_asks_for(
    docs: dict[str, dict[str, Any]], settings: Any
) -> None:
    gpus = int(_container(docs)["resources"]["limits"]["nvidia.com/gpu"])
    assert settings.max_sessions == gpus * settings.max_sessions_per_engine
    # Engine k listens on port + k: all of them below the sidecar's own ports.
    ports = {parse_listen(settings.listen)[1], parse_listen(settings.admin_listen)[1]}
    assert not ports & set(range(settings.engine.port, settings.engine.port + gpus))


def test_ports_match_the_listeners(docs: dict[str, dict[str, Any]], settings: Any) -> None:
    ports = {p["name"]: p["containerPort"] for p in _container(docs)["ports"]}
    assert ports["realtime"] == parse_listen(settings.listen)[1]
    assert ports["metrics"] == parse_listen(settings.admin_listen)[1]
    assert [p["targetPort"] for p in docs["Service"]["spec"]["ports"]] == ["realtime"]


def test_probes_hit_routes_the_sidecar_serves(
    docs: dict[str, dict[str, Any]], settings: Any
) -> None:
    from proxy.edge.client_app import build_client_app
    from proxy.server import Sidecar

    sidecar = Sidecar(dataclasses.replace(settings, api_keys_file=None), environ={})
    served = {
        info.get("path") or info.get("formatter")
        for info in (r.get_info() for r in build_client_app(sidecar.state).router.resources())
    }
    container = _container(docs)
    probes = {
        name: container[name]["httpGet"]
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert probe["path"] in served
        assert probe["port"] == "realtime"


def test_grace_period_covers_pre_stop_drain_and_engine_stop(
    docs: dict[str, dict[str, Any]], settings: Any
) -> None:
    command = _container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    grace = _pod(docs)["terminationGracePeriodSeconds"]
    assert grace > pause + settings.drain_timeout + settings.engine.stop_grace


def test_the_disruption_budget_covers_these_pods_and_keeps_one_serving(
    docs: dict[str, dict[str, Any]],
) -> None:
    budget = docs["PodDisruptionBudget"]["spec"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] < docs["Deployment"]["spec"]["replicas"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()


def test_admin_port_only_from_monitoring(docs: dict[str, dict[str, Any]]) -> None:
    rules = docs["NetworkPolicy"]["spec"]["ingress"]
    admin = [r for r in rules if {p["port"] for p in r["ports"]} == {9464}]
    assert len(admin) == 1 and admin[0].get("from"), "admin port must not be open to all"


# -- the single-image manifest ---------------------------------------------------------------

SINGLE = KUBERNETES / "omni-sidecar.yaml"


def test_single_image_grace_covers_the_drain_it_really_gets(tmp_path: Path) -> None:
    """The image's 20 s drain is replaced by the container's env, which the grace covers."""
    single = {d["kind"]: d for d in _documents(SINGLE)}
    effective = effective_settings(
        single["ConfigMap"]["data"]["config.toml"], "engine", _container(single), tmp_path
    )
    assert effective.engine.kind == "vllm-omni"
    assert effective.drain_timeout == 30
    assert parse_listen(effective.listen) == ("0.0.0.0", 8000)
    grace = _pod(single)["terminationGracePeriodSeconds"]
    assert grace > effective.drain_timeout + effective.engine.stop_grace


# -- the two-container manifest: the engine's own image, the sidecar as a native sidecar ------

NATIVE = KUBERNETES / "omni-sidecar-native-sidecar.yaml"
#: What the preStop hook allows the engine's own SIGTERM stop (vLLM-Omni's), seconds.
ENGINE_STOP_ALLOWANCE = 30


@pytest.fixture(scope="module")
def native() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _documents(NATIVE)}


def _native_sidecar(native: dict[str, dict[str, Any]]) -> dict[str, Any]:
    init = _pod(native)["initContainers"]
    assert len(init) == 1
    sidecar: dict[str, Any] = init[0]
    return sidecar


def _native_engine(native: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = _pod(native)["containers"]
    assert len(containers) == 1
    engine: dict[str, Any] = containers[0]
    return engine


@pytest.fixture(scope="module")
def native_settings(
    native: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    return effective_settings(
        native["ConfigMap"]["data"]["config.toml"],
        "sidecar",
        _native_sidecar(native),
        tmp_path_factory.mktemp("native"),
    )


def _pre_stop_script(native: dict[str, dict[str, Any]]) -> str:
    command = _native_engine(native)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    return str(command[2])


def test_native_sidecar_fronts_the_engine_container_on_localhost(
    native: dict[str, dict[str, Any]], native_settings: Any
) -> None:
    sidecar = _native_sidecar(native)
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar, not a one-shot init
    assert native_settings.engine.kind == "external"
    engine = _native_engine(native)
    command = engine["command"]
    assert command[:4] == ["python3", "-m", "vllm_omni.entrypoints.cli.main", "serve"]
    assert "--omni" in command
    assert command[command.index("--host") + 1] == "127.0.0.1"
    port = int(command[command.index("--port") + 1])
    assert native_settings.upstream == f"ws://127.0.0.1:{port}"
    assert "nvidia.com/gpu" in engine["resources"]["limits"]
    assert "ports" not in engine  # the engine is reached through the sidecar only


def test_native_sidecar_is_non_root_on_a_read_only_root(
    native: dict[str, dict[str, Any]],
) -> None:
    context = _native_sidecar(native)["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False


def test_native_sidecar_ports_and_probes(
    native: dict[str, dict[str, Any]], native_settings: Any
) -> None:
    from proxy.edge.client_app import build_client_app
    from proxy.server import Sidecar

    sidecar = _native_sidecar(native)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert parse_listen(native_settings.listen) == ("0.0.0.0", ports["realtime"])
    assert parse_listen(native_settings.admin_listen) == ("0.0.0.0", ports["metrics"])
    assert [p["targetPort"] for p in native["Service"]["spec"]["ports"]] == ["realtime"]
    served = {
        info.get("path") or info.get("formatter")
        for info in (
            r.get_info()
            for r in build_client_app(
                Sidecar(dataclasses.replace(native_settings, api_keys_file=None), environ={}).state
            ).router.resources()
        )
    }
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # A native sidecar's startupProbe holds the engine back until it passes: /readyz
    # waits for the engine, so it would never pass. Liveness only.
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[name]["httpGet"]["path"] in served
        assert sidecar[name]["httpGet"]["port"] == "realtime"


def test_native_grace_covers_pause_drain_and_engine_stop(
    native: dict[str, dict[str, Any]], native_settings: Any
) -> None:
    script = _pre_stop_script(native)
    pause = float(re.search(r"time\.sleep\((\d+)\)", script)[1])  # type: ignore[index]
    budget = float(re.search(r"time\.monotonic\(\) \+ (\d+)", script)[1])  # type: ignore[index]
    assert budget > native_settings.drain_timeout  # the hook outlasts the drain
    grace = _pod(native)["terminationGracePeriodSeconds"]
    assert grace > pause + budget + ENGINE_STOP_ALLOWANCE
    admin_port = parse_listen(native_settings.admin_listen)[1]
    client_port = parse_listen(native_settings.listen)[1]
    assert f"http://127.0.0.1:{admin_port}/engines/0/drain" in script
    assert f"http://127.0.0.1:{client_port}/readyz" in script


async def test_native_pre_stop_drains_the_sidecar_before_returning(
    native: dict[str, dict[str, Any]],
    native_settings: Any,
    simulator: Any,
    sidecar: Any,
) -> None:
    """The engine's preStop hook, run as written against a real sidecar in front of a
    simulator: a live session gets session.closed {shutdown} and 1001 at the drain
    deadline, and the hook returns only then (the engine would get SIGTERM now)."""
    import asyncio
    import os
    import sys
    import time

    from tests.conftest import DEADLINE, MS
    from tests.integration.helpers import AUDIO_DELTA, connect, request_response

    drain = 1500 * MS
    token = "native-pre-stop-token"
    sim = await simulator("--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "60")
    running = await sidecar(upstream=sim.ws_url, drain_timeout=drain, admin_token=token)
    script = _pre_stop_script(native)
    for old, new in (
        ("time.sleep(5)", "time.sleep(0)"),
        (
            f"127.0.0.1:{parse_listen(native_settings.admin_listen)[1]}",
            running.admin_url.removeprefix("http://"),
        ),
        (
            f"127.0.0.1:{parse_listen(native_settings.listen)[1]}",
            running.http_url.removeprefix("http://"),
        ),
    ):
        assert script.count(old) == 1, old
        script = script.replace(old, new)

    async with connect(running.url) as client:
        await request_response(client, open_session=True)
        await client.recv_until(AUDIO_DELTA)
        started = time.monotonic()
        hook = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, env={**os.environ, "OMNI_SIDECAR_ADMIN_TOKEN": token}
        )
        events = await client.recv_until_closed(timeout=drain + DEADLINE)
        assert client.close_code == 1001
        assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "shutdown"
        async with asyncio.timeout(DEADLINE):
            assert await hook.wait() == 0
        assert time.monotonic() - started >= drain * 0.9
