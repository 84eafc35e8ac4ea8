"""Who gets in (issue "hardening", docs/design.md, Admission and lifecycle; Settings): API keys,
origins, upstream credentials.

Every check happens before the WebSocket upgrade, so a rejected client never
reaches the engine: the scripted engine (``tests/fakes/scripted_engine.py``)
records every connection and its headers, and the tests assert it saw none.
Keys are distinctive strings so that a leak into the logs is easy to find.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.errors import ConfigError
from tests.children import SidecarChild
from tests.conftest import DEADLINE, wait_until
from tests.fakes.scripted_engine import MODELS_BODY, ScriptedEngine
from tests.integration.helpers import connect
from tests.integration.leakcheck import child_pids

pytestmark = pytest.mark.timeout(60)

KEY = "sk-omni-K1-7f3c9e1d"
OTHER_KEY = "sk-omni-K2-b04a22aa"
WRONG_KEY = "sk-omni-WRONG-55e0c6"
ENGINE_KEY = "sk-engine-ENGINEKEY-91d2"
ALL_SECRETS = (KEY, OTHER_KEY, WRONG_KEY, ENGINE_KEY)


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


async def handshake_status(url: str, **kwargs: Any) -> tuple[int, dict[str, str]]:
    """The HTTP status (and headers) of a refused upgrade; 101 when it was accepted."""
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_close=1), **kwargs)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status, dict(exc.headers or {})
        await ws.close()
        return 101, {}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rejected(proxy: Any, reason: str) -> float:
    return float(proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": reason}))


# -- keys -------------------------------------------------------------------------------------


async def test_auth_is_off_by_default(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url)
    assert proxy.sidecar.settings.api_keys == () and proxy.sidecar.settings.api_keys_file is None
    assert await handshake_status(proxy.url) == (101, {})
    assert len(engine.connections) == 1
    assert rejected(proxy, "unauthorized") == 0


async def test_missing_key_is_401_before_the_upgrade(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    status, headers = await handshake_status(proxy.url)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    # Rejected before the upgrade: the engine never saw a connection.
    assert engine.connections == []
    assert rejected(proxy, "unauthorized") == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"headers": bearer(WRONG_KEY)},
        {"headers": {"Authorization": f"Basic {KEY}"}},  # right key, wrong scheme
        {"headers": {"Authorization": "Bearer "}},
        {"headers": {"Authorization": KEY}},
        {"protocols": ("realtime", f"openai-insecure-api-key.{WRONG_KEY}")},
        {"protocols": ("realtime", "openai-insecure-api-key.")},
        {"headers": bearer(KEY[:-1])},  # prefix of a valid key
        {"headers": bearer(KEY + "x")},  # valid key plus a suffix
    ],
    ids=[
        "wrong",
        "basic",
        "empty",
        "no-scheme",
        "subprotocol-wrong",
        "subprotocol-empty",
        "prefix",
        "suffix",
    ],
)
async def test_wrong_credentials_are_401(engine, sidecar, kwargs) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    status, headers = await handshake_status(proxy.url, **kwargs)
    assert status == 401 and "WWW-Authenticate" in headers
    assert engine.connections == []


async def test_bearer_key_is_accepted(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY, OTHER_KEY))
    for key in (KEY, OTHER_KEY):
        async with connect(proxy.url, headers=bearer(key)) as client:
            conn = await engine.next_connection()
            await client.send({"type": "x.hello"})
            assert (await conn.receive_event())["type"] == "x.hello"
    assert rejected(proxy, "unauthorized") == 0


async def test_subprotocol_key_is_accepted_with_realtime(engine, sidecar) -> None:
    """Browsers cannot set headers: the key rides in ``Sec-WebSocket-Protocol``."""
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    async with connect(proxy.url, protocols=("realtime", f"openai-insecure-api-key.{KEY}")) as c:
        assert c.ws.protocol == "realtime"
        conn = await engine.next_connection()
        await c.send({"type": "x.hello"})
        assert (await conn.receive_event())["type"] == "x.hello"
    # The key offered as a subprotocol is not passed on to the engine.
    assert "sec-websocket-protocol" not in {k.lower() for k in conn.headers}
    assert all(KEY not in value for value in conn.headers.values())


async def test_api_keys_file(engine, sidecar, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated 2026-11\n{KEY}\n\n  {OTHER_KEY}  # ops team\n")
    proxy = await sidecar(upstream=engine.ws_url, api_keys_file=str(keys))
    assert (await handshake_status(proxy.url, headers=bearer(KEY)))[0] == 101
    assert (await handshake_status(proxy.url, headers=bearer(OTHER_KEY)))[0] == 101
    assert (await handshake_status(proxy.url, headers=bearer("# rotated 2026-11")))[0] == 401
    assert (await handshake_status(proxy.url))[0] == 401
    assert len(engine.connections) == 2


async def test_api_keys_and_file_are_combined(engine, sidecar, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{OTHER_KEY}\n")
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,), api_keys_file=str(keys))
    assert (await handshake_status(proxy.url, headers=bearer(KEY)))[0] == 101
    assert (await handshake_status(proxy.url, headers=bearer(OTHER_KEY)))[0] == 101


async def test_unreadable_api_keys_file_refuses_to_start(engine, sidecar, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        await sidecar(upstream=engine.ws_url, api_keys_file=str(tmp_path / "missing"))
    assert info.value.key == "api_keys_file"


async def test_empty_api_keys_file_does_not_turn_auth_off(engine, sidecar, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# keys are provisioned by the secret manager\n")
    try:
        proxy = await sidecar(upstream=engine.ws_url, api_keys_file=str(keys))
    except ConfigError:
        return  # refusing to start is a fine answer
    assert (await handshake_status(proxy.url))[0] == 401


async def test_keys_never_appear_in_logs(engine, sidecar, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = await sidecar(
        upstream=engine.ws_url,
        api_keys=(KEY, OTHER_KEY),
        upstream_authorization=f"key:{ENGINE_KEY}",
    )
    attempts: list[dict[str, Any]] = [
        {"headers": bearer(WRONG_KEY)},
        {"headers": {"Authorization": f"Basic {KEY}"}},
        {"protocols": ("realtime", f"openai-insecure-api-key.{WRONG_KEY}")},
        {"headers": bearer(KEY)},
        {"protocols": ("realtime", f"openai-insecure-api-key.{OTHER_KEY}")},
    ]
    statuses = [(await handshake_status(proxy.url, **kw))[0] for kw in attempts]
    assert statuses == [401, 401, 401, 101, 101]
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy.http_url}/v1/models", headers=bearer(WRONG_KEY)) as resp,
    ):
        assert resp.status == 401
    # An engine that cannot be reached: the failure is logged, the credentials are not.
    await engine.aclose()
    assert (await handshake_status(proxy.url, headers=bearer(KEY)))[0] == 502
    await proxy.stop()
    text = caplog.text + "\n".join(str(r.args) for r in caplog.records)
    assert "session open" in text and "upstream connect" in text  # logs were captured
    for secret in ALL_SECRETS:
        assert secret not in text, f"{secret} leaked into the logs"


# -- origins ---------------------------------------------------------------------------------


async def test_allowed_origins(engine, sidecar) -> None:
    proxy = await sidecar(
        upstream=engine.ws_url, allowed_origins=("https://app.example.com", "https://b.example/")
    )
    assert (await handshake_status(proxy.url, origin="https://evil.example"))[0] == 403
    assert (await handshake_status(proxy.url, origin="https://app.example.com.evil.example"))[
        0
    ] == 403
    assert (await handshake_status(proxy.url, origin="http://app.example.com"))[0] == 403
    assert (await handshake_status(proxy.url, origin="null"))[0] == 403
    assert engine.connections == []
    assert (await handshake_status(proxy.url, origin="https://app.example.com"))[0] == 101
    assert (await handshake_status(proxy.url, origin="https://b.example"))[0] == 101
    assert (await handshake_status(proxy.url))[0] == 101  # no Origin: not a browser
    assert len(engine.connections) == 3
    assert rejected(proxy, "forbidden_origin") == 4


async def test_origin_is_checked_before_the_key(engine, sidecar) -> None:
    proxy = await sidecar(
        upstream=engine.ws_url, api_keys=(KEY,), allowed_origins=("https://app.example.com",)
    )
    status, _ = await handshake_status(
        proxy.url, origin="https://evil.example", headers=bearer(KEY)
    )
    assert status == 403
    status, _ = await handshake_status(proxy.url, origin="https://app.example.com")
    assert status == 401
    status, _ = await handshake_status(
        proxy.url, origin="https://app.example.com", headers=bearer(KEY)
    )
    assert status == 101


# -- reverse-proxied HTTP ----------------------------------------------------------------------


async def test_reverse_proxied_paths_need_the_key(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    async with aiohttp.ClientSession() as http:
        for headers in ({}, bearer(WRONG_KEY)):
            async with http.get(f"{proxy.http_url}/v1/models", headers=headers) as resp:
                assert resp.status == 401 and "WWW-Authenticate" in resp.headers
            async with http.post(f"{proxy.http_url}/v1/anything", data=b"x", headers=headers) as r:
                assert r.status == 401
            # A plain GET on the WebSocket path is reverse-proxied: it needs the key too.
            async with http.get(f"{proxy.http_url}/v1/realtime", headers=headers) as resp:
                assert resp.status == 401
        assert engine.http_requests == []
        async with http.get(f"{proxy.http_url}/v1/models", headers=bearer(KEY)) as resp:
            assert resp.status == 200 and await resp.json() == MODELS_BODY
        # Probes stay open: an orchestrator has no key.
        for path in ("/healthz", "/readyz"):
            async with http.get(f"{proxy.http_url}{path}") as resp:
                assert resp.status == 200, path
    assert rejected(proxy, "unauthorized") == 6


# -- credentials toward the engine -------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("pass-through", f"Bearer {KEY}"),
        ("none", None),
        (f"key:{ENGINE_KEY}", f"Bearer {ENGINE_KEY}"),
    ],
    ids=["pass-through", "none", "key"],
)
async def test_upstream_authorization_on_the_websocket(engine, sidecar, mode, expected) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,), upstream_authorization=mode)
    async with connect(proxy.url, headers=bearer(KEY)):
        conn = await engine.next_connection()
    assert conn.headers.get("Authorization") == expected


async def test_upstream_authorization_with_subprotocol_key(engine, sidecar) -> None:
    """A browser's key (subprotocol) never becomes an Authorization header upstream."""
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    async with connect(proxy.url, protocols=("realtime", f"openai-insecure-api-key.{KEY}")):
        conn = await engine.next_connection()
    assert "Authorization" not in conn.headers


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("none", None), (f"key:{ENGINE_KEY}", f"Bearer {ENGINE_KEY}")],
    ids=["none", "key"],
)
async def test_upstream_authorization_on_reverse_proxied_http(
    engine, sidecar, mode, expected
) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,), upstream_authorization=mode)
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy.http_url}/v1/echo", headers=bearer(KEY)) as resp,
    ):
        assert resp.status == 200
    [request] = engine.http_requests
    assert request["headers"].get("Authorization") == expected


async def test_upstream_authorization_pass_through_on_http(engine, sidecar) -> None:
    proxy = await sidecar(upstream=engine.ws_url, api_keys=(KEY,))
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy.http_url}/v1/echo", headers=bearer(KEY)) as resp,
    ):
        assert resp.status == 200
    assert engine.http_requests[0]["headers"].get("Authorization") == f"Bearer {KEY}"


# -- counting ----------------------------------------------------------------------------------


async def test_rejections_are_counted_per_reason(engine, sidecar) -> None:
    proxy = await sidecar(
        upstream=engine.ws_url, api_keys=(KEY,), allowed_origins=("https://app.example.com",)
    )
    unauthorized = [{}, {"headers": bearer(WRONG_KEY)}, {"origin": "https://app.example.com"}]
    forbidden = [
        {"origin": "https://evil.example"},
        {"origin": "https://evil.example", "headers": bearer(KEY)},
    ]
    for kwargs in unauthorized * 2:
        assert (await handshake_status(proxy.url, **kwargs))[0] == 401
    for kwargs in forbidden:
        assert (await handshake_status(proxy.url, **kwargs))[0] == 403
    assert (await handshake_status(proxy.url, headers=bearer(KEY)))[0] == 101
    assert rejected(proxy, "unauthorized") == 6
    assert rejected(proxy, "forbidden_origin") == 2
    for other in ("capacity", "not_ready", "draining", "upstream_unavailable"):
        assert rejected(proxy, other) == 0
    # Rejections are not sessions: only the accepted one ever reached the engine.
    assert len(engine.connections) == 1
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0, what="no session active"
    )


async def test_unauthorized_attempts_take_no_per_ip_slot(engine, sidecar) -> None:
    """Auth runs before admission: rejected handshakes never hold a slot."""
    proxy = await sidecar(
        upstream=engine.ws_url, api_keys=(KEY,), max_sessions=1, max_sessions_per_ip=1
    )
    for _ in range(3):
        assert (await handshake_status(proxy.url, headers=bearer(WRONG_KEY)))[0] == 401
    async with connect(
        proxy.url, headers=bearer(KEY), timeout=aiohttp.ClientWSTimeout(ws_close=DEADLINE)
    ):
        await engine.next_connection()
        # Even with every slot taken, an unauthenticated client learns nothing but 401.
        assert (await handshake_status(proxy.url))[0] == 401
    assert rejected(proxy, "capacity") == 0


# -- the engine process ------------------------------------------------------------------------


@pytest.fixture
def served_with_keys(tmp_path: Path) -> Iterator[SidecarChild]:
    """``omni-sidecar serve`` (simulator engine) with client keys in its environment."""
    child = SidecarChild(
        base_env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")},
        env={"OMNI_SIDECAR_API_KEYS": f"{KEY},{OTHER_KEY}"},
        log_path=tmp_path / "sidecar.log",
        stop_grace=DEADLINE,
        ready_timeout=3 * DEADLINE,
    )
    child.start()
    try:
        yield child
    finally:
        child.stop()


async def test_client_keys_do_not_reach_the_engine_environment(served_with_keys) -> None:
    served: SidecarChild = served_with_keys
    await served.ready()
    log = served.log_path
    [engine_pid] = child_pids(served.pid)
    environ = Path(f"/proc/{engine_pid}/environ").read_bytes().split(b"\0")
    assert KEY not in log.read_text()
    assert not [v for v in environ if v.startswith(b"OMNI_SIDECAR_")]
    assert all(KEY.encode() not in v for v in environ)
