"""Client-side helpers for the relay and CLI integration tests.

Everything here observes what a peer observes: events in order, close codes,
HTTP statuses. Every wait is bounded by ``DEADLINE`` from ``tests.conftest``.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import math
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from tests.children import SimulatorChild, child_pids, clean_env, cli_argv
from tests.conftest import DEADLINE, MS

__all__ = [
    "AUDIO_DELTA",
    "RESPONSE_TAIL",
    "TRANSCRIPT_DELTA",
    "Cancelled",
    "Client",
    "RawWebSocket",
    "SimulatorChild",
    "Trigger",
    "assert_relayed_as_the_engine_wrote",
    "cancel_mid_response",
    "children_of",
    "clean_env",
    "cli_argv",
    "cmdline",
    "connect",
    "module_simulator",
    "pcm16_b64",
    "request_response",
    "rid_of",
    "run_cli",
    "sim_metric",
    "wait_metric",
]

Event = dict[str, Any]

AUDIO_DELTA: Final = "response.output_audio.delta"
TRANSCRIPT_DELTA: Final = "response.output_audio_transcript.delta"
#: What the simulator sends after the last delta of a response (completed or cancelled).
RESPONSE_TAIL: Final = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
    "rate_limits.updated",
]
REPO_ROOT: Final = Path(__file__).resolve().parents[2]


#: Most events one read helper collects: a runaway server fails the test fast.
MAX_EVENTS_PER_READ = 200_000


def rid_of(event: Event) -> str | None:
    value = event.get("response_id")
    return value if isinstance(value, str) else None


def pcm16_b64(ms: int, *, amplitude: float = 0.0, rate: int = 16000) -> str:
    """Base64 PCM16 mono: silence, or a 440 Hz tone (0.3 = loud enough for server VAD)."""
    n = rate * ms // 1000
    samples = array.array(
        "h", (int(32767 * amplitude * math.sin(2 * math.pi * 440 * i / rate)) for i in range(n))
    )
    if sys.byteorder != "little":
        samples.byteswap()
    return base64.b64encode(samples.tobytes()).decode()


SILENCE_100MS: Final = pcm16_b64(100)


class Client:
    """A realtime client that records every event it reads.

    ``events`` keeps all parsed events in arrival order; ``mark()`` returns the
    current position so that a test can say "everything read after I sent X".
    """

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[Event] = []
        self.frames: list[str] = []
        self.close_frame_code: int | None = None

    async def send(self, event: Event | str) -> None:
        await self.ws.send_str(event if isinstance(event, str) else orjson.dumps(event).decode())

    def mark(self) -> int:
        return len(self.events)

    async def recv(self, timeout: float = DEADLINE) -> Event:
        msg = await self.ws.receive(timeout=timeout)
        assert msg.type is aiohttp.WSMsgType.TEXT, f"expected a text frame, got {msg!r}"
        self.frames.append(msg.data)
        event = orjson.loads(msg.data)
        self.events.append(event)
        return event

    async def recv_until(
        self, match: str | Callable[[Event], bool], timeout: float = DEADLINE
    ) -> Event:
        """Read until an event matches (a type name or a predicate); return it.

        Bounded by a deadline and by ``MAX_EVENTS_PER_READ`` events.
        """
        check = (lambda e: e.get("type") == match) if isinstance(match, str) else match
        async with asyncio.timeout(timeout):
            for _ in range(MAX_EVENTS_PER_READ):
                event = await self.recv()
                if check(event):
                    return event
        raise AssertionError(f"no match within {MAX_EVENTS_PER_READ} events")

    async def recv_until_closed(self, timeout: float = DEADLINE) -> list[Event]:
        """Read everything up to the close; return the events read in this call.

        The code of the Close frame the server sent is kept in ``close_code``.
        """
        start = self.mark()
        async with asyncio.timeout(timeout):
            while True:
                if len(self.events) - start > MAX_EVENTS_PER_READ:
                    raise AssertionError(f"more than {MAX_EVENTS_PER_READ} events before the close")
                msg = await self.ws.receive()
                if msg.type is aiohttp.WSMsgType.TEXT:
                    self.frames.append(msg.data)
                    self.events.append(orjson.loads(msg.data))
                    continue
                if msg.type is aiohttp.WSMsgType.CLOSE:
                    self.close_frame_code = int(msg.data)
                    # Answer like a well-behaved client (autoclose is off).
                    with contextlib.suppress(Exception):
                        await self.ws.close()
                    break
                assert msg.type in (
                    aiohttp.WSMsgType.CLOSING,
                    aiohttp.WSMsgType.CLOSED,
                ), f"unexpected frame {msg!r}"
                break
        return self.events[start:]

    @property
    def close_code(self) -> int | None:
        """The code of the server's Close frame (else what aiohttp recorded).

        ``connect`` opens sockets with ``autoclose=False``: the Close frame is
        then returned to us as it arrived, whatever happens to our reply.
        """
        if self.close_frame_code is not None:
            return self.close_frame_code
        return self.ws.close_code

    def types(self, start: int = 0) -> list[str]:
        return [str(e.get("type")) for e in self.events[start:]]


def _small_receive_buffer(receive_buffer_bytes: int) -> Callable[[Any], socket.socket]:
    def factory(addr_info: Any) -> socket.socket:
        family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
        sock = socket.socket(family=family, type=kind, proto=proto)
        # Set before connect: fixes the window and turns receive autotuning off,
        # so a client that stops reading absorbs only this much in the kernel.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        return sock

    return factory


@contextlib.asynccontextmanager
async def connect(
    url: str, *, receive_buffer_bytes: int | None = None, **kwargs: Any
) -> AsyncIterator[Client]:
    """Open a realtime WebSocket; closes it (bounded) on exit.

    Args:
        receive_buffer_bytes: SO_RCVBUF of the client socket (for stalled
            clients); None keeps the kernel's autotuned buffer (up to tens of MB).
    """
    kwargs.setdefault("max_msg_size", 0)
    kwargs.setdefault("autoclose", False)
    kwargs.setdefault("timeout", aiohttp.ClientWSTimeout(ws_close=DEADLINE))
    connector = None
    if receive_buffer_bytes is not None:
        connector = aiohttp.TCPConnector(socket_factory=_small_receive_buffer(receive_buffer_bytes))
    async with aiohttp.ClientSession(connector=connector) as http:
        ws = await http.ws_connect(url, **kwargs)
        try:
            yield Client(ws)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DEADLINE):
                    await ws.close()


async def request_response(client: Client, *, open_session: bool = False) -> None:
    """Append 100 ms, commit, ``response.create`` (optionally ``session.update`` first)."""
    if open_session:
        await client.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
    await client.send({"type": "input_audio_buffer.commit"})
    await client.send({"type": "response.create"})


@dataclass
class Cancelled:
    """What the client read around one cancel."""

    response_id: str
    before: list[Event]  # events of the session up to the moment the cancel was sent
    after: list[Event]  # events read after it, through the cancelled response.done

    def audio_after(self) -> list[Event]:
        return [e for e in self.after if e["type"] == AUDIO_DELTA and rid_of(e) == self.response_id]

    def done(self) -> Event:
        return next(
            e for e in self.after if e["type"] == "response.done" and rid_of(e) == self.response_id
        )


Trigger = Callable[[str], Event]


async def cancel_mid_response(
    client: Client,
    trigger: Trigger,
    *,
    open_session: bool = True,
    session: dict[str, Any] | None = None,
    audio_before_cancel: int = 2,
) -> Cancelled:
    """Start a response, read ``audio_before_cancel`` deltas, send the trigger at once,
    then read through the response's ``response.done`` and ``rate_limits.updated``."""
    if session is not None:
        await client.send({"type": "session.update", "session": session})
        open_session = False
    await request_response(client, open_session=open_session)
    rid = rid_of(await client.recv_until("response.created"))
    assert rid is not None
    for _ in range(audio_before_cancel):
        await client.recv_until(lambda e: e["type"] == AUDIO_DELTA and rid_of(e) == rid)
    mark = client.mark()
    await client.send(trigger(rid))
    await client.recv_until(lambda e: e["type"] == "response.done" and rid_of(e) == rid)
    await client.recv_until("rate_limits.updated")
    return Cancelled(rid, client.events[:mark], client.events[mark:])


async def wait_metric(
    get: Callable[[], float], value: float, *, what: str, timeout: float = DEADLINE
) -> None:
    """Poll a metric until it reaches ``value`` (>=); every 5 ms."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while get() < value:
        if loop.time() >= deadline:
            pytest.fail(f"timed out waiting for {what} >= {value} (is {get()})")
        await asyncio.sleep(5 * MS)


# -- simulator children shared by a module -----------------------------------------------------


@contextlib.contextmanager
def module_simulator(*args: str) -> Iterator[SimulatorChild]:
    """A ready simulator child for a module-scoped fixture; stopped on exit."""
    with SimulatorChild(*args, ready_timeout=DEADLINE, stop_grace=DEADLINE) as sim:
        yield sim


async def sim_metric(sim: SimulatorChild, name: str) -> float:
    """One unlabelled sample of the simulator's own ``/metrics``."""
    async with aiohttp.ClientSession() as http, http.get(f"{sim.http_url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no {name} in the simulator's /metrics")


# -- processes ---------------------------------------------------------------------------------


#: Live (non-zombie) child pids of a pid, read from ``/proc``.
children_of = child_pids


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


# -- a raw WebSocket client, for what aiohttp hides: the closing handshake ------------------


class RawWebSocket:
    """A minimal RFC 6455 client on asyncio streams (unfragmented frames only).

    aiohttp answers a Close frame by itself and then reports 1006 when it could
    not; this client lets a test see exactly when the server closes TCP.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, url: str) -> RawWebSocket:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        writer.write(
            (
                f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        async with asyncio.timeout(DEADLINE):
            status = await reader.readline()
            assert b" 101 " in status, status
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
        return cls(reader, writer)

    async def read_frame(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame from the server."""
        async with asyncio.timeout(DEADLINE):
            b0, b1 = await self.reader.readexactly(2)
            assert b0 & 0x80, "fragmented frames are not supported here"
            length = b1 & 0x7F
            if length == 126:
                length = int.from_bytes(await self.reader.readexactly(2), "big")
            elif length == 127:
                length = int.from_bytes(await self.reader.readexactly(8), "big")
            return b0 & 0x0F, await self.reader.readexactly(length)

    async def read_until_close(self) -> tuple[list[Event], int]:
        """Text events, then the Close frame's code."""
        events: list[Event] = []
        while True:
            if len(events) > MAX_EVENTS_PER_READ:
                raise AssertionError(f"more than {MAX_EVENTS_PER_READ} events before the close")
            opcode, payload = await self.read_frame()
            if opcode == 0x1:
                events.append(orjson.loads(payload))
            elif opcode == 0x8:
                return events, int.from_bytes(payload[:2], "big")

    def send_frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        header = bytearray([0x80 | opcode])
        if len(payload) < 126:
            header.append(0x80 | len(payload))
        elif len(payload) < 1 << 16:
            header += bytes([0x80 | 126]) + len(payload).to_bytes(2, "big")
        else:
            header += bytes([0x80 | 127]) + len(payload).to_bytes(8, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.writer.write(bytes(header) + mask + masked)

    def send_text(self, text: str) -> None:
        self.send_frame(0x1, text.encode())

    def send_close(self, code: int) -> None:
        self.send_frame(0x8, code.to_bytes(2, "big"))

    async def eof_within(self, seconds: float) -> bool:
        """True when the server closed TCP within ``seconds`` (no data may arrive)."""
        try:
            async with asyncio.timeout(seconds):
                data = await self.reader.read(1)
        except TimeoutError:
            return False
        assert data == b"", f"unexpected data after Close: {data!r}"
        return True

    def close(self) -> None:
        self.writer.close()


# -- the omni-sidecar command -------------------------------------------------------------------


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the CLI to completion: (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *cli_argv(*args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or clean_env(),
    )
    try:
        async with asyncio.timeout(DEADLINE * 2):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def assert_relayed_as_the_engine_wrote(proxied: list[str], direct: list[str]) -> None:
    """Every frame byte for byte as the engine wrote it, but for the resume token in
    ``session.created``: the client's copy is bound to its session and key
    (docs/design.md, Resume), and nothing else in that frame changes."""
    assert len(proxied) == len(direct), (len(proxied), len(direct))
    for got, sent in zip(proxied, direct, strict=True):
        engine_token = orjson.loads(sent).get("resume_token")
        if isinstance(engine_token, str):
            client_token = orjson.loads(got)["resume_token"]
            assert client_token.startswith(engine_token + "~"), (client_token, engine_token)
            sent = sent.replace(
                orjson.dumps(engine_token).decode(), orjson.dumps(client_token).decode()
            )
        assert got == sent
