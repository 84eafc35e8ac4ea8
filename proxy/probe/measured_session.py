"""The probe's asyncio/aiohttp shell: one realtime session, driven and measured.

:func:`run_probe` opens the WebSocket, runs a reader task that feeds every
frame to the :class:`~proxy.probe.recorder.Recorder` (sending its
replies) and a driver that streams the input, requests the responses and
closes. It reads ``time.monotonic()`` because it is the I/O layer; the
recorder never does. Every wait is bounded by ``ProbeOptions.timeout`` and the
closing steps by :data:`DEFAULT_CLOSE_TIMEOUT`.
"""

from __future__ import annotations

import asyncio
import base64
import time
import wave
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import orjson

from proxy.probe.options import (
    SECONDS,
    ProbeConnectError,
    ProbeError,
    ProbeOptions,
    ProbeResult,
    ProbeTimeout,
)
from proxy.probe.playout import GENERATED_SAMPLE_RATE_HZ, voice_like_pcm16
from proxy.probe.recorder import Recorder

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "MAX_MSG_BYTES", "run_probe"]

MAX_MSG_BYTES: Final = 64 * 1024 * 1024
#: Bound on each closing step: waiting for ``session.closed``, then the close frame.
DEFAULT_CLOSE_TIMEOUT: Final = 5 * SECONDS


@dataclass(frozen=True, slots=True)
class _InputAudio:
    pcm: bytes
    sample_rate_hz: int


def _load_input_audio(options: ProbeOptions) -> _InputAudio:
    if options.wav is None:
        rate = GENERATED_SAMPLE_RATE_HZ
        return _InputAudio(voice_like_pcm16(options.input_seconds, rate), rate)
    try:
        with wave.open(str(options.wav), "rb") as reader:
            if reader.getnchannels() != 1 or reader.getsampwidth() != 2:
                raise ProbeError(f"{options.wav}: not a PCM16 mono WAV file")
            rate = reader.getframerate()
            pcm = reader.readframes(max(1, round(options.input_seconds * rate)))
    except (OSError, EOFError, wave.Error) as exc:
        raise ProbeError(f"cannot read {options.wav}: {exc}") from exc
    if not pcm:
        raise ProbeError(f"{options.wav}: no audio frames")
    return _InputAudio(pcm, rate)


class _Sender:
    """Serialises sends from the driver and the reader; False once the socket is gone."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._lock = asyncio.Lock()

    async def send(self, event: Mapping[str, Any]) -> bool:
        async with self._lock:
            if self._ws.closed:
                return False
            try:
                await self._ws.send_str(orjson.dumps(event).decode())
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too
                return False
            return True


class _Changes:
    """Wakes the driver whenever the reader has recorded something."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._event.clear()
            await self._event.wait()


async def _read_events(
    ws: aiohttp.ClientWebSocketResponse, recorder: Recorder, sender: _Sender, changes: _Changes
) -> None:
    try:
        async for message in ws:  # ends on CLOSE/CLOSING/CLOSED; autoclose answers the close
            now = time.monotonic()
            if message.type is aiohttp.WSMsgType.ERROR:
                break
            if message.type is not aiohttp.WSMsgType.TEXT:
                continue
            try:
                event = orjson.loads(message.data)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                recorder.receive_malformed()
                continue
            for reply in recorder.receive_event(event, now):
                sent_at = time.monotonic()
                if await sender.send(reply) and reply["type"] == "response.cancel":
                    recorder.cancel_sent(reply.get("response_id"), sent_at)
            changes.notify()
    finally:
        recorder.closed = True
        changes.notify()


async def _stream_input(sender: _Sender, audio: _InputAudio, options: ProbeOptions) -> bool:
    rate = audio.sample_rate_hz
    chunk_bytes = 2 * max(1, round(rate * options.append_ms / 1000.0))
    started_at = time.monotonic()
    for offset in range(0, len(audio.pcm), chunk_bytes):
        if options.realtime:
            delay = started_at + offset / 2 / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        chunk = audio.pcm[offset : offset + chunk_bytes]
        append = {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(chunk).decode("ascii"),
            "format": "pcm16",
            "sample_rate_hz": rate,
        }
        if not await sender.send(append):
            return False
    return True


async def _drive(
    options: ProbeOptions,
    audio: _InputAudio,
    recorder: Recorder,
    sender: _Sender,
    changes: _Changes,
) -> None:
    recorder.stage = "session.created"
    update = {
        "type": "session.update",
        "session": {"modalities": ["audio", "text"], "extra_body": {"auto_response": False}},
    }
    if not await sender.send(update):
        return
    await changes.wait_until(lambda: recorder.session_created or recorder.closed)
    for index in range(1, options.responses + 1):
        if recorder.closed:
            return
        recorder.stage = f"input audio {index}/{options.responses}"
        if not await _stream_input(sender, audio, options):
            return
        if not await sender.send({"type": "input_audio_buffer.commit"}):
            return
        recorder.stage = f"response.done {index}/{options.responses}"
        create_id = f"probe_response_create_{index}"
        recorder.begin_response(create_id, time.monotonic())
        if not await sender.send({"type": "response.create", "event_id": create_id}):
            return
        await changes.wait_until(lambda: not recorder.in_response or recorder.closed)
    if recorder.closed:
        return
    recorder.stage = "session.closed"
    if await sender.send({"type": "session.close"}):
        try:
            async with asyncio.timeout(DEFAULT_CLOSE_TIMEOUT):
                await changes.wait_until(lambda: recorder.session_closed or recorder.closed)
            recorder.stage = "the close frame"
            async with asyncio.timeout(DEFAULT_CLOSE_TIMEOUT):
                await changes.wait_until(lambda: recorder.closed)
        except TimeoutError:
            pass  # bounded courtesy waits; we close ourselves below


async def _run_session(options: ProbeOptions, audio: _InputAudio, recorder: Recorder) -> None:
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(
                options.url,
                headers=list(options.headers),
                max_msg_size=MAX_MSG_BYTES,
                compress=0,
                timeout=aiohttp.ClientWSTimeout(ws_close=DEFAULT_CLOSE_TIMEOUT),
            )
        except aiohttp.WSServerHandshakeError as exc:
            detail = f"HTTP {exc.status} {exc.message}".strip()
            raise ProbeConnectError(options.url, detail, status=exc.status) from exc
        except aiohttp.ClientConnectorError as exc:
            raise ProbeConnectError(options.url, str(exc.os_error) or str(exc)) from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise ProbeConnectError(options.url, str(exc) or type(exc).__name__) from exc
        sender = _Sender(ws)
        changes = _Changes()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_read_events(ws, recorder, sender, changes))
                await _drive(options, audio, recorder, sender, changes)
                await ws.close()  # no-op when the server already closed; ends the reader
        except BaseExceptionGroup as exc_group:
            if len(exc_group.exceptions) == 1:
                raise exc_group.exceptions[0] from exc_group
            raise
        finally:
            await ws.close()  # bounded by ws_close
            recorder.result.close_code = ws.close_code


async def run_probe(options: ProbeOptions) -> ProbeResult:
    """Run one realtime session against ``options.url`` and measure it.

    Sends ``session.update``, waits for ``session.created``, then for each
    response streams the input, commits, sends ``response.create`` and waits
    for ``response.done`` (cancelling on the way when asked); finally sends
    ``session.close`` and waits, bounded, for ``session.closed`` and the close.

    Args:
        options: What to do.

    Returns:
        The measurements; check :attr:`ProbeResult.completed`.

    Raises:
        ProbeConnectError: The WebSocket could not be opened.
        ProbeTimeout: ``options.timeout`` passed; it carries the partial result.
        ProbeError: The WAV input could not be used.
    """
    audio = _load_input_audio(options)
    recorder = Recorder(options, time.monotonic())
    deadline = asyncio.timeout(options.timeout)
    try:
        async with deadline:
            await _run_session(options, audio, recorder)
    except TimeoutError as exc:
        if not deadline.expired():
            raise ProbeError(f"timeout inside aiohttp: {exc}") from exc
        raise ProbeTimeout(options.timeout, recorder.stage, recorder.finish()) from None
    return recorder.finish()
