"""Which probe asks an engine whether it is ready, and what its answers mean.

``health_verdict`` (engine_launcher/policy.py) classifies one answer to
``GET /health``: 200 is healthy; 400, 404, 405, 426 and a non-HTTP answer say
the server has no health route (``auto`` hands over to a handshake); every
other status, 5xx first, is unhealthy. ``probe_websocket_url`` builds the
handshake's URL (``autostart=0``, the realtime path when the URL names none);
``default_probe`` maps ``engine.probe`` onto a probe for external upstreams,
child engines and every replica of a pool. Socket-free; the probes' wire
behaviour is tested in tests/integration/test_external_readiness.py.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

from engine_launcher.policy import NO_HEALTH_ROUTE_STATUSES, HealthVerdict, health_verdict
from engine_launcher.pool import plan_replicas
from engine_launcher.process import HealthProbe, UpstreamProbe, probe_websocket_url
from engine_launcher.supervisor import default_probe
from proxy.settings import PROBE_KINDS, EngineConfig, EngineConfigError

V = HealthVerdict


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, V.HEALTHY),
        # A server without a health route: picows, a missing route, a wrong method,
        # the websockets library, and a port that does not speak HTTP.
        (400, V.NO_HEALTH_ROUTE),
        (404, V.NO_HEALTH_ROUTE),
        (405, V.NO_HEALTH_ROUTE),
        (426, V.NO_HEALTH_ROUTE),
        (None, V.NO_HEALTH_ROUTE),
        # The route is there and says no, or says something else than 200.
        (500, V.UNHEALTHY),
        (502, V.UNHEALTHY),
        (503, V.UNHEALTHY),
        (504, V.UNHEALTHY),
        (401, V.UNHEALTHY),
        (403, V.UNHEALTHY),
        (429, V.UNHEALTHY),
        (301, V.UNHEALTHY),
        (204, V.UNHEALTHY),
    ],
)
def test_health_answer_classification(status: int | None, verdict: HealthVerdict) -> None:
    assert health_verdict(status) is verdict


def test_no_5xx_ever_reads_as_a_missing_route() -> None:
    assert all(health_verdict(code) is V.UNHEALTHY for code in range(500, 600))
    assert NO_HEALTH_ROUTE_STATUSES == {400, 404, 405, 426}


@pytest.mark.parametrize(
    ("upstream", "expected"),
    [
        ("ws://h:8091", "ws://h:8091/v1/realtime?autostart=0"),
        ("ws://h:8091/", "ws://h:8091/v1/realtime?autostart=0"),
        ("wss://h/v1/realtime", "wss://h/v1/realtime?autostart=0"),
        ("ws://h:1/v1/duplex?model=m", "ws://h:1/v1/duplex?model=m&autostart=0"),
        ("ws://h:1/prefix", "ws://h:1/prefix/v1/realtime?autostart=0"),
        # A given autostart is replaced: the probe never asks for a session.
        ("ws://h:1/v1/realtime?autostart=1&duplex=1", "ws://h:1/v1/realtime?duplex=1&autostart=0"),
    ],
)
def test_handshake_url_asks_for_no_session(upstream: str, expected: str) -> None:
    url = probe_websocket_url(upstream)
    assert url == expected
    assert parse_qsl(urlsplit(url).query).count(("autostart", "0")) == 1


def external(**fields: Any) -> EngineConfig:
    return EngineConfig(kind="external", upstream="ws://10.0.0.7:9000/v1/realtime", **fields)


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_external_probe_follows_the_setting(kind: str) -> None:
    probe = default_probe(external(probe=kind), None)
    assert isinstance(probe, UpstreamProbe)
    assert probe.kind == kind
    assert probe.health_url == "http://10.0.0.7:9000/health"
    assert probe.websocket_url == "ws://10.0.0.7:9000/v1/realtime?autostart=0"
    assert (probe.host, probe.port) == ("10.0.0.7", 9000)


def test_an_explicit_health_url_is_asked_without_a_hand_over() -> None:
    for kind in ("auto", "health"):
        probe = default_probe(external(probe=kind, health_url="http://10.0.0.7:8081/ready"), None)
        assert isinstance(probe, HealthProbe)
        assert (probe.host, probe.port, probe.path) == ("10.0.0.7", 8081, "/ready")


@pytest.mark.parametrize("kind", ["websocket", "tcp"])
def test_a_child_engine_can_be_probed_by_handshake_or_connect(kind: str) -> None:
    config = EngineConfig(kind="command", command=("serve", "{port}"), probe=kind)  # type: ignore[arg-type]
    probe = default_probe(config, 18_091)
    assert isinstance(probe, UpstreamProbe)
    assert probe.kind == kind
    assert probe.websocket_url == "ws://127.0.0.1:18091/v1/realtime?autostart=0"
    assert (probe.host, probe.port) == ("127.0.0.1", 18_091)


def test_a_child_engine_keeps_its_health_probe_on_auto() -> None:
    for kind in ("auto", "health"):
        probe = default_probe(EngineConfig(probe=kind), 18_091)  # type: ignore[arg-type]
        assert isinstance(probe, HealthProbe)
        assert (probe.port, probe.path) == (18_091, "/health")


def test_every_pool_upstream_gets_the_same_choice_and_its_own_probe() -> None:
    config = EngineConfig(
        kind="external",
        upstreams=("ws://10.0.0.5:8091", "ws://10.0.0.6:8091/v1/realtime"),
        probe="websocket",
    )
    probes = [default_probe(plan, None) for plan in plan_replicas(config, {})]
    assert [type(p) for p in probes] == [UpstreamProbe, UpstreamProbe]
    assert [p.kind for p in probes] == ["websocket", "websocket"]  # type: ignore[attr-defined]
    assert [p.websocket_url for p in probes] == [  # type: ignore[attr-defined]
        "ws://10.0.0.5:8091/v1/realtime?autostart=0",
        "ws://10.0.0.6:8091/v1/realtime?autostart=0",
    ]


def test_probe_setting_is_validated() -> None:
    with pytest.raises(EngineConfigError) as unknown:
        EngineConfig(probe="http")  # type: ignore[arg-type]
    assert unknown.value.field == "probe"
    assert "'auto', 'health', 'websocket', 'tcp'" in unknown.value.message
    for kind in ("websocket", "tcp"):
        with pytest.raises(EngineConfigError) as unused:
            external(probe=kind, health_url="http://10.0.0.7:8081/ready")
        assert (unused.value.field, unused.value.depends_on) == ("health_url", "probe")
