"""deploy/kubernetes/omni-sidecar.yaml agrees with the sidecar it deploys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.settings import load, parse_listen

yaml = pytest.importorskip("yaml")

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "omni-sidecar.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


@pytest.fixture(scope="module")
def settings(docs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("k8s") / "config.toml"
    path.write_text(docs["ConfigMap"]["data"]["config.toml"])
    return load(None, {}, str(path)).settings


def _container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_config_map_holds_a_valid_config(settings: Any) -> None:
    assert settings.engine.kind == "vllm-omni"
    assert settings.engine.host == "127.0.0.1"  # the engine is never exposed


def test_ports_match_the_listeners(docs: dict[str, dict[str, Any]], settings: Any) -> None:
    ports = {p["name"]: p["containerPort"] for p in _container(docs)["ports"]}
    assert ports["realtime"] == parse_listen(settings.listen)[1]
    assert ports["metrics"] == parse_listen(settings.admin_listen)[1]
    service_ports = [p["targetPort"] for p in docs["Service"]["spec"]["ports"]]
    assert service_ports == ["realtime"]  # the admin port is not in the client Service


def test_probes_use_the_sidecar_routes(docs: dict[str, dict[str, Any]]) -> None:
    container = _container(docs)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_grace_period_covers_drain_and_engine_stop(
    docs: dict[str, dict[str, Any]], settings: Any
) -> None:
    grace = docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.drain_timeout + settings.engine.stop_grace


def test_admin_port_only_from_monitoring(docs: dict[str, dict[str, Any]]) -> None:
    rules = docs["NetworkPolicy"]["spec"]["ingress"]
    admin = [r for r in rules if {p["port"] for p in r["ports"]} == {9464}]
    assert len(admin) == 1 and admin[0].get("from"), "admin port must not be open to all"


# -- the fleet: sidecars in front of an engine that outlives them (docs/operations.md,
# Rolling restarts) -------------------------------------------------------------------------

FLEET = MANIFEST.parent / "omni-sidecar-fleet.yaml"


@pytest.fixture(scope="module")
def fleet() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(FLEET.read_text()) if d}


@pytest.fixture(scope="module")
def fleet_settings(
    fleet: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    from tests.proxy.settings.test_pool_kubernetes import effective_settings

    return effective_settings(
        fleet["ConfigMap"]["data"]["config.toml"],
        "sidecar",
        _container(fleet),
        tmp_path_factory.mktemp("fleet"),
    )


def test_fleet_engine_outlives_the_sidecars_so_calls_can_move(fleet_settings: Any) -> None:
    # A sidecar that launched its engine stops it on SIGTERM: nothing could resume.
    assert fleet_settings.engine.kind == "external"
    assert fleet_settings.client_resume_grace > 0


def test_fleet_shares_one_resume_secret(
    fleet: dict[str, dict[str, Any]], fleet_settings: Any
) -> None:
    # Without it no other sidecar takes the client's token, and nothing is handed over.
    path = fleet_settings.resume_secret_file
    assert path is not None
    mounts = {m["name"]: m["mountPath"] for m in _container(fleet)["volumeMounts"]}
    volumes = {v["name"]: v for v in fleet["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, mount in mounts.items() if path.startswith(mount + "/")]
    assert "secret" in volumes[name], "one Secret for every pod, not a file of its own"


def test_fleet_rolls_one_ready_pod_in_before_one_goes(fleet: dict[str, dict[str, Any]]) -> None:
    rolling = fleet["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    assert fleet["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


def test_fleet_readiness_turns_false_at_once(fleet: dict[str, dict[str, Any]]) -> None:
    # /readyz is 503 from the SIGTERM on: one failed probe takes the pod out.
    probe = _container(fleet)["readinessProbe"]
    assert probe["httpGet"]["path"] == "/readyz"
    assert probe["periodSeconds"] <= 1 and probe["failureThreshold"] == 1


def test_fleet_grace_covers_pre_stop_drain_and_close(
    fleet: dict[str, dict[str, Any]], fleet_settings: Any
) -> None:
    command = _container(fleet)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    grace = fleet["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # Calls that cannot move drain for drain_timeout, then get close_timeout to close.
    assert grace > pause + fleet_settings.drain_timeout + fleet_settings.close_timeout
    # The pause is what lets endpoints drop the pod before it refuses anything.
    assert pause >= 2
