"""vLLM-Omni's own ``DuplexClient`` (from the vllm-omni 0.30.0 wheel) through the sidecar.

``vllm_omni.clients.duplex.DuplexClient`` is the client vLLM-Omni ships for
its duplex endpoint: it connects to ``/v1/realtime?duplex=1&model=…&autostart=0``,
opens with ``session.update`` and waits for ``session.created``, streams PCM,
commits (``extra_body.auto_response``), demultiplexes responses into
``ResponseHandle`` objects, acknowledges every sequenced event with
``session.event_ack`` and ends with ``session.close`` → ``session.closed``.
It is loaded from the wheel at test time (see ``vllm_omni_wheel``); its
transport is wrapped only to record the frames in wire order.

Pace: 200 ms chunks every 200 ms, so a cancel sent after the first audio
chunk reaches the sidecar before the next chunk is produced; audio of the
cancelled response that the client receives after that is late audio.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.conftest import DEADLINE, TIMEOUT_FACTOR
from tests.integration.helpers import SimulatorChild, module_simulator

if TYPE_CHECKING:
    from tests.integration.vllm_omni_wheel import VllmOmni

#: The ``vllm_omni`` fixture (session scope: the wheel is fetched and loaded once).
pytest_plugins = ["tests.integration.vllm_omni_wheel"]

MODEL: Final = "omni-sim"
AUDIO_DELTA: Final = "response.output_audio.delta"
CHUNK_MS: Final = 200
CHUNKS: Final = 5
SIM_ARGS: Final = (
    "--model", MODEL, "--chunk-ms", str(CHUNK_MS), "--realtime-factor", f"{TIMEOUT_FACTOR:g}",
    "--response-seconds", str(CHUNKS * CHUNK_MS / 1000), "--late-audio-chunks", "3",
)  # fmt: skip


@pytest.fixture(scope="module")
def duplex_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*SIM_ARGS) as sim:
        yield sim


async def test_duplex_client_runs_a_whole_session_through_the_sidecar(
    vllm_omni: VllmOmni, duplex_sim: SimulatorChild, sidecar: Any
) -> None:
    from tests.integration.vllm_omni_wheel import run_duplex_session

    # Acks on the client's behalf are off here: the engine's answers to them would
    # be hidden from the client and leave server_event_seq gaps of their own (the
    # gap count below is the dropped late audio). Acks: tests/integration/test_playback.py.
    proxy = await sidecar(upstream=duplex_sim.ws_url, playback_ack="off")
    host, port = proxy.sidecar.bound["listen"]
    run = await run_duplex_session(
        vllm_omni.client,
        f"ws://{host}:{port}",
        model=MODEL,
        deadline=DEADLINE,
        audio_type=AUDIO_DELTA,
    )
    received = run.received()

    # Session open: the client's own session.update, answered by session.created.
    opening = run.sent()[0]
    assert opening["type"] == "session.update"
    assert opening["session"]["model"] == MODEL
    assert opening["session"]["extra_body"]["auto_response"] is True
    assert received[0]["type"] == "session.created"
    assert run.session_id == received[0]["session"]["id"]

    # Streamed audio and commits reached the engine.
    appends = [e for e in run.sent() if e["type"] == "input_audio_buffer.append"]
    assert len(appends) == 4 and all(e["sample_rate_hz"] == 16000 for e in appends)
    assert [e["type"] for e in received].count("input_audio_buffer.committed") == 2

    # The completed response, as ResponseHandle.audio() yielded it.
    assert run.statuses == ("completed", "cancelled")
    deltas = [
        e for e in received if e["type"] == AUDIO_DELTA and e["response_id"] == run.completed_id
    ]
    assert len(deltas) == CHUNKS
    assert run.completed_audio == b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert len(run.completed_audio) == CHUNKS * 2 * 24000 * CHUNK_MS // 1000
    done = next(
        e for e in received
        if e["type"] == "response.output_audio_transcript.done"
        and e["response_id"] == run.completed_id
    )  # fmt: skip
    assert run.completed_transcript == done["transcript"] != ""

    # cancel_response(): no audio of that response after the cancel went out.
    after = run.after_first_sent("response.cancel")
    stale = [e for e in after if e["type"] == AUDIO_DELTA and e["response_id"] == run.cancelled_id]
    assert stale == []
    terminal = next(e for e in after if e["type"] == "response.done")
    assert terminal["response_id"] == run.cancelled_id
    assert terminal["response"]["status_details"]["reason"] == "client_cancelled"
    dropped = proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"})
    assert dropped >= 1

    # Event acks: every sequenced event but the final session.closed was acked,
    # through the sidecar; the dropped late audio left exactly that many seq gaps.
    seqs = [e["server_event_seq"] for e in received if "server_event_seq" in e]
    acked = [e["server_event_seq"] for e in run.sent() if e["type"] == "session.event_ack"]
    assert acked == seqs[:-1]
    assert received[-1]["type"] == "session.closed"
    assert len(set(range(1, seqs[-1] + 1)) - set(seqs)) == dropped

    # Heartbeat, then session.close → session.closed and a normal close.
    assert "session.heartbeat_ack" in [e["type"] for e in received]
    assert run.sent()[-1]["type"] == "session.close"
    assert received[-1]["reason"] == "client_close"
    assert run.closed_expected and run.close_code == 1000


async def test_duplex_client_straight_to_the_simulator_sees_stale_audio(
    vllm_omni: VllmOmni, duplex_sim: SimulatorChild
) -> None:
    """Without the sidecar the same script reads late audio: the test above can fail."""
    from tests.integration.vllm_omni_wheel import run_duplex_session

    run = await run_duplex_session(
        vllm_omni.client, duplex_sim.ws_url, model=MODEL, deadline=DEADLINE, audio_type=AUDIO_DELTA
    )
    after = run.after_first_sent("response.cancel")
    stale = [e for e in after if e["type"] == AUDIO_DELTA and e["response_id"] == run.cancelled_id]
    assert len(stale) >= 1
    assert run.statuses == ("completed", "cancelled")
