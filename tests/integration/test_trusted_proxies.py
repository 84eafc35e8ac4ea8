"""Trusted proxies (issue 13 item 8): whose address the per-IP limit and the logs use.

Socket-free: ``X-Forwarded-For`` walking and PROXY v1/v2 parsing
(proxy/edge/forwarded.py). Over loopback: a PROXY header or ``X-Forwarded-For``
from a trusted peer sets the client's address (the per-IP limit refuses the
second session of that address and logs it by that address); from an
untrusted peer neither is believed. Then the nginx TLS example
(deploy/nginx/omni-sidecar-tls.conf), run as written by our own nginx on free
loopback ports with a certificate made by ``openssl`` at test time: a
WebSocket session through it works, and the sidecar limits and logs by the
client's own address (the client binds 127.0.0.2 / 127.0.0.3).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import ipaddress
import logging
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.edge.forwarded import (
    PROXY_V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    TrustedProxies,
    forwarded_client,
    parse_proxy_header,
)
from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import REPO_ROOT
from tests.integration.nginx_child import main_config, nginx

pytestmark = pytest.mark.timeout(60)

KEY = base64.b64encode(os.urandom(16)).decode()
NGINX_EXAMPLE = REPO_ROOT / "deploy" / "nginx" / "omni-sidecar-tls.conf"


# -- socket-free ------------------------------------------------------------------------------------

TRUSTED = TrustedProxies(["127.0.0.1/32", "10.0.0.0/8"])


@pytest.mark.parametrize(
    ("peer", "xff", "client"),
    [
        ("127.0.0.1", [], "127.0.0.1"),  # a trusted peer that forwards nothing
        ("127.0.0.1", ["203.0.113.7"], "203.0.113.7"),
        # rightmost untrusted hop; what the client itself wrote on the left is ignored
        ("127.0.0.1", ["6.6.6.6, 203.0.113.7"], "203.0.113.7"),
        ("127.0.0.1", ["6.6.6.6, 203.0.113.7, 10.1.2.3"], "203.0.113.7"),
        ("127.0.0.1", ["6.6.6.6", "203.0.113.7, 10.1.2.3"], "203.0.113.7"),  # two headers
        ("127.0.0.1", ["10.0.0.5, 10.1.2.3"], "10.0.0.5"),  # all trusted: the leftmost
        ("127.0.0.1", ["junk, 10.1.2.3"], "10.1.2.3"),  # garbage stops the walk
        ("127.0.0.1", ["2001:db8::1"], "2001:db8::1"),
        ("192.0.2.1", ["203.0.113.7"], "192.0.2.1"),  # untrusted peer: header ignored
        ("::ffff:127.0.0.1", ["203.0.113.7"], "203.0.113.7"),  # v4-mapped peer
    ],
)
def test_forwarded_for_is_read_right_to_left_through_trusted_hops(
    peer: str, xff: list[str], client: str
) -> None:
    assert forwarded_client(peer, xff, TRUSTED) == client


def test_without_trusted_proxies_nothing_is_believed() -> None:
    assert forwarded_client("127.0.0.1", ["203.0.113.7"], TrustedProxies()) == "127.0.0.1"
    assert not TrustedProxies()


def test_a_bad_network_is_a_config_error() -> None:
    with pytest.raises(ValueError):
        TrustedProxies(["not-a-network"])


def v2(command: int, family: int, body: bytes) -> bytes:
    return (
        PROXY_V2_SIGNATURE + bytes([0x20 | command, family]) + len(body).to_bytes(2, "big") + body
    )


V2_TCP4 = v2(0x1, 0x11, bytes([203, 0, 113, 7, 127, 0, 0, 1]) + (5555).to_bytes(2, "big") * 2)
V2_TCP6 = v2(
    0x1,
    0x21,
    ipaddress.IPv6Address("2001:db8::7").packed + ipaddress.IPv6Address("::1").packed + b"\0" * 4,
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"PROXY TCP4 203.0.113.7 127.0.0.1 5555 80\r\nGET", ProxyHeader(42, "203.0.113.7")),
        (b"PROXY TCP6 2001:db8::7 ::1 5555 80\r\n", ProxyHeader(36, "2001:db8::7")),
        (b"PROXY UNKNOWN\r\n", ProxyHeader(15, None)),
        (b"PROXY TCP4 203.0.113.7 127.0", None),  # more bytes needed
        (b"PROXY", None),
        (V2_TCP4 + b"GET", ProxyHeader(28, "203.0.113.7")),
        (V2_TCP6, ProxyHeader(52, "2001:db8::7")),
        (v2(0x0, 0x00, b""), ProxyHeader(16, None)),  # LOCAL
        (V2_TCP4[:20], None),
        (PROXY_V2_SIGNATURE[:5], None),
    ],
)
def test_proxy_headers_parse(data: bytes, expected: ProxyHeader | None) -> None:
    assert parse_proxy_header(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        b"PROXY TCP4 203.0.113.7 nonsense 5555 80\r\n",
        b"PROXY TCP4 2001:db8::7 ::1 5555 80\r\n",  # family does not match
        b"PROXY TCP4 203.0.113.7 127.0.0.1 99999 80\r\n",
        b"PROXY TCP4 " + b"1" * 120,  # no CRLF within 107 bytes
        v2(0x1, 0x11, b"\x01\x02"),  # address block too short
        PROXY_V2_SIGNATURE + bytes([0x31, 0x11, 0, 12]) + b"\0" * 12,  # version 3
        PROXY_V2_SIGNATURE + bytes([0x21, 0x11, 0xFF, 0xFF]),  # 64 KiB block
    ],
)
def test_malformed_proxy_headers_are_errors(data: bytes) -> None:
    with pytest.raises(ProxyHeaderError):
        parse_proxy_header(data)


# -- over loopback ----------------------------------------------------------------------------------


def handshake(extra: str = "") -> bytes:
    return (
        "GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


@contextlib.asynccontextmanager
async def raw_session(port: int, prefix: bytes, extra: str = "") -> AsyncIterator[int]:
    """Open a raw connection, send ``prefix`` + a handshake; yield the status; keep it open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(prefix + handshake(extra))
        async with asyncio.timeout(DEADLINE):
            line = await reader.readline()
        yield int(line.split()[1]) if line else 0
    finally:
        writer.close()


PROXY_A = b"PROXY TCP4 203.0.113.7 127.0.0.1 5555 80\r\n"
PROXY_B = b"PROXY TCP4 203.0.113.8 127.0.0.1 5555 80\r\n"


async def test_proxy_header_from_a_trusted_peer_sets_the_client_address(
    simulator, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sim = await simulator()
    proxy = await sidecar(
        upstream=sim.ws_url, trusted_proxies=("127.0.0.1/32",), max_sessions_per_ip=1
    )
    port = proxy.sidecar.bound["listen"][1]
    async with raw_session(port, PROXY_A) as first:
        assert first == 101
        async with raw_session(port, V2_TCP4) as same_address:  # v2, same client address
            assert same_address == 429
        async with raw_session(port, PROXY_B) as other:
            assert other == 101
    assert "refused handshake from 203.0.113.7: 429 capacity" in caplog.text


async def test_forwarded_for_from_a_trusted_peer_sets_the_client_address(
    simulator, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sim = await simulator()
    proxy = await sidecar(
        upstream=sim.ws_url, trusted_proxies=("127.0.0.1/32",), max_sessions_per_ip=1
    )
    port = proxy.sidecar.bound["listen"][1]
    async with raw_session(port, b"", "X-Forwarded-For: 6.6.6.6, 198.51.100.4\r\n") as first:
        assert first == 101
        async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.4\r\n") as again:
            assert again == 429
        async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.5\r\n") as other:
            assert other == 101
    assert "refused handshake from 198.51.100.4: 429 capacity" in caplog.text


async def test_an_untrusted_peer_cannot_choose_its_address(
    simulator, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sim = await simulator()
    proxy = await sidecar(
        upstream=sim.ws_url, trusted_proxies=("10.0.0.0/8",), max_sessions_per_ip=1
    )
    port = proxy.sidecar.bound["listen"][1]
    async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.4\r\n") as first:
        assert first == 101
        # Another "address" in the header: still 127.0.0.1, still one session.
        async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.5\r\n") as spoofed:
            assert spoofed == 429
        async with raw_session(port, PROXY_B) as proxied:
            assert proxied == 0  # closed, no answer
    assert "refused handshake from 127.0.0.1: 429 capacity" in caplog.text
    assert (
        proxy.metric(
            "omni_sidecar_rejected_connections_total", {"reason": "untrusted_proxy_header"}
        )
        == 1
    )


# -- nginx with TLS in front ------------------------------------------------------------------------


def _make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "fullchain.pem", directory / "privkey.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=DEADLINE,
    )  # fmt: skip
    return cert, key


def _nginx_config(prefix: Path, tls_port: int, sidecar_port: int, cert: Path, key: Path) -> Path:
    """Our own nginx: the example as written, with ports and certificate paths replaced."""
    example = NGINX_EXAMPLE.read_text()
    replaced = (
        example.replace("server 127.0.0.1:8000;", f"server 127.0.0.1:{sidecar_port};")
        .replace("listen 443 ssl;", f"listen 127.0.0.1:{tls_port} ssl;")
        .replace("/etc/omni-sidecar/tls/fullchain.pem", str(cert))
        .replace("/etc/omni-sidecar/tls/privkey.pem", str(key))
    )
    assert replaced.count(str(prefix)) == 2 and f":{sidecar_port};" in replaced
    site = prefix / "omni-sidecar-tls.conf"
    site.write_text(replaced)
    return main_config(prefix, site)


@contextlib.asynccontextmanager
async def tls_client(source: str, cert: Path) -> AsyncIterator[aiohttp.ClientSession]:
    context = ssl.create_default_context(cafile=str(cert))
    connector = aiohttp.TCPConnector(ssl=context, local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as http:
        yield http


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_a_session_through_nginx_with_tls_is_limited_and_logged_by_client_address(
    tmp_path: Path, simulator, sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sim = await simulator()
    proxy = await sidecar(
        upstream=sim.ws_url, trusted_proxies=("127.0.0.1/32",), max_sessions_per_ip=1
    )
    cert, key = _make_certificate(tmp_path)
    tls_port = free_port()
    config = _nginx_config(tmp_path, tls_port, proxy.sidecar.bound["listen"][1], cert, key)
    url = f"wss://127.0.0.1:{tls_port}/v1/realtime"
    async with nginx(tmp_path, config, port=tls_port) as process:

        async def up() -> bool:
            if not process.running():
                pytest.fail("nginx exited:\n" + (tmp_path / "error.log").read_text())
            try:
                async with (
                    tls_client("127.0.0.1", cert) as http,
                    http.get(f"https://127.0.0.1:{tls_port}/healthz") as resp,
                ):
                    return resp.status == 200
            except (aiohttp.ClientError, OSError):
                return False

        await wait_until(up, what="nginx answering over TLS")
        async with tls_client("127.0.0.2", cert) as http, http.ws_connect(url) as ws:
            await ws.send_str(orjson.dumps({"type": "session.update", "session": {}}).decode())
            async with asyncio.timeout(DEADLINE):
                while True:
                    event = orjson.loads((await ws.receive()).data)
                    if event["type"] == "session.updated":
                        break
            # A second session of the same client: refused by the per-IP limit.
            async with tls_client("127.0.0.2", cert) as again:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await again.ws_connect(url)
                assert refused.value.status == 429
            # Another client behind the same nginx is not affected.
            async with tls_client("127.0.0.3", cert) as other, other.ws_connect(url) as ws3:
                await ws3.send_str(orjson.dumps({"type": "session.update", "session": {}}).decode())
                assert (await ws3.receive(timeout=DEADLINE)).type is aiohttp.WSMsgType.TEXT
    assert "refused handshake from 127.0.0.2: 429 capacity" in caplog.text
    assert "session open: 127.0.0.2 -> " in caplog.text
    assert "session open: 127.0.0.3 -> " in caplog.text
    assert "session open: 127.0.0.1 -> " not in caplog.text


async def test_a_reload_changes_the_trusted_proxies_at_once(simulator, sidecar) -> None:
    """trusted_proxies is live: the next handshake is judged by the reloaded list."""
    sim = await simulator()
    proxy = await sidecar(upstream=sim.ws_url, max_sessions_per_ip=1)
    port = proxy.sidecar.bound["listen"][1]
    async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.4\r\n") as first:
        assert first == 101
        async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.5\r\n") as ignored:
            assert ignored == 429  # not trusted yet: both are 127.0.0.1
        state = proxy.sidecar.state
        state.apply_settings(dataclasses.replace(state.settings, trusted_proxies=("127.0.0.1/32",)))
        async with raw_session(port, b"", "X-Forwarded-For: 198.51.100.5\r\n") as believed:
            assert believed == 101
