"""What the voice-stack tests share (issue 39): test_livekit_agents.py, test_pipecat.py,
test_agents_sdk.py, and tests/real_engine/test_real_stacks.py.

Each stack's file holds a minimal application in the stack's default configuration
(only its URL and API key point at the sidecar) and asserts, on the wire and on what
the application got, what a user of that stack judges it by. What they share:

- the two simulator profiles the OpenAI dialect is verified on: a 0.32-like engine
  with MiniCPM-o-like audio and a 0.30-like one with Nemotron-like audio;
- :class:`WireTap`, a recording relay between a stack and the sidecar: every
  frame either way, in order, so a test sees the wire whatever hooks the stack
  has (Pipecat has none for raw server events). It adds one loopback hop and
  changes nothing: the same path, query and credentials reach the sidecar;
- :class:`LibraryErrors`, what the stack logged at ERROR (its own loggers and
  ``asyncio``'s unhandled task exceptions; Pipecat's loguru as well);
- :class:`Call`, what one application saw beside the wire, and the checks every
  stack is held to: nothing went wrong (:meth:`Call.assert_clean`), a reply arrives
  whole (:meth:`Call.assert_completed`), an interrupted one stops
  (:meth:`Call.assert_nothing_after`);
- the fixtures (``minicpmo_sim``, ``nemotron_sim``, ``profile``, ``tap``: import them
  into the test module) and the user's audio (``SPEECH``, :func:`barge_in`).

The user's speech over a reply needs espeak-ng (.ci/run installs it); the sidecar's
turn detection, a voice-activity model, hears it as speech.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import functools
import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
import pydantic
import pytest
from aiohttp import web

from engine_launcher.engine_config import EngineConfig
from engine_launcher.simulator import flags
from tests.conftest import DEADLINE, MS, TIMEOUT_FACTOR
from tests.integration.helpers import SimulatorChild, module_simulator
from tests.integration.speech import chunks, speech_24k

__all__ = [
    "API_KEY",
    "AUDIO_DELTA",
    "MODEL",
    "PROFILES",
    "RATE",
    "RESPONSE_MS",
    "SPEECH",
    "Call",
    "Event",
    "LibraryErrors",
    "Profile",
    "WireTap",
    "barge_in",
    "minicpmo_sim",
    "nemotron_sim",
    "profile",
    "profile_simulator",
    "response_done",
    "speech_started",
    "tap",
]

Event = dict[str, Any]

RATE: Final = 24000  # what every stack asks for (and assumes) in and out
MODEL: Final = "omni-sim"
API_KEY: Final = "sk-test"
AUDIO_DELTA: Final = "response.output_audio.delta"
#: Every response lasts this long (a whole number of both profiles' packets): long
#: enough to interrupt it after its first delta.
RESPONSE_MS: Final = 1200
#: At most one audio delta per this many ms (stretched by the timeout factor): an
#: interruption sent right after a delta reaches the sidecar before the engine's next
#: one, so every delta of the reply after it is one the sidecar should have removed.
DELTA_INTERVAL_MS: Final = 200
#: How often a wait on the wire looks at what the library logged (seconds).
TROUBLE_POLL: Final = 50 * MS
#: Headers a stack sends that the sidecar reads (credentials, the beta flavour).
FORWARDED_HEADERS: Final = ("Authorization", "OpenAI-Beta")


@dataclass(frozen=True)
class Profile:
    """One simulated engine: its release, output rate and output packet length."""

    name: str
    version: str
    engine_rate: int
    chunk_ms: int
    #: Audio the engine still sends after a cancel (0.30: the sidecar removes it).
    late_chunks: int


PROFILES: Final = {
    "minicpmo-0.32": Profile("minicpmo", "0.32", 24000, 200, 0),
    "nemotron-0.30": Profile("nemotron", "0.30", 22050, 80, 3),
}


def _audio_args(profile: Profile) -> tuple[str, ...]:
    """``--audio-profile`` where the simulator has it (it comes with the dialect, issue 39);
    before, the same output formats by hand (input stays PCM16 there)."""
    if hasattr(flags, "AUDIO_PROFILES"):
        return ("--audio-profile", profile.name)
    return ("--sample-rate", str(profile.engine_rate))


@contextlib.contextmanager
def profile_simulator(profile: Profile) -> Iterator[SimulatorChild]:
    """A ready simulator of ``profile`` for a module-scoped fixture."""
    # Real-time pace is a delta per packet; Nemotron's 80 ms packets are slowed to one per
    # DELTA_INTERVAL_MS (the pace of generation changes nothing else here).
    factor = TIMEOUT_FACTOR * max(1.0, DELTA_INTERVAL_MS / profile.chunk_ms)
    args = (
        "--model", MODEL, "--engine-version", profile.version, *_audio_args(profile),
        "--chunk-ms", str(profile.chunk_ms), "--late-audio-chunks", str(profile.late_chunks),
        "--realtime-factor", f"{factor:g}", "--response-seconds", str(RESPONSE_MS / 1000),
    )  # fmt: skip
    with module_simulator(*args) as sim:
        yield sim


@functools.cache
def _ga_events() -> pydantic.TypeAdapter[Any]:
    """The ``openai`` package's GA server-event union (what the Agents SDK validates with)."""
    from openai.types.realtime import RealtimeServerEvent

    return pydantic.TypeAdapter(RealtimeServerEvent)


def _ga_problem(event: Event) -> str | None:
    """Why ``event`` does not validate against the GA server-event union, or None."""
    try:
        _ga_events().validate_python(event)
    except pydantic.ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in exc.errors()[:4]
        )
        shown = orjson.dumps(event).decode()[:400]
        return f"{event.get('type')}: {where} in {shown}"[:1000]
    return None


# -- the wire ------------------------------------------------------------------------------


@dataclass
class WireTap:
    """A relay that records every text frame between the stacks and ``upstream``.

    ``log`` holds ``(direction, event)`` in the order the tap saw them:
    ``"c2s"`` from the stack, ``"s2c"`` from the sidecar (recorded before it is
    passed on). ``failures`` holds what went wrong in the tap itself.
    """

    upstream: str  # ws://host:port of the sidecar
    log: list[tuple[str, Event]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    #: Server events that do not validate against the ``openai`` package's GA model of
    #: their type (what the Agents SDK validates with): "type: what fails".
    invalid: list[str] = field(default_factory=list)
    handshakes: list[dict[str, str]] = field(default_factory=list)
    port: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def mark(self) -> int:
        return len(self.log)

    def server_events(self, start: int = 0) -> list[Event]:
        return [e for d, e in self.log[start:] if d == "s2c"]

    def of(self, kind: str, start: int = 0) -> list[Event]:
        return [e for e in self.server_events(start) if e.get("type") == kind]

    def index(self, direction: str, match: Callable[[Event], bool], start: int = 0) -> int:
        """Position in ``log`` of the first ``direction`` frame that matches, from ``start``."""
        for n in range(start, len(self.log)):
            d, event = self.log[n]
            if d == direction and match(event):
                return n
        raise AssertionError(f"no {direction} frame matches (of {len(self.log)} frames)")

    def summary(self, start: int = 0) -> list[str]:
        """``log[start:]`` in short: types, with each audio delta's response and size."""
        out = []
        for d, e in self.log[max(start, 0) :]:
            if e.get("type") == AUDIO_DELTA:
                size = len(base64.b64decode(e["delta"]))
                out.append(f"{d}:audio({e.get('response_id')},{size}B)")
            else:
                out.append(f"{d}:{e.get('type')}")
        return out

    def audio_bytes(self, response_id: str, start: int = 0, stop: int | None = None) -> int:
        """Bytes of PCM in the audio deltas of ``response_id`` within ``log[start:stop]``."""
        return sum(
            len(base64.b64decode(e["delta"]))
            for d, e in self.log[start:stop]
            if d == "s2c" and e.get("type") == AUDIO_DELTA and e.get("response_id") == response_id
        )

    async def until(
        self,
        match: Callable[[Event], bool],
        *,
        start: int = 0,
        timeout: float = DEADLINE,
        trouble: Callable[[], list[str]] | None = None,
    ) -> Event:
        """The first server event from ``log[start:]`` that matches, waiting for it.

        An ``error`` event fails the wait at once (a test needs none, and the stacks
        stop at the first one), and so does anything ``trouble`` returns (what the
        library logged or surfaced: it may have stopped reading).
        """
        seen = start
        async with asyncio.timeout(timeout):
            while True:
                for n in range(seen, len(self.log)):
                    d, event = self.log[n]
                    if d == "s2c" and match(event):
                        return event
                    if d == "s2c" and event.get("type") == "error":
                        raise AssertionError(f"an error event on the wire: {event}")
                seen = len(self.log)
                if trouble is not None and (problems := trouble()):
                    raise AssertionError(f"the library failed: {problems}")
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), TROUBLE_POLL)

    def _record(self, direction: str, text: str) -> None:
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            event = {"type": "<not JSON>", "text": text[:200]}
        self.log.append((direction, event))
        if direction == "s2c":
            problem = _ga_problem(event)
            if problem is not None:
                self.invalid.append(problem)
        self._changed.set()

    async def accept(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        self.handshakes.append({"path_qs": request.path_qs, **headers})
        client = web.WebSocketResponse(max_msg_size=0)
        await client.prepare(request)
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.ws_connect(
                    self.upstream + request.path_qs, headers=headers, max_msg_size=0
                ) as up,
            ):
                await self._relay(client, up)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:  # the stack sees a close
            self.failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):
                await client.close()
        return client

    async def _relay(
        self, client: web.WebSocketResponse, up: aiohttp.ClientWebSocketResponse
    ) -> None:
        async def pump(source: Any, sink: Any, direction: str) -> None:
            async for msg in source:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    self._record(direction, msg.data)
                    await sink.send_str(msg.data)
                elif msg.type is aiohttp.WSMsgType.BINARY:
                    self.failures.append(f"{direction}: a binary frame")
                    await sink.send_bytes(msg.data)

        tasks = [
            asyncio.ensure_future(pump(client, up, "c2s")),
            asyncio.ensure_future(pump(up, client, "s2c")),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            code = up.close_code or 1000
            with contextlib.suppress(Exception):
                await up.close()
            with contextlib.suppress(Exception):
                await client.close(code=code)

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, upstream: str) -> AsyncIterator[WireTap]:
        tap = cls(upstream)
        app = web.Application()
        app.router.add_get("/{tail:.*}", tap.accept)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        tap.port = runner.addresses[0][1]
        try:
            yield tap
        finally:
            async with asyncio.timeout(DEADLINE):
                await runner.cleanup()


# -- what the library logged -----------------------------------------------------------------


class LibraryErrors(logging.Handler):
    """ERROR records of the named loggers (and ``asyncio``: unhandled task exceptions)."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__(logging.ERROR)
        self.prefixes = (*prefixes, "asyncio")
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(self.prefixes):
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
            self.records.append(f"{record.name}: {text}"[:2000])

    @contextlib.contextmanager
    def installed(self) -> Iterator[LibraryErrors]:
        root = logging.getLogger()
        root.addHandler(self)
        try:
            yield self
        finally:
            root.removeHandler(self)

    def loguru_sink(self, message: Any) -> None:
        """For Pipecat, which logs through loguru."""
        record = message.record
        self.records.append(f"loguru {record['name']}: {record['message']}"[:2000])


# -- the user's audio --------------------------------------------------------------------------


def pcm16(ms: int, amplitude: float) -> bytes:
    """24 kHz PCM16 mono, a 440 Hz tone (0.3: speech to an energy VAD)."""
    n = RATE * ms // 1000
    samples = array.array(
        "h", (int(32767 * amplitude * math.sin(2 * math.pi * 440 * i / RATE)) for i in range(n))
    )
    if sys.byteorder != "little":
        samples.byteswap()
    return samples.tobytes()


#: The user's turn before each reply. Loud: vLLM-Omni 0.30 takes a commit of only quiet
#: audio for silence (response.listen, no reply); a tone, so that no voice-activity
#: model takes it for speech and ends the turn on its own.
SPEECH: Final = pcm16(200, amplitude=0.3)


def barge_in() -> list[bytes]:
    """The user talking over a reply: espeak-ng speech in 100 ms pieces (what the
    sidecar's turn detection, a voice-activity model, takes for speech)."""
    return chunks(speech_24k("Wait, wait, stop talking please."))


# -- fixtures (import them into the test module) -----------------------------------------------


@pytest.fixture(scope="module")
def minicpmo_sim() -> Iterator[SimulatorChild]:
    with profile_simulator(PROFILES["minicpmo-0.32"]) as sim:
        yield sim


@pytest.fixture(scope="module")
def nemotron_sim() -> Iterator[SimulatorChild]:
    with profile_simulator(PROFILES["nemotron-0.30"]) as sim:
        yield sim


@pytest.fixture(params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> tuple[Profile, SimulatorChild]:
    p = PROFILES[request.param]
    return p, request.getfixturevalue(f"{p.name}_sim")


@pytest.fixture
async def tap(profile: tuple[Profile, SimulatorChild], sidecar: Any) -> AsyncIterator[WireTap]:
    """The sidecar in front of the profile's simulator, behind a recording relay."""
    p, sim = profile
    engine = EngineConfig(kind="external", upstream=sim.ws_url, version=p.version)
    proxy = await sidecar(upstream=sim.ws_url, engine=engine)
    host, port = proxy.sidecar.bound["listen"]
    async with WireTap.running(f"ws://{host}:{port}") as relay:
        yield relay


# -- what every call must show -----------------------------------------------------------------


@dataclass
class Call:
    """What one application saw, beside what the wire carried."""

    tap: WireTap
    errors: LibraryErrors
    #: Errors the library handed to the application (events, frames, exceptions).
    surfaced: list[str] = field(default_factory=list)
    #: Bytes of PCM the application got, per reply (in the order the replies came).
    audio: dict[str, int] = field(default_factory=dict)
    #: (sample rate, channels) of the application's audio frames, where the stack labels them.
    formats: set[tuple[int, int]] = field(default_factory=set)
    #: How long the engine's replies last.
    reply_ms: int = RESPONSE_MS

    async def until(self, match: Callable[[Event], bool], start: int = 0) -> Event:
        """The next server event that matches; fails early on an error event or a library error."""
        return await self.tap.until(match, start=start, trouble=self.troubles)

    def troubles(self) -> list[str]:
        return [*self.errors.records, *self.surfaced, *self.tap.failures]

    def got(self, response_id: str, pcm: bytes, rate: int | None = None, channels: int = 1) -> None:
        self.audio[response_id] = self.audio.get(response_id, 0) + len(pcm)
        if rate is not None:
            self.formats.add((rate, channels))

    def diagnosis(self) -> str:
        types = [f"{d}:{e.get('type')}" for d, e in self.tap.log if e.get("type") != AUDIO_DELTA]
        return (
            f"\nlibrary errors: {self.errors.records}\nsurfaced: {self.surfaced}"
            f"\ntap failures: {self.tap.failures}\ninvalid (openai GA models): {self.tap.invalid}"
            f"\nwire errors: {self.tap.of('error')}"
            f"\nwire (audio deltas left out): {types[:80]}"
        )

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """An exception inside carries the diagnosis (unless it already does)."""
        try:
            yield
        except Exception as exc:
            if "\nlibrary errors: " in str(exc):
                raise
            what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            raise AssertionError(f"{what}{self.diagnosis()}") from exc

    def assert_clean(self) -> None:
        """No library error, nothing surfaced, no error event on the wire, and every audio
        frame the application got (where the stack labels them) 24 kHz mono."""
        assert self.tap.failures == [], self.diagnosis()
        assert self.errors.records == [], self.diagnosis()
        assert self.surfaced == [], self.diagnosis()
        assert self.tap.of("error") == [], self.diagnosis()
        assert self.formats <= {(RATE, 1)}, f"audio frames as (rate, channels): {self.formats}"

    def assert_completed(self, response_id: str) -> None:
        """The reply ended completed, its audio at 24 kHz lasting what the engine produced."""
        done = [e for e in self.tap.of("response.done") if e["response"]["id"] == response_id]
        assert [e["response"]["status"] for e in done] == ["completed"], self.diagnosis()
        wire = self.tap.audio_bytes(response_id)
        assert self.audio.get(response_id) == wire, self.diagnosis()
        got_ms = wire / 2 / RATE * 1000
        # Resampled from 22.05 kHz: within one sample of each rate.
        assert abs(got_ms - self.reply_ms) <= 1000 / 22050 + 1000 / RATE, (
            f"as 24 kHz PCM16 the reply lasts {got_ms} ms; the engine produced {self.reply_ms} ms"
        )
        assert self.formats <= {(RATE, 1)}, f"audio frames as (rate, channels): {self.formats}"

    def assert_nothing_after(self, response_id: str, mark: int) -> None:
        """Interrupted at ``tap.log[mark]``: cancelled, and no audio of it after that."""
        done = [e for e in self.tap.of("response.done") if e["response"]["id"] == response_id]
        assert [e["response"]["status"] for e in done] == ["cancelled"], self.diagnosis()
        late = self.tap.audio_bytes(response_id, start=mark)
        assert late == 0, (
            f"{late} bytes of the interrupted reply on the wire after it: "
            f"{self.tap.summary(mark - 3)}"
        )
        before = self.tap.audio_bytes(response_id, stop=mark)
        assert before > 0, "interrupted before any audio: the test did not interrupt a reply"
        got = self.audio.get(response_id, 0)
        assert got == before, f"the application got {got} bytes of it, the wire had {before}"


def speech_started(call: Call, start: int = 0) -> int:
    """Where (from ``tap.log[start]``) the server said the user barged in (it cancels the
    reply there)."""
    started = [
        n
        for n, (d, e) in enumerate(call.tap.log)
        if n >= start and e["type"] == "input_audio_buffer.speech_started"
    ]
    if not started:
        updated = call.tap.of("session.updated")
        in_effect = updated[-1]["session"].get("audio", {}).get("input", {}) if updated else {}
        pytest.fail(
            "the user's speech did not interrupt the reply: no input_audio_buffer.speech_started;"
            f" turn_detection in effect: {in_effect.get('turn_detection', '(none)')!r}"
            + call.diagnosis()
        )
    return started[0]


def response_done(response_id: str) -> Callable[[Event], bool]:
    return lambda e: e.get("type") == "response.done" and e["response"]["id"] == response_id
