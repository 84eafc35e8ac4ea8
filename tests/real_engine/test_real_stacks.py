"""The voice stacks through the sidecar in front of vLLM-Omni's real serving layer (issue 39).

The same applications as tests/integration/test_livekit_agents.py and
test_pipecat.py, with the simulator replaced by vLLM-Omni's own router and
``OmniDuplexSessionHandler`` over the stand-in engine (``stand_in_engine.py``):
every event the stacks get comes from the engine's real Realtime projection,
through the sidecar. Two
output formats, as the simulator's profiles: PCM16 24 kHz in 200 ms packets
(MiniCPM-o-like) and 22.05 kHz in 80 ms packets (Nemotron-like), each packet
200 ms after the last.

LiveKit's call (two replies, the second interrupted by ``interrupt()`` and
``truncate()``) and Pipecat's reply (the user's audio, then the first context
frame; played to its end) run here. The Agents SDK's and Pipecat's barge-in
need the engine's server VAD, which the stand-in does not have.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

import pytest

pytest.importorskip(
    "vllm_omni.entrypoints",
    reason="needs vllm + vllm-omni: make test-real-engine [VLLM_OMNI=0.32.0rc1]",
)

from tests.conftest import TIMEOUT_FACTOR
from tests.integration.voice_stacks import SPEECH, Call, LibraryErrors, WireTap
from tests.real_engine.stand_in_engine import Pace, StandInEngine
from tests.real_engine.test_real_serving import _serving

pytestmark = pytest.mark.real_engine

REPLY_MS: Final = 1200
INTERVAL_S: Final = 0.2 * TIMEOUT_FACTOR
PACES: Final = {
    "pcm16-24k": Pace(chunk_ms=200, chunks=REPLY_MS // 200, interval_s=INTERVAL_S),
    "pcm16-22k": Pace(chunk_ms=80, chunks=REPLY_MS // 80, interval_s=INTERVAL_S, sample_rate=22050),
}


@pytest.fixture(params=sorted(PACES))
async def tap(request: pytest.FixtureRequest, sidecar: object) -> AsyncIterator[WireTap]:
    """The sidecar in front of the real serving layer, behind a recording relay."""
    async with _serving(StandInEngine(PACES[request.param])) as server:
        proxy = await sidecar(upstream=server.ws_url)  # type: ignore[operator]
        host, port = proxy.sidecar.bound["listen"]
        async with WireTap.running(f"ws://{host}:{port}") as relay:
            yield relay


async def test_livekit_agents_through_real_serving(tap: WireTap) -> None:
    pytest.importorskip("livekit.plugins.openai", reason="pip install -e '.[stacks]'")
    from tests.integration.test_livekit_agents import livekit_call

    call = await livekit_call(tap, reply_ms=REPLY_MS)
    call.assert_clean()


async def test_pipecat_reply_through_real_serving(tap: WireTap) -> None:
    pytest.importorskip("pipecat.services.openai.realtime.llm", reason="pip install -e '.[stacks]'")
    from tests.integration.test_pipecat import greeting, pipecat_app

    call = Call(tap, LibraryErrors("pipecat"), reply_ms=REPLY_MS)
    with call.errors.installed(), call.explained():
        async with pipecat_app(call) as app:
            await greeting(call, app, after=SPEECH)
    call.assert_clean()
