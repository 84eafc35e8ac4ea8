"""Cancellation end to end (issue "backpressure core", docs/design.md, Cancellation).

The simulator reproduces the released engines' flaw: after a cancel it still
sends ``--late-audio-chunks`` audio deltas of the cancelled response before its
``response.done`` (cancelled). Played at real-time pace, a cancel sent right
after an audio delta lands in the gap before the next one, so "audio of the
cancelled response read after the cancel was sent" is exactly the late audio:
the proxy must make it zero, while the same script straight against the
simulator shows it (that is what makes these tests able to fail).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.probe import ProbeOptions, run_probe
from tests.conftest import DEADLINE
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.helpers import (
    AUDIO_DELTA,
    RESPONSE_TAIL,
    TRANSCRIPT_DELTA,
    Cancelled,
    SimulatorChild,
    Trigger,
    cancel_mid_response,
    connect,
    module_simulator,
    pcm16_b64,
    request_response,
    rid_of,
    run_cli,
)

Event = dict[str, Any]

#: 6 chunks of 200 ms, one every 200 ms; 3 late chunks after a cancel.
CHUNKS = 6


@pytest.fixture(scope="module")
def paced_sim() -> Iterator[SimulatorChild]:
    with module_simulator(
        "--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "1.2",
        "--late-audio-chunks", "3",
    ) as sim:  # fmt: skip
        yield sim


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


def assert_terminal_sequence(run: Cancelled, *, reason: str, cleared: bool = False) -> None:
    """Transcripts and the engine's terminal events arrive, in order, without the audio."""
    rid = run.response_id
    assert run.audio_after() == []
    after = [
        e for e in run.after
        if e["type"] not in (TRANSCRIPT_DELTA, "input_audio_buffer.cleared")
    ]  # fmt: skip
    expected = (["output_audio_buffer.cleared"] if cleared else []) + RESPONSE_TAIL
    assert [e["type"] for e in after] == expected
    done = run.done()
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == reason
    # Every transcript delta came through (the late ones included), before audio.done.
    everything = run.before + run.after
    transcripts = [
        e["delta"] for e in everything if e["type"] == TRANSCRIPT_DELTA and rid_of(e) == rid
    ]
    audio = [e for e in everything if e["type"] == AUDIO_DELTA and rid_of(e) == rid]
    transcript_done = next(
        e for e in run.after if e["type"] == "response.output_audio_transcript.done"
    )
    assert transcript_done["transcript"] == "".join(transcripts)
    assert len(transcripts) > len(audio), "the late chunks' transcripts must pass"
    audio_done_at = next(
        i for i, e in enumerate(run.after) if e["type"] == "response.output_audio.done"
    )
    assert all(e["type"] != TRANSCRIPT_DELTA for e in run.after[audio_done_at:])


async def test_cancel_mid_response_drops_late_audio_and_next_response_plays_in_full(
    paced_sim, sidecar
) -> None:
    def cancel(rid: str) -> Event:
        return {"type": "response.cancel", "response_id": rid}

    # Straight to the simulator: the late audio arrives after the cancel.
    async with connect(paced_sim.ws_url) as client:
        direct = await cancel_mid_response(client, cancel)
    assert len(direct.audio_after()) >= 1, "the simulator no longer shows late audio"

    proxy = await sidecar(upstream=paced_sim.ws_url)
    async with connect(proxy.url) as client:
        proxied = await cancel_mid_response(client, cancel)
        assert_terminal_sequence(proxied, reason="client_cancelled")
        # The proxy dropped what the client did not hear; the rest is identical.
        assert [e["type"] for e in proxied.after] == [
            e["type"] for e in direct.after if e not in direct.audio_after()
        ]

        # The next response is untouched by the cancel: every chunk, completed.
        mark = client.mark()
        await request_response(client)
        created = await client.recv_until("response.created")
        rid2 = rid_of(created)
        done = await client.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid2)
        assert done["response"]["status"] == "completed"
        audio = [e for e in client.events[mark:] if e["type"] == AUDIO_DELTA]
        assert len(audio) == CHUNKS
        assert {rid_of(e) for e in audio} == {rid2}

    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) >= len(
        direct.audio_after()
    )
    assert proxy.metric("omni_sidecar_cancel_to_silence_seconds_count") == 1


_TRIGGERS: dict[str, tuple[Trigger, str, bool]] = {
    # name: (client event, expected status_details.reason, output_audio_buffer.cleared first)
    "response.cancel-with-id": (
        lambda rid: {"type": "response.cancel", "response_id": rid}, "client_cancelled", False,
    ),
    "response.cancel-without-id": (
        lambda rid: {"type": "response.cancel"}, "client_cancelled", False,
    ),
    "output_audio_buffer.clear": (
        lambda rid: {"type": "output_audio_buffer.clear"}, "output_audio_buffer_clear", True,
    ),
    "barge_in": (lambda rid: {"type": "barge_in"}, "barge_in", False),
    "turn.signal-barge_in": (
        lambda rid: {"type": "turn.signal", "event": "barge_in"}, "barge_in", False,
    ),
    "input.cancel": (lambda rid: {"type": "input.cancel"}, "barge_in", False),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_TRIGGERS))
async def test_each_client_cancel_trigger_silences_the_response(
    paced_sim, sidecar, name: str
) -> None:
    trigger, reason, cleared = _TRIGGERS[name]
    proxy = await sidecar(upstream=paced_sim.ws_url)
    async with connect(proxy.url) as client:
        run = await cancel_mid_response(client, trigger)
    assert_terminal_sequence(run, reason=reason, cleared=cleared)
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) >= 1


async def test_server_vad_barge_in_drops_the_late_audio(paced_sim, sidecar) -> None:
    """Loud input during a response: the engine barges in (speech_started,
    overlap.decision{barge_in}, late audio, cancelled done); the proxy acts on
    the overlap.decision, so no audio of that response follows it."""
    session = {"modalities": ["audio", "text"], "turn_detection": {"type": "server_vad"}}
    loud = {"type": "input_audio_buffer.append", "audio": pcm16_b64(100, amplitude=0.3)}

    def audio_after_decision(run: Cancelled) -> list[Event]:
        events = run.after
        at = next(i for i, e in enumerate(events) if e["type"] == "overlap.decision")
        assert events[at]["action"] == "barge_in"
        return [e for e in events[at:] if e["type"] == AUDIO_DELTA and rid_of(e) == run.response_id]

    async with connect(paced_sim.ws_url) as client:
        direct = await cancel_mid_response(client, lambda rid: loud, session=session)
    assert len(audio_after_decision(direct)) >= 1, "the simulator no longer shows late audio"

    proxy = await sidecar(upstream=paced_sim.ws_url)
    async with connect(proxy.url) as client:
        proxied = await cancel_mid_response(client, lambda rid: loud, session=session)
    assert audio_after_decision(proxied) == []
    assert proxied.done()["response"]["status_details"]["reason"] == "turn_detected"
    types = [e["type"] for e in proxied.after if e["type"] != TRANSCRIPT_DELTA]
    speech = types.index("input_audio_buffer.speech_started")
    assert types[speech : speech + 2] == ["input_audio_buffer.speech_started", "overlap.decision"]
    assert types[-len(RESPONSE_TAIL) :] == RESPONSE_TAIL


async def test_cancel_naming_an_older_response_leaves_the_newer_one_alone(engine, sidecar) -> None:
    # No acks or truncations on the client's behalf: the engine sees only the cancel.
    proxy = await sidecar(upstream=engine.ws_url, playback_ack="off")

    def created(rid: str) -> Event:
        return {"type": "response.created", "response_id": rid, "response": {"id": rid}}

    def audio(rid: str, n: int) -> Event:
        return {"type": AUDIO_DELTA, "response_id": rid, "delta": "AAAA" * 64, "n": n}

    def done(rid: str) -> Event:
        return {
            "type": "response.done",
            "response_id": rid,
            "response": {"id": rid, "status": "completed"},
        }

    async with connect(proxy.url) as client:
        conn = await engine.next_connection()
        await conn.send_all([created("r1"), audio("r1", 0), done("r1")])
        await client.recv_until("response.done")
        await conn.send_all([created("r2"), audio("r2", 0)])
        await client.recv_until(AUDIO_DELTA)
        await client.send({"type": "response.cancel", "response_id": "r1"})
        # The cancel went upstream untouched: the proxy has acted on it by now.
        assert await conn.receive_event() == {"type": "response.cancel", "response_id": "r1"}
        await conn.send_all([audio("r2", 1), audio("r2", 2), done("r2")])
        await client.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == "r2")
    r2_audio = [e["n"] for e in client.events if e["type"] == AUDIO_DELTA and rid_of(e) == "r2"]
    assert r2_audio == [0, 1, 2]
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) == 0
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "cancelled_audio"}) == 0


# -- the probe ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe_sim() -> Iterator[SimulatorChild]:
    """12 chunks of 250 ms, 100 ms apart: a 1500 ms cancel lands 0.6 s in."""
    with module_simulator(
        "--chunk-ms", "250", "--realtime-factor", "0.4", "--response-seconds", "3",
        "--late-audio-chunks", "3",
    ) as sim:  # fmt: skip
        yield sim


async def test_probe_reports_no_stale_audio_through_the_sidecar(probe_sim, sidecar) -> None:
    def options(url: str) -> ProbeOptions:
        return ProbeOptions(
            url=url, cancel_after_ms=1500, realtime=False, input_seconds=0.2, timeout=DEADLINE
        )

    direct = await run_probe(options(probe_sim.ws_url))
    assert direct.completed
    assert direct.stale_audio_frames > 0, "the simulator no longer shows late audio"

    proxy = await sidecar(upstream=probe_sim.ws_url)
    proxied = await run_probe(options(proxy.url))
    assert proxied.completed
    assert proxied.response_statuses == ["cancelled"]
    assert proxied.stale_audio_frames == 0
    assert proxied.stale_audio_seconds == 0.0
    assert proxied.session_closed_reason == "client_close"


async def test_probe_cli_with_cancel_through_the_sidecar(probe_sim, sidecar) -> None:
    proxy = await sidecar(upstream=probe_sim.ws_url)
    rc, out, err = await run_cli(
        "probe", proxy.url, "--cancel-after-ms", "1500", "--json", "--no-realtime",
        "--input-seconds", "0.2",
    )  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert result["completed"] is True
    assert result["response_statuses"] == ["cancelled"]
    assert result["stale_audio_frames"] == 0
    assert result["audio_frames"] >= 6  # 1500 ms of 250 ms chunks before the cancel


async def test_cancel_racing_the_create_leaks_no_audio(simulator, sidecar) -> None:
    """``response.cancel`` without an id, sent right behind ``response.create``
    (before the engine's ``response.created`` passed the proxy): the engine still
    creates, cancels and sends its late audio; none of it reaches the client."""
    sim = await simulator(
        "--chunk-ms",
        "200",
        "--realtime-factor",
        "0",
        "--late-audio-chunks",
        "3",
        "--response-seconds",
        "2",
    )

    async def run(url: str) -> list[str]:
        types: list[str] = []
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
            await ws.send_str('{"type":"session.update","session":{}}')
            await ws.send_str('{"type":"input_audio_buffer.append","audio":"AAAAAAAAAAAA"}')
            await ws.send_str('{"type":"input_audio_buffer.commit"}')
            await ws.send_str('{"type":"response.create"}')
            await ws.send_str('{"type":"response.cancel"}')
            async with asyncio.timeout(DEADLINE):
                while "response.done" not in types:
                    msg = await ws.receive()
                    assert msg.type is aiohttp.WSMsgType.TEXT, msg
                    types.append(orjson.loads(msg.data)["type"])
        return types

    direct = await run(sim.ws_url)
    assert "response.output_audio.delta" in direct  # the engine's flaw is real
    proxy = await sidecar(upstream=sim.ws_url)
    proxied = await run(proxy.url)
    assert "response.created" in proxied
    assert "response.output_audio.delta" not in proxied
