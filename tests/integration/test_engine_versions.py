"""The sidecar in front of each simulated engine release (``--engine-version``).

The same client scripts run through the sidecar against 0.30 (unbounded
output, late audio after a cancel), 0.31 (bounded output, queued audio of a
cancel removed) and 0.32 (as 0.31, plus real truncating acks, ``bad_event``
for truncating an item without audio, ack errors without ``event_id``). What
the client observes must not depend on the release: a cancel leaves no
stale audio, the sidecar's own acks never surface as errors, a stalled
client is closed by the sidecar (which keeps reading the engine, so a
0.31+ engine never overflows), and an engine's own overflow passes through.
docs/design.md, Simulator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import pytest

from engine_launcher.simulator.releases import ENGINE_VERSIONS, release_of
from proxy.settings import EngineConfig
from tests.conftest import DEADLINE, TIMEOUT_FACTOR
from tests.integration.helpers import (
    AUDIO_DELTA,
    Client,
    SimulatorChild,
    cancel_mid_response,
    connect,
    module_simulator,
    pcm16_b64,
    request_response,
    rid_of,
    sim_metric,
    wait_metric,
)
from tests.integration.test_relay_overflow import (
    SMALL_LIMITS,
    STALLED,
    assert_overflow_tail,
    overflows,
)

Event = dict[str, Any]

#: Every release the simulator plays; what each does is read from its row.
VERSIONS: Final = ENGINE_VERSIONS
#: 6 chunks of 200 ms at real-time pace (times the suite's slack factor), 3 late on 0.30.
CHUNKS: Final = 6
PACED_ARGS: Final = (
    "--chunk-ms", "200", "--realtime-factor", f"{TIMEOUT_FACTOR:g}", "--response-seconds", "1.2",
    "--late-audio-chunks", "3",
)  # fmt: skip


@pytest.fixture(scope="module", params=VERSIONS)
def paced_sim(request: pytest.FixtureRequest) -> Iterator[SimulatorChild]:
    with module_simulator(*PACED_ARGS, "--engine-version", request.param) as sim:
        sim.version = request.param  # type: ignore[attr-defined]
        yield sim


def _cancel(rid: str) -> Event:
    """A ``response.cancel`` without a response id (it cancels the one in progress)."""
    return {"type": "response.cancel"}


async def test_a_cancel_leaves_no_stale_audio_on_every_release(
    paced_sim: SimulatorChild, sidecar: Any
) -> None:
    version: str = paced_sim.version  # type: ignore[attr-defined]
    proxy = await sidecar(upstream=paced_sim.ws_url)
    async with connect(proxy.url) as c:
        run = await cancel_mid_response(c, _cancel)
        assert run.audio_after() == []
        done = next(e for e in run.after if e["type"] == "response.done")
        assert done["response"]["status"] == "cancelled"
        # The next response plays in full.
        mark = c.mark()
        await request_response(c)
        rid2 = rid_of(await c.recv_until("response.created"))
        done2 = await c.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid2)
        assert done2["response"]["status"] == "completed"
        assert len([e for e in c.events[mark:] if e["type"] == AUDIO_DELTA]) == CHUNKS
    assert "error" not in c.types()
    late = await sim_metric(paced_sim, "vllm_omni_sim_late_audio_events_total")
    # 0.30 sent late audio the sidecar had to drop; 0.31+ never produce any.
    assert (late == 0) if release_of(version).drops_cancelled_audio else (late > 0)


@pytest.fixture(
    scope="module",
    params=[
        *((v, False) for v in VERSIONS),
        (VERSIONS[-1], True),
    ],
    ids=lambda p: f"{p[0]}-{'item-truncate' if p[1] else 'ack-truncate'}",
)
def playback_sim(request: pytest.FixtureRequest) -> Iterator[SimulatorChild]:
    """Paced 4x faster than real time; each release with the sidecar truncating by
    ``playback.ack`` ``truncate: true``, and the newest also by ``conversation.item.truncate``."""
    version, truncate = request.param
    extra = ("--supports-audio-truncate",) if truncate else ()
    with module_simulator(
        "--chunk-ms", "200", "--realtime-factor", f"{TIMEOUT_FACTOR:g}",
        "--response-seconds", "1.2", "--generation-speed", "4",
        "--engine-version", version, *extra,
    ) as sim:  # fmt: skip
        sim.version = version  # type: ignore[attr-defined]
        yield sim


async def test_the_sidecars_acks_and_truncations_surface_no_error(
    playback_sim: SimulatorChild, sidecar: Any
) -> None:
    """A played turn (acked for the client), a cancel mid-reply (history truncated at the
    heard position) and a cancel before any audio: the client sees no ``error``."""
    proxy = await sidecar(upstream=playback_sim.ws_url)
    async with connect(proxy.url) as c:
        await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
        await request_response(c)
        await c.recv_until("rate_limits.updated")
        await cancel_mid_response(c, _cancel, open_session=False)
        await cancel_mid_response(c, _cancel, open_session=False, audio_before_cancel=0)
        # One more turn: anything the engine answered to the cancels has arrived by its end.
        await request_response(c)
        await c.recv_until("rate_limits.updated")
    assert [e for e in c.events if e["type"] == "error"] == []
    assert proxy.metric("omni_sidecar_playback_acks_total") >= 1
    # The cancels made the sidecar cut the engine's history (a truncating ack or
    # conversation.item.truncate): the path 0.32 answers differently was taken.
    assert proxy.metric("omni_sidecar_truncations_total", {"source": "sidecar"}) >= 1


async def test_a_user_turn_committed_while_the_reply_plays_surfaces_no_ack_error(
    playback_sim: SimulatorChild, sidecar: Any
) -> None:
    """Duplex: the user commits a turn while the reply still plays; the sidecar's next ack
    for that reply is then too late for the engine (``playback_ack_too_late``). The
    sidecar must keep that answer to its own ack from the client, also on 0.32, which
    sends it without the ack's event_id (matched by order: docs/design.md, Playback)."""
    proxy = await sidecar(upstream=playback_sim.ws_url)
    async with connect(proxy.url) as c:
        await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
        await request_response(c)
        await c.recv_until(AUDIO_DELTA)  # the reply plays; no ack has gone out yet
        await c.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(100)})
        await c.send({"type": "input_audio_buffer.commit"})
        await c.recv_until("rate_limits.updated")
        # One more reply: the engine's answers to the acks above have arrived by its end.
        await c.send({"type": "response.create"})
        await c.recv_until("rate_limits.updated")
    assert proxy.metric("omni_sidecar_playback_acks_total") >= 1
    assert [e for e in c.events if e["type"] == "error"] == []
    late = {"code": "playback_ack_too_late"}
    assert proxy.metric("omni_sidecar_engine_ack_errors_total", late) >= 1, "it was answered"


@pytest.fixture(scope="module", params=VERSIONS)
def flood_sim(request: pytest.FixtureRequest) -> Iterator[SimulatorChild]:
    """30 chunks of 1 s (about 64 KB each), one every 10 ms: 2 MB per reply."""
    with module_simulator(
        "--realtime-factor", "0.01", "--chunk-ms", "1000", "--response-seconds", "30",
        "--deterministic", "--engine-version", request.param,
    ) as sim:  # fmt: skip
        yield sim


async def test_a_stalled_client_is_closed_by_the_sidecar_not_the_engine(
    flood_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=flood_sim.ws_url, **SMALL_LIMITS)
    async with connect(proxy.url, **STALLED) as c:
        await request_response(c, open_session=True)
        await wait_metric(lambda: overflows(proxy, "close_session"), 1, what="sidecar overflow")
        events = await c.recv_until_closed()
        assert c.close_code == 1008
    assert_overflow_tail(events, rid_of(next(e for e in events if e["type"] == "response.created")))
    # The sidecar kept reading the engine: a bounded engine never overflowed.
    assert await sim_metric(flood_sim, "vllm_omni_sim_output_overflows_total") == 0


async def _ask_in_one_burst(c: Client) -> list[Event]:
    """Open, then one commit that also starts the response (11 events in one go); read to the close."""
    await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    await c.recv_until("session.updated")
    await c.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(100)})
    await c.send({"type": "input_audio_buffer.commit", "response_create": True})
    return await c.recv_until_closed()


def _comparable(event: Event) -> Event:
    return {k: v for k, v in event.items() if k not in ("event_id", "session_id")}


@pytest.mark.parametrize("version", [v for v in VERSIONS if release_of(v).bounded_output])
async def test_the_engines_own_overflow_passes_through_intact(
    simulator: Any, sidecar: Any, version: str
) -> None:
    """An engine bound of 8 events overflows in the commit's burst of 11 (the response's
    opening), however fast the sidecar reads: the client gets the engine's three events."""
    sim = await simulator(
        "--engine-version",
        version,
        "--max-pending-output-events",
        "8",
        "--realtime-factor",
        "0",
        "--deterministic",
    )
    async with connect(sim.ws_url) as direct:
        expected = await _ask_in_one_burst(direct)
    assert [e["type"] for e in expected[-3:]] == ["error", "response.done", "session.closed"]
    assert direct.close_code == 1000
    proxy = await sidecar(upstream=sim.ws_url, playback_ack="off")
    async with connect(proxy.url) as c:
        events = await _ask_in_one_burst(c)
    assert [_comparable(e) for e in events[-3:]] == [_comparable(e) for e in expected[-3:]]
    assert events[-3]["error"]["code"] == "output_backpressure"
    assert c.close_code is not None


async def test_a_launched_simulator_takes_its_version_from_engine_simulator_args(
    sidecar: Any,
) -> None:
    """``engine.simulator_args`` (env ``OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS``) carries the
    version to a simulator the sidecar launches itself: here 0.32 with a tiny engine bound."""
    flags = (
        "--engine-version",
        "0.32",
        "--max-pending-output-events",
        "8",
        "--realtime-factor",
        "0",
    )
    engine = EngineConfig(kind="simulator", simulator_args=flags, startup_timeout=3 * DEADLINE)
    proxy = await sidecar(engine=engine, playback_ack="off")
    async with connect(proxy.url) as c:
        events = await _ask_in_one_burst(c)
    assert [e["type"] for e in events[-3:]] == ["error", "response.done", "session.closed"]
    assert events[-3]["error"]["code"] == "output_backpressure"
