"""End-to-end smoke: a whole response through the sidecar, byte-identical to direct."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE
from tests.integration.helpers import assert_relayed_as_the_engine_wrote


async def _session_frames(url: str) -> list[str]:
    frames: list[str] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str('{"type":"session.update","session":{"modalities":["audio","text"]}}')
        await ws.send_str('{"type":"input_audio_buffer.append","audio":"AAAAAAAAAAAAAAAA"}')
        await ws.send_str('{"type":"input_audio_buffer.commit"}')
        await ws.send_str('{"type":"response.create"}')
        while True:
            msg = await ws.receive(timeout=DEADLINE)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            frames.append(msg.data)
            if orjson.loads(msg.data)["type"] == "rate_limits.updated":
                break
        await ws.send_str('{"type":"session.close"}')
        while True:
            msg = await ws.receive(timeout=DEADLINE)
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break
            frames.append(msg.data)
        assert ws.close_code == 1000
    return frames


@pytest.mark.parametrize("version", ["0.30", "0.31", "0.32"])
async def test_response_is_byte_identical_through_the_proxy(simulator, sidecar, version) -> None:
    """On every simulated engine release (``--engine-version``)."""
    sim = await simulator("--realtime-factor", "0", "--deterministic", "--engine-version", version)
    # Acks on the client's behalf would add engine answers (and server_event_seq
    # numbers) the sidecar then hides: this test is about the relay alone.
    proxy = await sidecar(upstream=sim.ws_url, playback_ack="off")
    direct = await _session_frames(sim.ws_url)
    proxied = await _session_frames(proxy.url)
    assert [orjson.loads(f)["type"] for f in direct][-1] == "session.closed"
    assert_relayed_as_the_engine_wrote(proxied, direct)
