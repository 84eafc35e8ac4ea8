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

The last test cuts the client's TCP connection to the simulator mid-response
(through a relay the test aborts) and lets the client's own ReconnectPolicy
resume the session with ``session.resume`` (docs/engine-protocol.md, Resume).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Self

import pytest

from tests.conftest import DEADLINE, TIMEOUT_FACTOR, free_port, wait_until
from tests.integration.helpers import (
    REPO_ROOT,
    SimulatorChild,
    module_simulator,
    pcm16_b64,
    sim_metric,
)

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


class CuttableRelay:
    """A TCP relay to one port that the test can cut: every socket aborted, no FIN, no close."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        await self._server.wait_closed()

    def cut(self) -> None:
        for writer in self._writers:
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(1 << 16):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(pipe(reader, up_writer))
            tg.create_task(pipe(up_reader, writer))


def _first_audio(event: dict[str, Any]) -> bool:
    return bool(event["type"] == AUDIO_DELTA)


class FirstConnectionCut:
    """A DuplexClient's ``connect``: its first connection goes through ``relay``, which is
    cut (mid-response) at the first event ``cut_at`` accepts; every event each way is
    recorded, in order, with the number of the connection it went on (1, 2, ...)."""

    def __init__(
        self, listen_port: int, cut_at: Callable[[dict[str, Any]], bool] = _first_audio
    ) -> None:
        self.listen_port = listen_port
        self.cut_at = cut_at
        self.relay: CuttableRelay | None = None
        self.received: list[tuple[int, dict[str, Any]]] = []
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.connections = 0
        #: Whether the relay was cut, and the connection that got ``session.resumed`` since.
        self.was_cut = False
        self.resumed_on: _RecordedConnection | None = None
        self._resumed = asyncio.Event()

    def cut_now(self) -> None:
        assert self.relay is not None
        self.was_cut = True
        self.relay.cut()

    async def wait_connected(self, client: Any) -> None:
        """Once the relay was cut: until the client has resumed on a new connection."""
        if self.was_cut:
            await asyncio.wait_for(self._resumed.wait(), DEADLINE)
            await wait_until(lambda: client._ws is self.resumed_on, what="the client resumed")

    async def connect(self, target: str) -> _RecordedConnection:
        import websockets

        assert self.relay is not None, "set .relay before the client connects"
        self.connections += 1
        if self.connections == 1:  # only the first connection goes through the relay
            target = target.replace(f":{self.listen_port}/", f":{self.relay.port}/")
        ws = await websockets.connect(target, max_size=64 << 20)
        return _RecordedConnection(self, ws, self.connections)


class _RecordedConnection:
    def __init__(self, cut: FirstConnectionCut, ws: Any, number: int) -> None:
        self.cut, self.ws, self.number = cut, ws, number

    async def send(self, data: str) -> None:
        self.cut.sent.append((self.number, json.loads(data)))
        await self.ws.send(data)

    async def recv(self) -> str | bytes:
        data = await self.ws.recv()
        if isinstance(data, str):
            event = json.loads(data)
            self.cut.received.append((self.number, event))
            if self.number == 1 and self.cut.cut_at(event):
                self.cut.cut_now()
            elif self.number > 1 and event["type"] == "session.resumed":
                self.cut.resumed_on = self
                self.cut._resumed.set()
        return data

    async def close(self) -> None:
        await self.ws.close()


async def test_duplex_client_resumes_when_its_connection_is_cut_mid_response(
    vllm_omni: VllmOmni, duplex_sim: SimulatorChild
) -> None:
    """The client's first TCP connection runs through a relay that is cut after the
    first audio delta; its ReconnectPolicy resumes straight to the simulator."""
    duplex = vllm_omni.client
    cut = FirstConnectionCut(duplex_sim.port)
    received, sent = cut.received, cut.sent

    tone = base64.b64decode(pcm16_b64(400, amplitude=0.3))
    async with CuttableRelay(duplex_sim.port) as cut.relay:
        client = duplex.DuplexClient(
            duplex_sim.ws_url.removesuffix("/v1/realtime"),
            model=MODEL,
            reconnect=duplex.ReconnectPolicy(max_attempts=5, backoff_s=(0.05, 0.2)),
            heartbeat_interval_s=None,
            connect=cut.connect,
        )
        async with asyncio.timeout(DEADLINE * 4), client:
            responses = client.responses()
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(DEADLINE):
                handle = await anext(responses)
                audio = b"".join([chunk async for chunk in handle.audio()])
                await handle.wait()
        assert client._closed_marker is not None and client._closed_marker.expected

    assert cut.connections == 2
    first = [e for n, e in received if n == 1]
    second = [e for n, e in received if n == 2]
    cursor = max(e["server_event_seq"] for e in first if "server_event_seq" in e)
    (resume,) = [e for n, e in sent if e["type"] == "session.resume"]
    assert resume["last_received_server_event_seq"] == cursor
    assert resume["session_id"] == first[0]["session"]["id"]
    assert second[0]["type"] == "session.resumed"
    assert AUDIO_DELTA in [e["type"] for e in second]  # the cut came mid-response
    # Every server_event_seq after the cut arrives exactly once, in order, none missing.
    after = [e["server_event_seq"] for e in second if "server_event_seq" in e]
    assert after == list(range(cursor + 1, cursor + 1 + len(after)))
    before = [e["server_event_seq"] for e in first if "server_event_seq" in e]
    assert before == list(range(1, cursor + 1))
    # The response completed, with all of its audio once.
    assert handle.done_event.raw["response"]["status"] == "completed"
    assert [e["type"] for e in second].count("response.done") == 1
    deltas = [e for _, e in received if e["type"] == AUDIO_DELTA]
    assert len(deltas) == CHUNKS
    assert audio == b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert second[-1]["type"] == "session.closed"
    assert await sim_metric(duplex_sim, "vllm_omni_sim_resumes_total") == 1


async def test_duplex_client_resumes_through_the_sidecar_when_its_connection_is_cut(
    vllm_omni: VllmOmni, duplex_sim: SimulatorChild, sidecar: Any
) -> None:
    """The client, unmodified and with its default ReconnectPolicy, talks to the
    sidecar; its first TCP connection is cut (no FIN, no close) after the first
    audio delta of its second response, the first having been cancelled. The
    sidecar holds the session, the client resumes with ``session.resume``, and
    the sidecar replays what it missed: every event after its cursor once, the
    response completes, and nothing of the cancelled response comes after."""
    proxy = await sidecar(upstream=duplex_sim.ws_url, playback_ack="off", client_resume_grace=30)
    host, port = proxy.sidecar.bound["listen"]
    engine_resumes = await sim_metric(duplex_sim, "vllm_omni_sim_resumes_total")
    duplex = vllm_omni.client
    cancelled: list[str] = []

    def second_response_audio(event: dict[str, Any]) -> bool:
        second = event.get("response_id") not in (None, *cancelled)
        return bool(event["type"] == AUDIO_DELTA and second and cancelled)

    cut = FirstConnectionCut(port, cut_at=second_response_audio)
    received, sent = cut.received, cut.sent

    tone = base64.b64decode(pcm16_b64(400, amplitude=0.3))
    async with CuttableRelay(port) as cut.relay:
        client = duplex.DuplexClient(
            f"ws://{host}:{port}", model=MODEL, heartbeat_interval_s=None, connect=cut.connect
        )
        async with asyncio.timeout(DEADLINE * 4), client:
            responses = client.responses()
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(DEADLINE):
                first = await anext(responses)
                await anext(first.audio())
                cancelled.append(first.response_id)
                await client.cancel_response()
                await first.wait(DEADLINE)
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(DEADLINE * 2):
                handle = await anext(responses)
                audio = b"".join([chunk async for chunk in handle.audio()])
                await handle.wait()
        assert client._closed_marker is not None and client._closed_marker.expected

    assert cut.connections == 2, "one cut, one resume"
    before = [e for n, e in received if n == 1]
    after = [e for n, e in received if n == 2]
    cursor = max(e["server_event_seq"] for e in before if "server_event_seq" in e)
    (resume,) = [e for n, e in sent if e["type"] == "session.resume"]
    assert resume["last_received_server_event_seq"] == cursor
    assert after[0]["type"] == "session.resumed"
    assert AUDIO_DELTA in [e["type"] for e in after], "the cut came mid-response"
    # Exactly once: every seq after the cut is new, in order; the only missing ones
    # are what the sidecar dropped on purpose (the cancelled response's late audio).
    seqs = [e["server_event_seq"] for _, e in received if "server_event_seq" in e]
    assert seqs == sorted(set(seqs)), "no event twice"
    assert min(e["server_event_seq"] for e in after if "server_event_seq" in e) > cursor
    dropped = sum(
        proxy.metric("omni_sidecar_dropped_events_total", {"reason": reason})
        for reason in ("late_audio", "cancelled_audio")
    )
    assert len(set(range(1, seqs[-1] + 1)) - set(seqs)) == dropped
    # The response completed with all its audio, once.
    assert handle.done_event.raw["response"]["status"] == "completed"
    deltas = [
        e
        for _, e in received
        if e["type"] == AUDIO_DELTA and e["response_id"] == handle.response_id
    ]
    assert len(deltas) == CHUNKS
    assert audio == b"".join(base64.b64decode(e["delta"]) for e in deltas)
    # Nothing of the cancelled response after its cancel went out, on either connection.
    assert [n for n, e in sent if e["type"] == "response.cancel"] == [1]
    late = [e for n, e in received if n == 2 and e.get("response_id") == cancelled[0]]
    assert not [e for e in late if e["type"] == AUDIO_DELTA]
    assert proxy.metric("omni_sidecar_dropped_events_total", {"reason": "late_audio"}) >= 1
    assert after[-1]["type"] == "session.closed"
    # The sidecar held and resumed it; the engine never saw the drop.
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 1
    assert await sim_metric(duplex_sim, "vllm_omni_sim_resumes_total") == engine_resumes


class _Call:
    """What a two-turn call knows as it goes: the cancelled first response, the second."""

    def __init__(self) -> None:
        self.cancelled: str | None = None
        self.second: str | None = None
        self.second_deltas = 0


def _moment(name: str, call: _Call) -> Callable[[dict[str, Any]], bool]:
    """The event (received on the first connection) at which ``name`` cuts it; the idle
    moment is cut by the script itself, between the turns."""

    def cut_at(event: dict[str, Any]) -> bool:
        kind, response = event["type"], event.get("response_id")
        if kind == AUDIO_DELTA and call.cancelled is not None and response != call.cancelled:
            call.second, call.second_deltas = response, call.second_deltas + 1
        if name == "before_response":  # turn 1 committed, its response not started yet
            return bool(kind == "input_audio_buffer.committed" and call.cancelled is None)
        if name == "right_after_cancel":  # the cancelled response's done, nothing after it
            return bool(kind == "response.done" and response == call.cancelled is not None)
        if name == "mid_response":
            return kind == AUDIO_DELTA and response == call.second and call.second_deltas == 2
        if name == "late_second_turn":  # its last audio: only the response's end is left
            return kind == AUDIO_DELTA and response == call.second and call.second_deltas == CHUNKS
        return False

    return cut_at


MOMENTS: Final = (
    "before_response",
    "right_after_cancel",
    "idle_between_turns",
    "mid_response",
    "late_second_turn",
)


@pytest.mark.parametrize("target", ["engine", "sidecar"])
@pytest.mark.parametrize("moment", MOMENTS)
async def test_duplex_client_cut_at_any_moment_of_a_call_resumes_with_every_event_once(
    vllm_omni: VllmOmni, duplex_sim: SimulatorChild, sidecar: Any, moment: str, target: str
) -> None:
    """The unmodified client (default ReconnectPolicy) makes a two-turn call: the first
    response is cancelled after its first audio, the second plays in full. Its TCP
    connection is cut (no FIN, no close frame) once, at ``moment``, and its
    ReconnectPolicy resumes. Through the sidecar it resumes at every moment it
    resumes at straight on the engine (docs/design.md, Resume): ``session.resumed``
    goes out the moment the session is reattached, even when nothing is queued
    (idle, right after a cancel), and every event reaches the client once."""
    if target == "sidecar":
        proxy = await sidecar(
            upstream=duplex_sim.ws_url, playback_ack="off", client_resume_grace=30
        )
        host, port = proxy.sidecar.bound["listen"]
        url = f"ws://{host}:{port}"
    else:
        proxy, port, url = None, duplex_sim.port, duplex_sim.ws_url.removesuffix("/v1/realtime")
    engine_resumes = await sim_metric(duplex_sim, "vllm_omni_sim_resumes_total")
    duplex = vllm_omni.client
    call = _Call()
    cut = FirstConnectionCut(port, cut_at=_moment(moment, call))
    received, sent = cut.received, cut.sent
    tone = base64.b64decode(pcm16_b64(400, amplitude=0.3))
    async with CuttableRelay(port) as cut.relay:
        # Only the handshake wait is shortened (a refusal shows in seconds, not 30 s).
        client = duplex.DuplexClient(
            url,
            model=MODEL,
            heartbeat_interval_s=None,
            handshake_timeout_s=DEADLINE,
            connect=cut.connect,
        )
        async with asyncio.timeout(DEADLINE * 6), client:
            responses = client.responses()
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            first = await asyncio.wait_for(anext(responses), DEADLINE * 2)
            await asyncio.wait_for(anext(first.audio()), DEADLINE * 2)
            call.cancelled = first.response_id
            await cut.wait_connected(client)
            await client.cancel_response()
            await first.wait(DEADLINE * 2)
            if moment == "idle_between_turns":
                # Nothing in flight either way: one heartbeat round trip, then the cut.
                await client.send({"type": "session.heartbeat"})
                await client.wait_for("session.heartbeat_ack", timeout_s=DEADLINE)
                cut.cut_now()
            await cut.wait_connected(client)
            await client.stream_pcm(tone, chunk_ms=200, realtime=False)
            await client.commit()
            handle = await asyncio.wait_for(anext(responses), DEADLINE * 2)
            audio = b"".join([chunk async for chunk in handle.audio()])
            await handle.wait(DEADLINE * 2)
            await cut.wait_connected(client)
        assert client._closed_marker is not None and client._closed_marker.expected

    assert cut.connections == 2, "one cut, one resume"
    before = [e for n, e in received if n == 1]
    after = [e for n, e in received if n == 2]
    cursor = max(e["server_event_seq"] for e in before if "server_event_seq" in e)
    (resume,) = [e for _, e in sent if e["type"] == "session.resume"]
    assert resume["last_received_server_event_seq"] == cursor
    assert after[0]["type"] == "session.resumed"
    # Every event once: seqs only grow, across both connections; the only missing
    # ones are what the sidecar dropped on purpose (the cancelled response's late audio).
    seqs = [e["server_event_seq"] for _, e in received if "server_event_seq" in e]
    assert seqs == sorted(set(seqs)), "no event twice"
    dropped = 0.0
    if proxy is not None:
        dropped = sum(
            proxy.metric("omni_sidecar_dropped_events_total", {"reason": reason})
            for reason in ("late_audio", "cancelled_audio")
        )
    assert len(set(range(1, seqs[-1] + 1)) - set(seqs)) == dropped
    assert first.done_event.raw["response"]["status"] in ("cancelled", "completed")
    assert handle.done_event.raw["response"]["status"] == "completed"
    deltas = [
        e
        for _, e in received
        if e["type"] == AUDIO_DELTA and e["response_id"] == handle.response_id
    ]
    assert len(deltas) == CHUNKS
    assert audio == b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert [e["type"] for _, e in received].count("session.closed") == 1
    assert after[-1]["type"] == "session.closed"
    resumes = await sim_metric(duplex_sim, "vllm_omni_sim_resumes_total") - engine_resumes
    if proxy is not None:  # the sidecar held and resumed it; the engine never saw the drop
        assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 1
        assert resumes == 0
    else:
        assert resumes == 1


async def _sidecar_metric(child: Any, name: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"{child.admin_url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
async def test_duplex_client_resumes_through_the_nginx_example_and_three_sidecars(
    vllm_omni: VllmOmni, tmp_path: Path
) -> None:
    """deploy/nginx/omni-sidecar-lb.conf (ports replaced, a third server line) in front
    of three sidecars, each with its own engine. The client's URL carries
    ``affinity``; its first connection (through a relay in front of nginx) is cut
    mid-response, and its resume, through nginx again, reaches the sidecar that
    holds the session: resumed there, every event after the cursor once."""
    from tests.children import SidecarChild
    from tests.integration.nginx_child import main_config, nginx

    flags = ("--playback-ack", "off", "--client-resume-grace", "30")
    sidecars = [
        SidecarChild(
            *flags,
            "--engine-simulator-args",
            " ".join(SIM_ARGS),
            log_path=tmp_path / f"serve-{n}.log",
            ready_timeout=3 * DEADLINE,
            stop_grace=DEADLINE,
        )
        for n in range(3)
    ]
    listen = free_port()
    text = (REPO_ROOT / "deploy" / "nginx" / "omni-sidecar-lb.conf").read_text()
    a, b, c = (s.port for s in sidecars)
    site = tmp_path / "omni-sidecar-lb.conf"
    site.write_text(
        text.replace("server 127.0.0.1:8001 ", f"server 127.0.0.1:{a} ")
        .replace(
            "server 127.0.0.1:8002 max_fails=0;",
            f"server 127.0.0.1:{b} max_fails=0;\n    server 127.0.0.1:{c} max_fails=0;",
        )
        .replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    )
    duplex = vllm_omni.client
    cut = FirstConnectionCut(listen)
    received = cut.received

    with contextlib.ExitStack() as children:
        for child in sidecars:
            children.enter_context(child)
        for child in sidecars:
            await child.ready()
        async with (
            nginx(tmp_path, main_config(tmp_path, site), port=listen, ready_path="/readyz"),
            CuttableRelay(listen) as cut.relay,
        ):
            client = duplex.DuplexClient(
                f"ws://127.0.0.1:{listen}/?affinity=call-7",
                model=MODEL,
                heartbeat_interval_s=None,
                connect=cut.connect,
            )
            tone = base64.b64decode(pcm16_b64(400, amplitude=0.3))
            async with asyncio.timeout(DEADLINE * 4), client:
                responses = client.responses()
                await client.stream_pcm(tone, chunk_ms=200, realtime=False)
                await client.commit()
                async with asyncio.timeout(DEADLINE * 2):
                    handle = await anext(responses)
                    await handle.wait()
            resumed = [
                await _sidecar_metric(s, 'omni_sidecar_resumes_total{result="resumed"}')
                for s in sidecars
            ]
    assert cut.connections == 2
    assert sorted(resumed) == [0.0, 0.0, 1.0], "resumed on the sidecar that held it"
    before = [e for n, e in received if n == 1]
    after = [e for n, e in received if n == 2]
    cursor = max(e["server_event_seq"] for e in before if "server_event_seq" in e)
    assert after[0]["type"] == "session.resumed"
    seqs = [e["server_event_seq"] for e in after if "server_event_seq" in e]
    assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), (cursor, seqs)
    assert handle.done_event.raw["response"]["status"] == "completed"
    assert len([e for _, e in received if e["type"] == AUDIO_DELTA]) == CHUNKS
