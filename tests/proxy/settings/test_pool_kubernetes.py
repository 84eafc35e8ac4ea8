"""deploy/kubernetes/*.yaml: valid Kubernetes objects that agree with the sidecar they deploy.

Every manifest is checked against the Kubernetes OpenAPI schemas bundled in
``kubernetes-validate`` (strict: an unknown field fails), and the per-GPU
pool manifest (omni-sidecar-pool.yaml) against the sidecar's own config keys
(its ConfigMap loads with the real loader, which refuses unknown keys), routes
(probes and the drain hook hit routes the applications really serve) and
timeouts (the grace period covers preStop + drain + engine stop).
docs/design.md, Engine pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from proxy.settings import load, parse_listen

yaml = pytest.importorskip("yaml")

KUBERNETES = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
POOL = KUBERNETES / "omni-sidecar-pool.yaml"
#: The oldest Kubernetes the manifests promise to work on (policy/v1 PDB: 1.21+).
KUBERNETES_VERSION = "1.30.0"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _documents(POOL)}


@pytest.fixture(scope="module")
def settings(docs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("k8s") / "config.toml"
    path.write_text(docs["ConfigMap"]["data"]["config.toml"])
    return load(None, {}, str(path)).settings


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
