"""Hostile input through a LIVE proxy, in both directions (issue "hardening").

Client side: hypothesis draws frames (random bytes, random text, random JSON,
event-shaped objects with wrong field types, deep nesting, strings up to the
size limit) and sends each one through one running sidecar, followed by a
sentinel. The upstream ``sink`` records what arrives and echoes only the
sentinel, so for every frame we know exactly what the engine got and what the
client was told in between. Property: a JSON object with a string ``type`` is
forwarded byte for byte and answered with nothing; anything else is not
forwarded and is answered with exactly one ``error`` event.

Meanwhile a healthy session runs real responses from the simulator through the
same sidecar (piped by the routing engine below) and checks that the
simulator's ``server_event_seq`` grows by one at every event: the fuzzing cost
it nothing. At the end the sidecar still runs, ``/healthz`` answers and the
process grew by a bounded amount of memory.

Upstream side: a hostile engine (``tests/fakes/stall_engine.py``) mixes
malformed frames with valid ones: the client receives exactly the valid ones,
in order, the rest is counted as ``invalid_upstream_frame``, and the session
survives.

Hypothesis runs in a worker thread and hands each example to the event loop
(``run_coroutine_threadsafe``), so one sidecar serves every example.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DEADLINE, wait_until
from tests.fakes.stall_engine import MALFORMED_UPSTREAM_FRAMES, HostileEngine
from tests.integration.helpers import SILENCE_100MS, Client, RawWebSocket, connect
from tests.integration.leakcheck import MIB, rss_bytes

pytestmark = pytest.mark.timeout(120)

Event = dict[str, Any]
KIB = 1024
LIMIT = 64 * KIB  # max_client_message_bytes of the fuzzed sidecar
CLIENT_EXAMPLES = 90
UPSTREAM_EXAMPLES = 25
#: Types that end the session: they are forwarded like any event, which would
#: end the fuzzing session; their handling is covered by the relay tests.
SESSION_ENDING = frozenset({"session.close", "close", "close_session"})
KNOWN_TYPES = [
    "response.cancel",
    "output_audio_buffer.clear",
    "barge_in",
    "turn.signal",
    "signal_turn",
    "input.cancel",
    "response.create",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "session.update",
    "session.event_ack",
    "session.heartbeat",
    "conversation.item.create",
]


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- the upstream side: a sink for fuzzed frames, a pipe for the healthy session --------------


def _sentinel(n: int) -> str:
    return f'{{"type":"x.sentinel","n":{n}}}'


class RoutingEngine:
    """``?role=healthy`` is piped to the simulator; any other session is a sink.

    The sink records every frame the proxy forwards (text as str, binary as
    bytes) and echoes sentinels back; it answers ``session.close`` like an engine.
    """

    def __init__(self, simulator_ws_url: str) -> None:
        self.simulator_ws_url = simulator_ws_url
        self.sink: asyncio.Queue[str | bytes] = asyncio.Queue()
        self.sinks = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    async def start(self) -> RoutingEngine:
        app = web.Application()
        app.router.add_get("/v1/realtime", self._websocket)
        app.router.add_get("/health", _health)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            async with asyncio.timeout(DEADLINE):
                await self._runner.cleanup()

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        if request.query.get("role") == "healthy":
            await self._pipe(ws)
        else:
            await self._sink(ws)
        return ws

    async def _sink(self, ws: web.WebSocketResponse) -> None:
        self.sinks += 1
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                self.sink.put_nowait(msg.data)
                if msg.data.startswith('{"type":"x.sentinel"'):
                    await ws.send_str(msg.data)
                elif msg.data.startswith('{"type":"session.close"'):
                    await ws.send_str('{"type":"session.closed","reason":"client_close"}')
                    await ws.close()
            elif msg.type is aiohttp.WSMsgType.BINARY:
                self.sink.put_nowait(msg.data)

    async def _pipe(self, ws: web.WebSocketResponse) -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(self.simulator_ws_url, max_msg_size=0) as sim,
        ):

            async def copy(src: Any, dst: Any) -> None:
                async for msg in src:
                    if msg.type is not aiohttp.WSMsgType.TEXT:
                        break
                    await dst.send_str(msg.data)
                await dst.close()

            await asyncio.gather(copy(ws, sim), copy(sim, ws), return_exceptions=True)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


# -- the healthy session -----------------------------------------------------------------------


@dataclass
class Healthy:
    """A session that runs responses back to back and checks ``server_event_seq``."""

    client: Client
    responses: int = 0
    events: int = 0
    last_seq: int = 0
    gaps: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await self.client.send(
            {"type": "session.update", "session": {"modalities": ["audio", "text"]}}
        )
        while not self.stop.is_set():
            for event in (
                {"type": "input_audio_buffer.append", "audio": SILENCE_100MS},
                {"type": "input_audio_buffer.commit"},
                {"type": "response.create"},
            ):
                await self.client.send(event)
            while True:
                event = await self.client.recv()
                self._check(event)
                if event["type"] == "response.done":
                    assert event["response"]["status"] == "completed", event
                    self.responses += 1
                    break

    def _check(self, event: Event) -> None:
        self.events += 1
        seq = event.get("server_event_seq")
        if event["type"] == "session.created":
            return
        if seq != self.last_seq + 1:
            self.gaps.append(f"{event['type']}: seq {seq} after {self.last_seq}")
        if isinstance(seq, int):
            self.last_seq = seq


@contextlib.asynccontextmanager
async def healthy_session(url: str) -> AsyncIterator[Healthy]:
    async with connect(url + "?role=healthy") as client:
        healthy = Healthy(client)
        task = asyncio.ensure_future(healthy.run())
        try:
            yield healthy
        finally:
            healthy.stop.set()
            async with asyncio.timeout(DEADLINE):
                await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    assert healthy.gaps == [], healthy.gaps[:5]


def run_examples(
    loop: asyncio.AbstractEventLoop, check: Callable[[Any], Coroutine[Any, Any, None]]
) -> Callable[[Any], None]:
    """A sync body for @given that runs ``check(value)`` on the test's loop."""

    def body(value: Any) -> None:
        asyncio.run_coroutine_threadsafe(check(value), loop).result(DEADLINE * 2)

    return body


# -- client frame strategies --------------------------------------------------------------------


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=["Cs"]), max_size=max_size)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text(40)
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_text(10), inner, max_size=5),
    max_leaves=15,
)
_field_names = st.sampled_from(
    ["response_id", "event_id", "audio", "session", "event", "item", "response", "delta"]
)
event_like = st.builds(
    lambda t, fields: {"type": t, **fields},
    st.sampled_from(KNOWN_TYPES) | _text(30),
    st.dictionaries(_field_names, json_values, max_size=4),
)
wrong_type = st.builds(
    lambda t, rest: {**rest, "type": t},
    _scalars.filter(lambda v: not isinstance(v, str)) | st.lists(_scalars, max_size=3),
    st.dictionaries(_field_names, json_values, max_size=2),
)


def _big(kind: str, n: int) -> str:
    if kind == "append":
        return '{"type":"input_audio_buffer.append","audio":"' + "A" * n + '"}'
    if kind == "escaped":
        return '{"type":"x.big","pad":"' + "\\u00e9" * (n // 6) + '"}'
    return '{"type":"x.big","pad":"' + "é" * (n // 2) + '"}'


_event_frames = event_like.map(lambda v: orjson.dumps(v).decode())
client_frames = st.one_of(
    st.binary(max_size=3000),
    _text(300),
    json_values.map(lambda v: orjson.dumps(v).decode()),
    _event_frames,  # listed three times: most real traffic is well-formed
    _event_frames,
    _event_frames,
    wrong_type.map(lambda v: orjson.dumps(v).decode()),
    st.integers(1000, 6000).map(lambda n: "[" * n),
    st.integers(1000, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1000, 3000).map(lambda n: '{"type":"x.deep","a":' + "[" * n + "]" * n + "}"),
    st.builds(
        _big,
        st.sampled_from(["append", "escaped", "utf8"]),
        st.integers(LIMIT - 4 * KIB, LIMIT - 64),
    ),
    st.sampled_from(
        [
            '{"type":"response.cancel","response_id":123}',
            '{"type":5}',
            '{"type":null}',
            '{"type":["response.cancel"]}',
            '{"type":"turn.signal","event":{"a":[1]}}',
            '{"type":"input_audio_buffer.append","audio":12}',
            '{"type":"session.update","session":{"audio":{"input":{"format":{"type":5,"rate":"x"}}}}}',
            '{"type":"session.update","session":{"sample_rate_hz":true,"input_audio_format":[]}}',
            '{"type":"response.cancel","response_id":null}',
            '{"type":"x.unknown.vendor","n":1e400}',
            '{"type":"x.bigint","n":123456789012345678901234567890}',
            '{"type":"x.dup","type":"response.cancel"}',
            '{"type":"x"}garbage',
            '\ufeff{"type":"x.bom"}',
            " " * 2000,
            "",
        ]
    ),
)


def expected_valid(frame: str | bytes) -> bool:
    """What the proxy promises to forward: a JSON object with a string ``type``."""
    if isinstance(frame, bytes):
        return False
    try:
        value = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("type"), str)


def frame_type(frame: str | bytes) -> str | None:
    with contextlib.suppress(Exception):
        value = orjson.loads(frame)
        if isinstance(value, dict) and isinstance(value.get("type"), str):
            return value["type"]
    return None


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture
async def fuzz_proxy(simulator, sidecar) -> AsyncIterator[tuple[Any, RoutingEngine]]:
    sim = await simulator(
        "--chunk-ms", "200", "--realtime-factor", "0.05", "--response-seconds", "0.6"
    )
    engine = await RoutingEngine(sim.ws_url).start()
    # The fuzzer sends far more than 200 frames/s on purpose, and the healthy
    # session checks gapless server_event_seq, which acks on its behalf would
    # break (the engine's answers are hidden): both limits are off here.
    proxy = await sidecar(
        upstream=engine.ws_url,
        max_client_message_bytes=LIMIT,
        max_input_audio_rate=0.0,
        max_client_frame_rate=0.0,
        playback_ack="off",
    )
    yield proxy, engine
    await engine.aclose()


async def test_client_frames_are_forwarded_untouched_or_answered(fuzz_proxy) -> None:
    proxy, engine = fuzz_proxy
    loop = asyncio.get_running_loop()
    counter = iter(range(1, 1_000_000))
    outcomes = {"forwarded": 0, "answered": 0}

    async with healthy_session(proxy.url) as healthy, connect(proxy.url) as client:
        # Warm up, then measure memory from here.
        await wait_until(lambda: healthy.responses >= 2, what="healthy responses")
        rss_before = rss_bytes()

        async def exchange(frame: str | bytes) -> None:
            n = next(counter)
            if isinstance(frame, bytes):
                await client.ws.send_bytes(frame)
            else:
                await client.ws.send_str(frame)
            await client.ws.send_str(_sentinel(n))
            # What the engine got before the sentinel...
            forwarded: list[str | bytes] = []
            async with asyncio.timeout(DEADLINE):
                while (item := await engine.sink.get()) != _sentinel(n):
                    forwarded.append(item)
            # ...and what the client was told before the sentinel came back.
            answers = []
            async with asyncio.timeout(DEADLINE):
                while (event := await client.recv())["type"] != "x.sentinel":
                    answers.append(event)
            assert event["n"] == n
            if expected_valid(frame):
                assert forwarded == [frame], "a valid frame must be forwarded byte for byte"
                assert answers == []
                outcomes["forwarded"] += 1
            else:
                assert forwarded == [], "an invalid frame must not reach the engine"
                assert len(answers) == 1, answers
                [error] = answers
                assert error["type"] == "error"
                assert error["error"]["type"] == "invalid_request_error"
                assert error["error"]["code"] in ("invalid_json", "bad_event", "binary_unsupported")
                assert isinstance(error["error"]["message"], str) and error["error"]["message"]
                outcomes["answered"] += 1

        @fuzz_settings(CLIENT_EXAMPLES)
        @given(client_frames.filter(lambda f: frame_type(f) not in SESSION_ENDING))
        def fuzz(frame: str | bytes) -> None:
            run_examples(loop, exchange)(frame)

        started = time.monotonic()
        await asyncio.to_thread(fuzz)
        elapsed = time.monotonic() - started
        rss_after = rss_bytes()
        # The fuzzed session is still open and usable.
        await client.send({"type": "x.still_open"})
        assert await engine.sink.get() == '{"type":"x.still_open"}'

        # The healthy session kept receiving, gap-free (checked on exit).
        responses_during = healthy.responses
        assert responses_during >= 3

    assert not proxy.task.done()
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.http_url}/healthz") as resp:
        assert resp.status == 200
    growth = rss_after - rss_before
    print(
        f"\nclient fuzz: {sum(outcomes.values())} frames in {elapsed:.1f} s ({outcomes}); "
        f"healthy session: {healthy.responses} responses, {healthy.events} events, no gap; "
        f"RSS {rss_before / MIB:.1f} -> {rss_after / MIB:.1f} MiB"
    )
    assert growth < 64 * MIB, f"RSS grew {growth / MIB:.1f} MiB"
    assert (
        proxy.metric("omni_sidecar_dropped_events_total", {"reason": "invalid_client_frame"})
        == outcomes["answered"]
    )


async def test_malformed_large_append_is_not_forwarded(fuzz_proxy) -> None:
    """Large appends skip the full parse (the scan path): broken JSON around the audio
    must still be answered, not forwarded."""
    proxy, engine = fuzz_proxy
    tails = ['", ]]] oops }', '",}', '" "x":1}', '","a":[}', '"}}', '"} trailing']
    async with connect(proxy.url) as client:
        for n, tail in enumerate(tails, 1):
            frame = '{"type":"input_audio_buffer.append","audio":"' + "A" * 2000 + tail
            assert not expected_valid(frame)
            await client.ws.send_str(frame)
            await client.ws.send_str(_sentinel(n))
            forwarded = []
            async with asyncio.timeout(DEADLINE):
                while (item := await engine.sink.get()) != _sentinel(n):
                    forwarded.append(item)
            assert forwarded == [], tail
            error = await client.recv()
            assert error["type"] == "error" and error["error"]["code"] == "invalid_json", tail
            assert (await client.recv())["n"] == n


async def test_websocket_protocol_violations_close_only_that_connection(fuzz_proxy) -> None:
    """Bad frames below the JSON layer: each ends its own connection, nothing else."""
    proxy, _ = fuzz_proxy
    violations = {
        "invalid_utf8_text": (0x1, b'{"type":"x","a":"\xff\xfe"}'),
        "reserved_opcode": (0x3, b"x"),
        "fragmented_ping": None,  # built below: a ping without FIN
        "close_bad_code": (0x8, (999).to_bytes(2, "big")),
        "continuation_first": (0x0, b"orphan"),
    }
    codes = {}
    async with healthy_session(proxy.url) as healthy:
        await wait_until(lambda: healthy.responses >= 1, what="healthy responses")
        for name, spec in violations.items():
            raw = await RawWebSocket.connect(proxy.url)
            if spec is None:
                mask = b"\x00\x00\x00\x00"
                raw.writer.write(bytes([0x09, 0x80 | 1]) + mask + b"x")
            else:
                raw.send_frame(*spec)
            # The server closes with a protocol error code, or just drops TCP.
            code = None
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while code is None:
                    opcode, payload = await raw.read_frame()
                    if opcode == 0x8:
                        code = int.from_bytes(payload[:2], "big")
            codes[name] = code
            raw.writer.close()
        before = healthy.responses
        await wait_until(lambda: healthy.responses >= before + 2, what="healthy keeps going")
    print(f"\nprotocol violations -> close codes {codes}")
    assert codes["invalid_utf8_text"] in (1007, None)
    assert all(code in (1002, 1007, None) for code in codes.values()), codes
    assert not proxy.task.done()
    await wait_until(
        lambda: proxy.metric("omni_sidecar_sessions_active") == 0, what="no session active"
    )


# -- upstream ------------------------------------------------------------------------------


valid_upstream = st.builds(
    lambda t, n, extra: {"type": t, "n": n, **extra},
    st.sampled_from(["x.valid", "response.output_audio_transcript.delta", "rate_limits.updated"]),
    st.integers(0, 10**6),
    st.dictionaries(st.sampled_from(["delta", "item_id", "meta"]), json_values, max_size=2),
)
invalid_upstream = (
    st.sampled_from(sorted(MALFORMED_UPSTREAM_FRAMES)).map(MALFORMED_UPSTREAM_FRAMES.__getitem__)
    | st.binary(max_size=200)
    | _text(50).filter(lambda t: not expected_valid(t))
)
upstream_batches = st.lists(st.one_of(valid_upstream, invalid_upstream), min_size=1, max_size=12)


async def test_malformed_upstream_frames_are_dropped_and_counted(sidecar) -> None:
    engine = await HostileEngine().start()
    try:
        proxy = await sidecar(upstream=engine.ws_url)
        loop = asyncio.get_running_loop()
        totals = {"valid": 0, "invalid": 0}
        async with connect(proxy.url) as client:
            conn = await engine.next_connection()
            counter = iter(range(1, 1_000_000))

            async def batch(frames: list[Any]) -> None:
                n = next(counter)
                dropped_before = proxy.metric(
                    "omni_sidecar_dropped_events_total", {"reason": "invalid_upstream_frame"}
                )
                await engine.send_frames(conn, [*frames, {"type": "x.sentinel", "n": n}])
                got = []
                async with asyncio.timeout(DEADLINE):
                    while (event := await client.recv())["type"] != "x.sentinel":
                        got.append(event)
                assert event["n"] == n
                valid = [f for f in frames if isinstance(f, dict)]
                assert got == valid, "valid frames arrive, in order, untouched"
                invalid = len(frames) - len(valid)
                dropped = proxy.metric(
                    "omni_sidecar_dropped_events_total", {"reason": "invalid_upstream_frame"}
                )
                assert dropped - dropped_before == invalid
                totals["valid"] += len(valid)
                totals["invalid"] += invalid

            @fuzz_settings(UPSTREAM_EXAMPLES)
            @given(upstream_batches)
            def fuzz(frames: list[Any]) -> None:
                run_examples(loop, batch)(frames)

            await asyncio.to_thread(fuzz)
            # The session survived: both directions still work.
            await client.send({"type": "x.still_open"})
            assert (await conn.receive_event())["type"] == "x.still_open"
            await engine.send_malformed(conn, "binary")
            await conn.send({"type": "x.last"})
            assert (await client.recv())["type"] == "x.last"
        print(f"\nupstream fuzz: {totals['valid']} valid delivered, {totals['invalid']} dropped")
        assert proxy.metric("omni_sidecar_sessions_total", {"outcome": "error"}) == 0
    finally:
        await engine.aclose()
