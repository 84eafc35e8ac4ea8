"""What the voice-stack tests share (tests/integration/test_voice_stacks.py, issue 39).

- the two simulator profiles the OpenAI dialect is verified on: a 0.32-like engine
  with MiniCPM-o-like audio and a 0.30-like one with Nemotron-like audio;
- :class:`WireTap`, a recording relay between a stack and the sidecar: every
  frame either way, in order, so a test sees the wire whatever hooks the stack
  has (Pipecat has none for raw server events). It adds one loopback hop and
  changes nothing: the same path, query and credentials reach the sidecar;
- :class:`LibraryErrors`, what the stack logged at ERROR (its own loggers and
  ``asyncio``'s unhandled task exceptions; Pipecat's loguru as well).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
import pydantic
from aiohttp import web

from engine_launcher.simulator import flags
from tests.conftest import DEADLINE, MS, TIMEOUT_FACTOR
from tests.integration.helpers import SimulatorChild, module_simulator

__all__ = [
    "API_KEY",
    "AUDIO_DELTA",
    "MODEL",
    "PROFILES",
    "RESPONSE_MS",
    "Event",
    "LibraryErrors",
    "Profile",
    "WireTap",
    "profile_simulator",
]

Event = dict[str, Any]

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
