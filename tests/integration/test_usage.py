"""Usage per session and per API key name, through a real sidecar (docs/design.md, Usage).

What a peer can observe: the session's access line, the usage file's JSON
lines, the ``omni_sidecar_usage_*`` series on ``/metrics``, against what the
client itself sent and received. The keys themselves appear in none of them.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from engine_launcher.simulator.flags import DEFAULT_SAMPLE_RATE
from tests.conftest import wait_until
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.helpers import AUDIO_DELTA, SILENCE_100MS, Client, connect

KEY_ALPHA = "sk-usage-ALPHA-1f0c77"
KEY_BETA = "sk-usage-BETA-90ab31"
KEY_PLAIN = "sk-usage-PLAIN-4d2e08"
SECRETS = (KEY_ALPHA, KEY_BETA, KEY_PLAIN)
#: 100 ms of pcm16 at 16 kHz, the default input format.
APPEND_SECONDS = 0.1


def _access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [vars(r) for r in caplog.records if r.name == "omni_sidecar.access"]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def _one_response(client: Client, appends: int) -> float:
    """Append ``appends`` x 100 ms, get one response, close; the audio seconds received."""
    await client.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    for _ in range(appends):
        await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
    await client.send({"type": "input_audio_buffer.commit"})
    await client.send({"type": "response.create"})
    await client.recv_until("response.done")
    await client.send({"type": "session.close"})
    await client.recv_until_closed()
    decoded = sum(
        len(base64.b64decode(e["delta"])) for e in client.events if e["type"] == AUDIO_DELTA
    )
    return decoded / 2 / DEFAULT_SAMPLE_RATE


def _chunk_seconds(client: Client) -> float:
    """The longest audio delta the client got, in seconds: the tolerance of one chunk."""
    sizes = [len(e["delta"]) * 3 / 4 for e in client.events if e["type"] == AUDIO_DELTA]
    return max(sizes) / 2 / DEFAULT_SAMPLE_RATE


async def test_a_sessions_record_matches_what_the_client_sent_and_received(
    simulator: Any, sidecar: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await simulator("--realtime-factor", "0")
    usage_file = tmp_path / "usage.jsonl"
    proxy = await sidecar(upstream=sim.ws_url, usage_file=str(usage_file))
    caplog.set_level(logging.INFO, logger="omni_sidecar.access")
    async with connect(proxy.url) as client:
        received = await _one_response(client, appends=7)
    await wait_until(lambda: len(_lines(usage_file)) == 1, what="the usage line")
    (line,) = _lines(usage_file)
    (access,) = _access_records(caplog)
    chunk = _chunk_seconds(client)
    assert received > 0
    assert line["key"] == access["key"] == "unnamed"
    assert line["session"] == access["session"]
    assert line["audio_in_seconds"] == pytest.approx(7 * APPEND_SECONDS, abs=1e-3)
    assert abs(line["audio_delivered_seconds"] - received) <= chunk
    # Nothing was cancelled or dropped: all the engine made was delivered.
    assert line["audio_out_seconds"] == pytest.approx(line["audio_delivered_seconds"], abs=1e-3)
    assert 0 <= line["audio_heard_seconds"] <= line["audio_delivered_seconds"]
    assert (line["responses_started"], line["responses_completed"]) == (1, 1)
    assert line["session_seconds"] == pytest.approx(access["duration_s"], abs=0.01)
    for name in ("audio_in_seconds", "audio_delivered_seconds", "responses_completed"):
        assert access[name] == line[name], name
    labels = {"key": "unnamed", "direction": "in"}
    assert proxy.metric("omni_sidecar_usage_audio_seconds_total", labels) == pytest.approx(
        line["audio_in_seconds"], abs=1e-3
    )


async def test_engine_token_usage_is_summed_per_session(
    sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await ScriptedEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url)
        caplog.set_level(logging.INFO, logger="omni_sidecar.access")
        async with connect(proxy.url) as client:
            await client.send({"type": "response.create"})
            conn = await engine.next_connection()
            for rid, tokens in (("r1", (10, 20)), ("r2", (5, 7))):
                usage = {
                    "input_tokens": tokens[0],
                    "output_tokens": tokens[1],
                    "total_tokens": sum(tokens),
                }
                await conn.send({"type": "response.created", "response": {"id": rid}})
                await conn.send(
                    {
                        "type": "response.done",
                        "response": {"id": rid, "status": "completed", "usage": usage},
                    }
                )
                await client.recv_until("response.done")
        await wait_until(lambda: bool(_access_records(caplog)), what="the access line")
        (access,) = _access_records(caplog)
        assert (access["input_tokens"], access["output_tokens"], access["total_tokens"]) == (
            15,
            27,
            42,
        )
        for kind, value in (("input", 15), ("output", 27)):
            labels = {"key": "unnamed", "kind": kind}
            assert proxy.metric("omni_sidecar_usage_tokens_total", labels) == value
    finally:
        await engine.aclose()


async def test_usage_per_key_name_two_named_one_unnamed_and_no_key_anywhere(
    simulator: Any, sidecar: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await simulator("--realtime-factor", "0")
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_ALPHA} name=alpha\n{KEY_BETA} name=beta  # ops\n{KEY_PLAIN}\n")
    usage_file = tmp_path / "usage.jsonl"
    proxy = await sidecar(upstream=sim.ws_url, api_keys_file=str(keys), usage_file=str(usage_file))
    caplog.set_level(logging.DEBUG)
    plan = ((KEY_ALPHA, "alpha", 3), (KEY_ALPHA, "alpha", 2), (KEY_BETA, "beta", 4))
    plan += ((KEY_PLAIN, "unnamed", 1),)
    for key, _name, appends in plan:
        async with connect(proxy.url, headers={"Authorization": f"Bearer {key}"}) as client:
            await _one_response(client, appends)
    await wait_until(lambda: len(_lines(usage_file)) == len(plan), what="four usage lines")
    expected = {"alpha": (2, 0.5), "beta": (1, 0.4), "unnamed": (1, 0.1)}
    for name, (sessions, seconds) in expected.items():
        assert proxy.metric("omni_sidecar_usage_sessions_total", {"key": name}) == sessions
        labels = {"key": name, "direction": "in"}
        assert proxy.metric("omni_sidecar_usage_audio_seconds_total", labels) == pytest.approx(
            seconds, abs=1e-3
        )
        completed = {"key": name, "outcome": "completed"}
        assert proxy.metric("omni_sidecar_usage_responses_total", completed) == sessions
        delivered = {"key": name, "direction": "delivered"}
        assert proxy.metric("omni_sidecar_usage_audio_seconds_total", delivered) > 0
    assert [line["key"] for line in _lines(usage_file)] == [name for _k, name, _a in plan]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.admin_url}/metrics") as response:
            exposition = await response.text()
        async with http.get(f"{proxy.admin_url}/debug/summary") as response:
            console = await response.json()
    assert 'omni_sidecar_usage_sessions_total{key="alpha"} 2.0' in exposition
    assert [row["key"] for row in console["usage"]] == ["alpha", "beta", "unnamed"]
    logged = "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)
    for secret in SECRETS:
        assert secret not in exposition
        assert secret not in logged
        assert secret not in usage_file.read_text()
        assert secret not in orjson.dumps(console).decode()


async def test_the_usage_file_rotates_within_its_bound(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    sim = await simulator("--realtime-factor", "0")
    usage_file = tmp_path / "usage.jsonl"
    proxy = await sidecar(
        upstream=sim.ws_url,
        usage_file=str(usage_file),
        usage_file_max_bytes=4096,
        usage_file_backups=2,
    )
    sessions = 40  # ~450 bytes a record: about 4 files' worth
    for _ in range(sessions):
        async with connect(proxy.url) as client:
            await client.send({"type": "session.close"})
            await client.recv_until_closed()

    def written() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for suffix in (".2", ".1", ""):
            out += _lines(Path(f"{usage_file}{suffix}"))
        return out

    await wait_until(
        lambda: proxy.metric("omni_sidecar_usage_sessions_total", {"key": "unnamed"}) == sessions,
        what="every session counted",
    )
    await proxy.stop()  # the writer flushes what is queued and stops
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("usage.jsonl"))
    assert files == ["usage.jsonl", "usage.jsonl.1", "usage.jsonl.2"]
    for name in files:
        assert 0 < (tmp_path / name).stat().st_size <= 4096, name
    kept = written()
    # The newest records are kept, in order, and the oldest rotated away.
    assert sessions / 4 <= len(kept) < sessions
    assert [r["ts"] for r in kept] == sorted(r["ts"] for r in kept)
    assert proxy.metric("omni_sidecar_usage_records_dropped_total") == 0
