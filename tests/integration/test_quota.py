"""Quotas per key name, counted in the process (docs/design.md, Quotas).

What a client sees: 429 with ``Retry-After`` and the JSON body naming the
quota before the upgrade; the day's audio running out mid-session as ``error``
{rate_limit_error, quota_exceeded}, ``session.closed`` {quota_exceeded} and
close 1008; a SIGHUP that raises a limit admitting more at once while the
count of open sessions carries over. The sidecar's wall clock is pinned
(``quota._wall``) so minute and day windows cannot roll during a test.
"""

from __future__ import annotations

import base64
import signal
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE, wait_until
from tests.integration.helpers import SILENCE_100MS, connect
from tests.integration.served import ready, serve

pytestmark = pytest.mark.timeout(60)

KEY = "sk-quota-A-7d1e0c"
#: 2027-01-15 12:00:30 UTC: 30 s to the next minute, 43170 s to UTC midnight.
PINNED = 1_800_000_030.0 - (1_800_000_030.0 % 86_400) + 43_230.0
TO_NEXT_MINUTE = 30
TO_MIDNIGHT = 86_400 - 43_230


def _keys(tmp_path: Path, fields: str) -> str:
    path = tmp_path / "keys"
    path.write_text(f"{KEY} name=alpha {fields}\n")
    return str(path)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


async def _refused(url: str) -> tuple[int, str | None, dict[str, Any]]:
    """A handshake's status, Retry-After and JSON body (none for 101: it was admitted)."""
    http_url = url.replace("ws://", "http://")
    headers = {
        **_auth(),
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    async with aiohttp.ClientSession() as http, http.get(http_url, headers=headers) as resp:
        body = {} if resp.status == 101 else await resp.json()
        return resp.status, resp.headers.get("Retry-After"), body


async def _metric(proxy: Any, series: str) -> float:
    """One sample of the sidecar's /metrics, named exactly (labels included)."""
    for line in (await _metric_text(proxy)).splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == series:
            return float(value)
    raise AssertionError(f"no sample {series}")


async def _start(simulator: Any, sidecar: Any, keys_file: str, **overrides: Any) -> Any:
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(
        upstream=sim.ws_url, api_keys_file=keys_file, quota_check_interval=0.05, **overrides
    )
    proxy.sidecar.state.quota._wall = lambda: PINNED
    return proxy


async def test_max_sessions_refuses_the_next_with_429_until_one_ends(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    proxy = await _start(simulator, sidecar, _keys(tmp_path, "max_sessions=1"))
    async with connect(proxy.url, headers=_auth()) as first:
        await first.send({"type": "session.update", "session": {"modalities": ["audio"]}})
        await first.recv_until("session.updated")
        status, retry, body = await _refused(proxy.url)
        assert (status, retry) == (429, "1")
        assert body["status"] == "rejected"
        assert body["reason"] == body["error"]["code"] == "quota_exceeded"
        assert (body["quota"], body["limit"], body["retry_after"]) == ("max_sessions", 1, 1)
    series = 'omni_sidecar_quota_rejections_total{key="alpha",quota="max_sessions"}'
    assert await _metric(proxy, series) == 1
    assert KEY not in (await _metric_text(proxy))

    async def admitted() -> bool:
        try:
            async with connect(proxy.url, headers=_auth()):
                return True
        except aiohttp.WSServerHandshakeError:
            return False

    await wait_until(admitted, what="a session admitted once the first ended")


async def _metric_text(proxy: Any) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.admin_url}/metrics") as resp:
        return await resp.text()


async def test_sessions_per_minute_refuses_until_the_next_minute(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    proxy = await _start(simulator, sidecar, _keys(tmp_path, "sessions_per_minute=2"))
    for _ in range(2):
        async with connect(proxy.url, headers=_auth()):
            pass
    status, retry, body = await _refused(proxy.url)
    assert (status, retry, body["quota"]) == (429, str(TO_NEXT_MINUTE), "sessions_per_minute")
    # The next minute admits again.
    proxy.sidecar.state.quota._wall = lambda: PINNED + TO_NEXT_MINUTE
    async with connect(proxy.url, headers=_auth()):
        pass


async def test_day_audio_quota_ends_a_running_session_then_refuses_until_midnight(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    # 0.5 s a day; the client sends 1 s of input (input counts, docs/design.md, Quotas).
    proxy = await _start(
        simulator, sidecar, _keys(tmp_path, "audio_seconds_per_day=0.5"), max_input_audio_rate=0
    )
    async with connect(proxy.url, headers=_auth()) as client:
        await client.send({"type": "session.update", "session": {"modalities": ["audio"]}})
        for _ in range(10):
            await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
        events = await client.recv_until_closed()
    errors = [e for e in events if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["quota_exceeded"]
    assert errors[0]["error"]["type"] == "rate_limit_error"
    closed = [e for e in events if e["type"] == "session.closed"]
    assert closed and closed[-1]["reason"] == "quota_exceeded"
    assert client.close_code == 1008
    status, retry, body = await _refused(proxy.url)
    assert (status, retry, body["quota"]) == (429, str(TO_MIDNIGHT), "audio_seconds_per_day")
    assert await _metric(proxy, 'omni_sidecar_quota_sessions_ended_total{key="alpha"}') == 1
    # The next UTC day starts from 0.
    proxy.sidecar.state.quota._wall = lambda: PINNED + TO_MIDNIGHT
    async with connect(proxy.url, headers=_auth()):
        pass


#: One second of 16 kHz pcm16 (32,000 bytes), base64; as mu-law it is 4 s at 8 kHz.
ONE_SECOND_PCM16 = base64.b64encode(bytes(32_000)).decode()


@pytest.mark.parametrize(
    ("update", "append_fields"),
    [
        # The engine refuses this rate: appends stay 16 kHz pcm16, never "0 s".
        ({"input_audio_format": "pcm16", "sample_rate_hz": 2_000_000_000}, {}),
        # Per-append mu-law: the engine hears each byte as a sample at 8 kHz (4x pcm16).
        ({}, {"format": "g711_ulaw"}),
    ],
    ids=["lying_session_update", "per_append_format"],
)
async def test_audio_cannot_be_made_cheaper_than_the_engine_counts_it(
    simulator: Any,
    sidecar: Any,
    tmp_path: Path,
    update: dict[str, Any],
    append_fields: dict[str, Any],
) -> None:
    # docs/design.md, Usage: 5 s of audio under a 2 s day quota ends the session.
    proxy = await _start(
        simulator, sidecar, _keys(tmp_path, "audio_seconds_per_day=2"), max_input_audio_rate=0
    )
    async with connect(proxy.url, headers=_auth()) as client:
        await client.send(
            {"type": "session.update", "session": {"modalities": ["audio"], **update}}
        )
        chunk = {"type": "input_audio_buffer.append", "audio": ONE_SECOND_PCM16, **append_fields}
        for _ in range(5 if not append_fields else 1):  # 5 s, or 4 s of mu-law
            await client.send(chunk)
        events = await client.recv_until_closed()  # (read as 16 kHz pcm16: 1 s, never closed)
    assert [e["error"]["code"] for e in events if e["type"] == "error"][-1] == "quota_exceeded"
    assert client.close_code == 1008


def test_a_quota_without_a_name_is_a_config_error(tmp_path: Path) -> None:
    from proxy.edge.auth import load_key_file
    from proxy.errors import ConfigError

    path = tmp_path / "keys"
    path.write_text(f"{KEY} max_sessions=2\n")
    with pytest.raises(ConfigError, match="line 1: a quota needs name=NAME") as caught:
        load_key_file((), str(path))
    assert KEY not in str(caught.value)


async def test_sighup_applies_new_quotas_and_the_open_count_carries_over(
    simulator: Any, tmp_path: Path
) -> None:
    sim = await simulator("--realtime-factor", "0")
    keys = _keys(tmp_path, "max_sessions=1")
    with serve(tmp_path, sim.ws_url, "--api-keys-file", keys) as child:
        await ready(child)
        ws = f"ws://127.0.0.1:{child.port}/v1/realtime"
        async with connect(ws, headers=_auth()) as first:
            await first.send({"type": "session.update", "session": {"modalities": ["audio"]}})
            await first.recv_until("session.updated")
            assert (await _refused(ws))[0] == 429
            Path(keys).write_text(f"{KEY} name=alpha max_sessions=2\n")
            child.proc.send_signal(signal.SIGHUP)
            await wait_until(
                lambda: "config reloaded" in child.log(), timeout=DEADLINE, what="reload"
            )
            async with connect(ws, headers=_auth()):
                # The first session still counts: 2 open, the third is refused.
                status, _, body = await _refused(ws)
                assert (status, body["quota"], body["limit"]) == (429, "max_sessions", 2)


async def test_the_day_quota_counts_input_forwarded_plus_output_delivered_not_generated(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    """docs/design.md, Quotas: ``audio_seconds_per_day`` counts the client's audio
    forwarded to the engine plus the engine's audio written to the client
    (``audio_in_seconds + audio_delivered_seconds`` of the usage record), not what
    the engine generated. Paced playback holds a 5 s answer back and a cancel drops
    most of it: generated (``audio_out_seconds``) is then far more than delivered."""
    from tests.integration.test_metrics import admin_json

    sim = await simulator("--realtime-factor", "0", "--response-seconds", "5")
    usage_file = tmp_path / "usage.jsonl"
    proxy = await sidecar(
        upstream=sim.ws_url,
        api_keys_file=_keys(tmp_path, "audio_seconds_per_day=1000"),
        quota_check_interval=0.05,
        max_input_audio_rate=0,
        playback_pacing=True,
        usage_file=str(usage_file),
    )
    proxy.sidecar.state.quota._wall = lambda: PINNED
    async with connect(proxy.url, headers=_auth()) as client:
        await client.send({"type": "session.update", "session": {"modalities": ["audio"]}})
        for _ in range(10):
            await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
        await client.send({"type": "input_audio_buffer.commit"})
        await client.send({"type": "response.create"})
        await client.recv_until("response.output_audio.delta")
        await client.send({"type": "response.cancel"})
        await client.recv_until("response.done")
    await wait_until(lambda: usage_file.exists() and bool(usage_file.read_bytes()), what="a record")
    (record,) = [orjson.loads(line) for line in usage_file.read_bytes().splitlines()]
    summary = await admin_json(proxy, "/debug/summary")
    (alpha,) = summary["quota"]["keys"]
    counted = alpha["audio_seconds_today"]
    delivered = record["audio_in_seconds"] + record["audio_delivered_seconds"]
    generated = record["audio_in_seconds"] + record["audio_out_seconds"]
    print(
        f"\nday quota counted {counted} s: in + delivered {delivered:.3f}, in + out {generated:.3f}"
    )
    assert record["audio_out_seconds"] >= record["audio_delivered_seconds"] + 2.0, record
    assert counted == pytest.approx(delivered, abs=0.002)
