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
