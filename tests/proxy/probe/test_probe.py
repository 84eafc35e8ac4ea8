"""Tests for ``omni-sidecar probe`` against a scripted fake engine on 127.0.0.1:0.

The fake engine is defined here: it answers ``session.update`` with
``session.created``, each ``response.create`` with a few audio deltas of known
sizes and ``response.done``; in hold mode it sends only the first delta and
waits for ``response.cancel``, then sends two more deltas of the same response
(docs/engine-protocol.md, Late audio after a cancel) and ``response.done``
cancelled. Every wait is bounded by the probe's own deadline; nothing sleeps.

The probe's cancel figure is an amount of audio (frames and their decoded
length), so the tests pin it to known delta sizes, formats and rates, and feed
the recorder a burst with identical timestamps to show that wall time plays no
part in it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import wave
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, unused_port

from proxy.errors import ConfigError
from proxy.probe import (
    PlayoutBuffer,
    ProbeConnectError,
    ProbeError,
    ProbeOptions,
    ProbeResult,
    ProbeTimeout,
    _Recorder,
    add_probe_arguments,
    base64_decoded_length,
    format_result,
    main_probe,
    options_from_args,
    run_probe,
    voice_like_pcm16,
)

MS = 0.001 * float(os.environ.get("OMNI_SIDECAR_TESTS_TIMEOUT_FACTOR", "1"))
DEADLINE = 5000 * MS

#: (decoded bytes, sample_rate_hz or None for the 24 kHz default); 1000 bytes
#: needs "==" padding, 4801 needs "=".
DELTAS: tuple[tuple[int, int | None], ...] = ((960, None), (4801, 24000), (1000, 16000))

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


def seconds_of(deltas: tuple[tuple[int, int | None], ...]) -> float:
    return sum(size / 2 / (rate or 24000) for size, rate in deltas)


@dataclass
class FakeEngine:
    """A scripted engine; ``received`` records every client event."""

    audio_type: str = "response.output_audio.delta"
    hold_for_cancel: bool = False
    stale_after_cancel: int = 2
    stamp_seq: bool = False
    answer_session_update: bool = True
    reject_create: bool = False
    close_on_create: int | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    stamped: list[int] = field(default_factory=list)
    request_headers: dict[str, str] = field(default_factory=dict)

    def events(self, event_type: str) -> list[dict[str, Any]]:
        return [event for event in self.received if event["type"] == event_type]

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.request_headers = dict(request.headers)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        seq = 0

        async def send(event: dict[str, Any], *, journaled: bool = True) -> None:
            nonlocal seq
            if self.stamp_seq and journaled:
                seq += 1
                self.stamped.append(seq)
                event = {**event, "server_event_seq": seq}
            await ws.send_str(json.dumps(event))

        async def audio(response_id: str, size: int, rate: int | None) -> None:
            delta: dict[str, Any] = {
                "type": self.audio_type,
                "response_id": response_id,
                "item_id": f"item_{response_id}",
                "delta": base64.b64encode(bytes(size)).decode(),
            }
            if rate is not None:
                delta["sample_rate_hz"] = rate
            await send(delta)

        async def done(response_id: str, status: str) -> None:
            await send(
                {
                    "type": "response.done",
                    "response_id": response_id,
                    "response": {"status": status},
                }
            )

        count = 0
        active = ""
        async for message in ws:
            event = json.loads(message.data)
            self.received.append(event)
            kind = event["type"]
            if kind == "session.update" and self.answer_session_update:
                # session.created is not journaled, so it has no seq
                # (docs/engine-protocol.md, Conventions).
                await send(
                    {"type": "session.created", "session": {"id": "duplex-t"}}, journaled=False
                )
                await send({"type": "session.updated", "session": {"id": "duplex-t"}})
            elif kind == "input_audio_buffer.commit":
                await send({"type": "input_audio_buffer.committed", "item_id": f"item_{count}"})
            elif kind == "response.create":
                count += 1
                active = f"resp-{count}"
                if self.close_on_create == count:
                    await ws.close(code=1011, message=b"engine_dead")
                    break
                if self.reject_create:
                    await send(
                        {
                            "type": "error",
                            "error": {
                                "type": "invalid_request_error",
                                "code": "response_create_without_input",
                                "event_id": event.get("event_id"),
                            },
                        }
                    )
                    continue
                await send({"type": "response.created", "response": {"id": active}})
                for size, rate in DELTAS[:1] if self.hold_for_cancel else DELTAS:
                    await audio(active, size, rate)
                if not self.hold_for_cancel:
                    await done(active, "completed")
            elif kind == "response.cancel":
                for size, rate in DELTAS[1 : 1 + self.stale_after_cancel]:
                    await audio(active, size, rate)
                await done(active, "cancelled")
            elif kind == "session.close":
                await send({"type": "session.closed", "reason": "client_close"})
                await ws.close(code=1000)
        return ws


async def start(aiohttp_server: ServerFactory, engine: FakeEngine) -> str:
    app = web.Application()
    app.router.add_get("/v1/realtime", engine.handle)
    server = await aiohttp_server(app)
    return f"ws://{server.host}:{server.port}/v1/realtime"


def options(url: str, **overrides: Any) -> ProbeOptions:
    values: dict[str, Any] = {
        "url": url,
        "realtime": False,
        "timeout": DEADLINE,
        "input_seconds": 0.5,
        "append_ms": 100.0,
    }
    values.update(overrides)
    return ProbeOptions(**values)


def probe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-sidecar probe")
    add_probe_arguments(parser)
    return parser


class TestCompletedResponse:
    async def test_figures_without_cancel(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        result = await run_probe(options(await start(aiohttp_server, engine)))

        assert result.completed
        assert result.audio_frames == len(DELTAS)
        assert result.audio_seconds == pytest.approx(seconds_of(DELTAS), rel=1e-12)
        assert result.stale_audio_frames == 0
        assert result.stale_audio_seconds == 0.0
        assert result.cancels_sent == 0
        assert result.response_statuses == ["completed"]
        assert result.close_code == 1000
        assert result.session_closed_reason == "client_close"
        assert result.errors == []
        assert result.session_created_seconds is not None
        assert 0 < result.session_created_seconds < DEADLINE
        assert result.first_audio_seconds is not None
        assert 0 <= result.first_audio_seconds < DEADLINE
        assert result.event_types[0] == "session.created"
        assert result.event_types[-1] == "session.closed"
        assert engine.events("response.cancel") == []

    async def test_beta_audio_names_are_recognised(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(audio_type="response.audio.delta")
        result = await run_probe(options(await start(aiohttp_server, engine)))

        assert result.audio_frames == len(DELTAS)
        assert result.audio_seconds == pytest.approx(seconds_of(DELTAS), rel=1e-12)
        assert result.first_audio_seconds is not None

    async def test_client_events_in_order(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        await run_probe(options(await start(aiohttp_server, engine)))

        assert engine.received[0] == {
            "type": "session.update",
            "session": {"modalities": ["audio", "text"], "extra_body": {"auto_response": False}},
        }
        kinds = [event["type"] for event in engine.received]
        # 0.5 s at 16 kHz in 100 ms appends: five chunks of 1600 samples.
        assert kinds == [
            "session.update",
            *["input_audio_buffer.append"] * 5,
            "input_audio_buffer.commit",
            "response.create",
            "session.close",
        ]
        for append in engine.events("input_audio_buffer.append"):
            assert append["sample_rate_hz"] == 16000
            assert len(base64.b64decode(append["audio"])) == 3200

    async def test_responses_in_sequence(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        result = await run_probe(options(await start(aiohttp_server, engine), responses=2))

        assert result.completed
        assert result.response_statuses == ["completed", "completed"]
        assert len(result.response_first_audio_seconds) == 2
        assert result.audio_frames == 2 * len(DELTAS)
        assert result.audio_seconds == pytest.approx(2 * seconds_of(DELTAS), rel=1e-12)
        assert len(engine.events("input_audio_buffer.commit")) == 2
        assert len(engine.events("input_audio_buffer.append")) == 10

    async def test_event_ack_for_each_seq(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(stamp_seq=True)
        result = await run_probe(options(await start(aiohttp_server, engine), event_ack=True))

        assert result.completed
        acked = [event["server_event_seq"] for event in engine.events("session.event_ack")]
        # Every journaled event, session.closed included, is acked once in order;
        # the last ack may race the close, so it is allowed to be missing.
        assert acked == engine.stamped or acked == engine.stamped[:-1]
        assert len(acked) >= len(DELTAS) + 3

    async def test_no_event_ack_by_default(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(stamp_seq=True)
        await run_probe(options(await start(aiohttp_server, engine)))

        assert engine.events("session.event_ack") == []

    async def test_headers_are_sent(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        url = await start(aiohttp_server, engine)
        await run_probe(options(url, headers=(("X-Probe", "yes"), ("Authorization", "Bearer t"))))

        assert engine.request_headers["X-Probe"] == "yes"
        assert engine.request_headers["Authorization"] == "Bearer t"


class TestCancel:
    async def test_stale_audio_after_cancel(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(hold_for_cancel=True)
        url = await start(aiohttp_server, engine)
        # The first delta is 960 bytes at 24 kHz: exactly 20 ms.
        result = await run_probe(options(url, cancel_after_ms=20.0))

        assert engine.events("response.cancel") == [
            {"type": "response.cancel", "response_id": "resp-1"}
        ]
        assert result.completed
        assert result.response_statuses == ["cancelled"]
        assert result.audio_frames == 3
        assert result.stale_audio_frames == 2
        assert result.stale_audio_seconds == pytest.approx(seconds_of(DELTAS[1:3]), rel=1e-12)
        assert result.audio_seconds == pytest.approx(seconds_of(DELTAS), rel=1e-12)
        assert result.cancels_sent == 1
        assert result.close_code == 1000
        # 4801 bytes at 24 kHz and 1000 bytes at 16 kHz: 100.0 ms + 31.25 ms.
        assert format_result(result, as_json=False).splitlines()[4] == (
            "audio of the cancelled response received after the cancel: 2 frames, 131.3 ms of audio"
        )

    async def test_cancel_without_late_audio(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(hold_for_cancel=True, stale_after_cancel=0)
        result = await run_probe(options(await start(aiohttp_server, engine), cancel_after_ms=0))

        assert result.response_statuses == ["cancelled"]
        assert result.stale_audio_frames == 0
        assert result.stale_audio_seconds == 0.0
        assert result.cancels_sent == 1

    async def test_threshold_never_reached(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        url = await start(aiohttp_server, engine)
        result = await run_probe(options(url, cancel_after_ms=10_000.0))

        assert engine.events("response.cancel") == []
        assert result.stale_audio_frames == 0
        assert result.cancels_sent == 0
        assert result.response_statuses == ["completed"]

    async def test_each_response_is_cancelled(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(hold_for_cancel=True)
        url = await start(aiohttp_server, engine)
        result = await run_probe(options(url, cancel_after_ms=20.0, responses=2))

        cancels = engine.events("response.cancel")
        assert [cancel["response_id"] for cancel in cancels] == ["resp-1", "resp-2"]
        assert result.response_statuses == ["cancelled", "cancelled"]
        assert result.cancels_sent == 2
        assert result.stale_audio_frames == 4
        assert result.stale_audio_seconds == pytest.approx(2 * seconds_of(DELTAS[1:3]), rel=1e-12)


class TestFailures:
    async def test_timeout_carries_partial_result(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(answer_session_update=False)
        url = await start(aiohttp_server, engine)
        with pytest.raises(ProbeTimeout) as caught:
            await run_probe(options(url, timeout=200 * MS))

        assert isinstance(caught.value, TimeoutError)
        assert caught.value.stage == "session.created"
        assert caught.value.result.session_created_seconds is None
        assert not caught.value.result.completed

    async def test_http_error(self, aiohttp_server: ServerFactory) -> None:
        async def forbidden(request: web.Request) -> web.Response:
            return web.Response(status=403, text="no")

        app = web.Application()
        app.router.add_get("/v1/realtime", forbidden)
        server = await aiohttp_server(app)
        with pytest.raises(ProbeConnectError) as caught:
            await run_probe(options(f"ws://{server.host}:{server.port}/v1/realtime"))

        assert caught.value.status == 403
        assert "403" in str(caught.value)

    async def test_engine_closes_mid_session(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(close_on_create=1)
        result = await run_probe(options(await start(aiohttp_server, engine)))

        assert not result.completed
        assert result.close_code == 1011
        assert result.response_statuses == []

    async def test_rejected_create_does_not_hang(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine(reject_create=True)
        result = await run_probe(options(await start(aiohttp_server, engine), responses=2))

        assert not result.completed
        assert result.errors == ["response_create_without_input"] * 2
        assert result.close_code == 1000
        assert result.session_closed_reason == "client_close"

    async def test_stereo_wav_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "stereo.wav"
        with wave.open(str(path), "wb") as writer:
            writer.setnchannels(2)
            writer.setsampwidth(2)
            writer.setframerate(16000)
            writer.writeframes(bytes(400))
        with pytest.raises(ProbeError, match="PCM16 mono"):
            await run_probe(options("ws://127.0.0.1:1/v1/realtime", wav=path))

    async def test_missing_wav(self, tmp_path: Path) -> None:
        with pytest.raises(ProbeError, match="cannot read"):
            await run_probe(options("ws://127.0.0.1:1/", wav=tmp_path / "absent.wav"))


class TestInput:
    async def test_wav_input_is_streamed(
        self, aiohttp_server: ServerFactory, tmp_path: Path
    ) -> None:
        frames = bytes(range(256)) * 18 + bytes(192)  # 4800 bytes: 0.3 s at 8 kHz
        path = tmp_path / "input.wav"
        with wave.open(str(path), "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(2)
            writer.setframerate(8000)
            writer.writeframes(frames)
        engine = FakeEngine()
        url = await start(aiohttp_server, engine)
        result = await run_probe(options(url, wav=path, input_seconds=1.0))

        assert result.completed
        appends = engine.events("input_audio_buffer.append")
        assert len(appends) == 3  # 100 ms = 800 samples per append
        assert {append["sample_rate_hz"] for append in appends} == {8000}
        assert b"".join(base64.b64decode(append["audio"]) for append in appends) == frames

    def test_generated_signal(self) -> None:
        pcm = voice_like_pcm16(0.25, 16000)
        assert len(pcm) == 2 * 4000
        assert any(pcm)

    @pytest.mark.parametrize("size", range(12))
    def test_base64_length(self, size: int) -> None:
        text = base64.b64encode(bytes(size)).decode()
        assert base64_decoded_length(text) == size

    async def test_realtime_pacing(self, aiohttp_server: ServerFactory) -> None:
        engine = FakeEngine()
        url = await start(aiohttp_server, engine)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await run_probe(options(url, realtime=True, input_seconds=0.2, append_ms=50.0))

        assert result.completed
        # Four appends, the last one due 150 ms after the first.
        assert loop.time() - started >= 0.15
        assert len(engine.events("input_audio_buffer.append")) == 4


class TestOutput:
    def result(self) -> ProbeResult:
        return ProbeResult(
            session_created_seconds=0.0031,
            first_audio_seconds=0.012,
            audio_seconds=0.5,
            audio_frames=3,
            response_statuses=["completed"],
            event_types=["session.created", "response.done", "session.closed"],
            close_code=1000,
            session_closed_reason="client_close",
            completed=True,
        )

    def test_text(self) -> None:
        text = format_result(self.result(), as_json=False)

        assert "session.created after 3.1 ms" in text.splitlines()
        assert "close code: 1000" in text.splitlines()
        assert (
            "audio of the cancelled response received after the cancel: n/a (no cancel sent)"
            in text.splitlines()
        )
        assert not any("silence" in line for line in text.splitlines())

    def test_text_after_a_cancel(self) -> None:
        result = self.result()
        result.cancels_sent = 1
        result.stale_audio_frames = 3
        result.stale_audio_seconds = 3.0
        text = format_result(result, as_json=False)

        prefix = "audio of the cancelled response received after the cancel: "
        assert prefix + "3 frames, 3000.0 ms of audio" in text.splitlines()
        result.stale_audio_frames = 1
        result.stale_audio_seconds = 0.25
        assert (
            prefix + "1 frame, 250.0 ms of audio"
            in format_result(result, as_json=False).splitlines()
        )

    def test_json_parses(self) -> None:
        data = json.loads(format_result(self.result(), as_json=True))

        assert data["session_created_seconds"] == 0.0031
        assert data["stale_audio_frames"] == 0
        assert data["stale_audio_seconds"] == 0.0
        assert data["cancels_sent"] == 0
        assert "cancel_to_silence_seconds" not in data
        assert data["response_statuses"] == ["completed"]
        assert data["close_code"] == 1000


class TestCommandLine:
    def test_arguments(self) -> None:
        ns = probe_parser().parse_args(
            [
                "ws://h:1/v1/realtime",
                "--wav",
                "a.wav",
                "--input-seconds",
                "2",
                "--append-ms",
                "40",
                "--no-realtime",
                "--cancel-after-ms",
                "300",
                "--timeout",
                "9",
                "--header",
                "Authorization: Bearer x",
                "--header",
                "X-A:b",
                "--event-ack",
                "--responses",
                "3",
                "--json",
            ]
        )

        assert ns.json
        assert options_from_args(ns) == ProbeOptions(
            url="ws://h:1/v1/realtime",
            wav=Path("a.wav"),
            input_seconds=2.0,
            append_ms=40.0,
            realtime=False,
            cancel_after_ms=300.0,
            timeout=9.0,
            headers=(("Authorization", "Bearer x"), ("X-A", "b")),
            event_ack=True,
            responses=3,
        )

    def test_defaults(self) -> None:
        ns = probe_parser().parse_args([])

        assert options_from_args(ns) == ProbeOptions()
        assert not ns.json

    @pytest.mark.parametrize(
        "argv", [["--header", "novalue"], ["--append-ms", "0"], ["--responses", "0"]]
    )
    def test_bad_arguments(self, argv: list[str]) -> None:
        with pytest.raises(SystemExit):
            probe_parser().parse_args(argv)

    def test_options_are_validated(self) -> None:
        with pytest.raises(ConfigError):
            ProbeOptions(timeout=0)
        with pytest.raises(ConfigError):
            ProbeOptions(cancel_after_ms=-1.0)

    def test_connection_refused(self, capsys: pytest.CaptureFixture[str]) -> None:
        url = f"ws://127.0.0.1:{unused_port()}/v1/realtime"
        ns = probe_parser().parse_args([url, "--no-realtime", "--timeout", str(DEADLINE)])

        assert main_probe(ns) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1
        assert lines[0].startswith("omni-sidecar probe: error: cannot connect to " + url)

    async def test_success_prints_json(
        self, aiohttp_server: ServerFactory, capsys: pytest.CaptureFixture[str]
    ) -> None:
        url = await start(aiohttp_server, FakeEngine())
        ns = probe_parser().parse_args(
            [url, "--no-realtime", "--json", "--timeout", str(DEADLINE), "--input-seconds", "0.2"]
        )
        # main_probe calls asyncio.run, so it runs in a thread beside this loop.
        code = await asyncio.to_thread(main_probe, ns)

        assert code == 0
        data = json.loads(capsys.readouterr().out)
        assert data["completed"] is True
        assert data["close_code"] == 1000
        assert data["audio_frames"] == len(DELTAS)

    async def test_timeout_exit_code(
        self, aiohttp_server: ServerFactory, capsys: pytest.CaptureFixture[str]
    ) -> None:
        url = await start(aiohttp_server, FakeEngine(answer_session_update=False))
        ns = probe_parser().parse_args([url, "--no-realtime", "--timeout", str(200 * MS)])
        code = await asyncio.to_thread(main_probe, ns)

        assert code == 1
        captured = capsys.readouterr()
        assert "session.created after n/a" in captured.out
        assert captured.err.splitlines() == [
            f"omni-sidecar probe: error: timed out after {200 * MS:g} s waiting for session.created"
        ]


class TestRecorder:
    """The sans-I/O core, fed directly with events and timestamps."""

    def recorder(self, **overrides: Any) -> _Recorder:
        return _Recorder(options("ws://unused/", **overrides), started_at=10.0)

    def test_delta_without_response_id_belongs_to_current(self) -> None:
        recorder = self.recorder(cancel_after_ms=10.0)
        recorder.receive_event({"type": "session.created"}, 10.5)
        recorder.begin_response("create-1", 11.0)
        delta = {"type": "response.output_audio.delta", "delta": "AAAA" * 160}  # 480 bytes
        # 480 bytes at 24 kHz PCM16 is 10 ms: the threshold; no id known yet.
        assert recorder.receive_event(delta, 11.25) == [{"type": "response.cancel"}]
        recorder.cancel_sent(None, 11.3)
        assert recorder.receive_event(delta, 11.5) == []
        recorder.receive_event({"type": "response.done", "response": {"status": "cancelled"}}, 12)

        result = recorder.finish()
        assert result.session_created_seconds == 0.5
        assert result.first_audio_seconds == 0.25
        assert result.stale_audio_frames == 1
        assert result.stale_audio_seconds == pytest.approx(0.01)
        assert result.cancels_sent == 1
        assert result.completed

    def test_a_burst_of_stale_audio_counts_its_audio_length_not_wall_time(self) -> None:
        # The released engines deliver queued audio in one burst right after a
        # cancel: three 1 s chunks within the same millisecond are 3 s of old answer.
        recorder = self.recorder(cancel_after_ms=1000.0)
        recorder.begin_response("create-1", 0.0)
        recorder.receive_event({"type": "response.created", "response_id": "r1"}, 0.1)
        one_second = {
            "type": "response.output_audio.delta",
            "response_id": "r1",
            "delta": base64.b64encode(bytes(48_000)).decode(),  # 1 s of PCM16 at 24 kHz
        }
        assert recorder.receive_event(one_second, 1.0) == [
            {"type": "response.cancel", "response_id": "r1"}
        ]
        recorder.cancel_sent("r1", 1.0)
        for _ in range(3):
            recorder.receive_event(one_second, 1.0005)

        assert recorder.result.stale_audio_frames == 3
        assert recorder.result.stale_audio_seconds == pytest.approx(3.0, rel=1e-12)

    def test_audio_before_the_cancel_is_not_stale(self) -> None:
        recorder = self.recorder(cancel_after_ms=20.0)
        recorder.begin_response("create-1", 0.0)
        recorder.receive_event({"type": "response.created", "response_id": "r1"}, 0.1)
        ten_ms = {"type": "response.output_audio.delta", "response_id": "r1", "delta": "AAAA" * 160}
        assert recorder.receive_event(ten_ms, 0.2) == []
        assert recorder.receive_event(ten_ms, 0.3) == [
            {"type": "response.cancel", "response_id": "r1"}
        ]
        # Audio of another response is never counted as stale audio of this one.
        other = {**ten_ms, "response_id": "r2"}
        recorder.cancel_sent("r1", 0.31)
        recorder.receive_event(other, 0.4)

        assert recorder.result.stale_audio_frames == 0
        assert recorder.result.audio_frames == 3

    def test_session_output_format_sets_the_audio_length(self) -> None:
        recorder = self.recorder()
        created = {
            "type": "session.created",
            "session": {"audio": {"output": {"format": "pcm_f32le", "sample_rate_hz": 16000}}},
        }
        recorder.receive_event(created, 1.0)
        # 64 bytes of float32 at 16 kHz = 1 ms (as PCM16 at 24 kHz it would read 1.33 ms).
        sixty_four = base64.b64encode(bytes(64)).decode()
        recorder.receive_event({"type": "response.output_audio.delta", "delta": sixty_four}, 1.1)
        assert recorder.result.audio_seconds == pytest.approx(0.001, rel=1e-12)

        # OpenAI GA shape in a later session.updated: G.711 µ-law at 8 kHz.
        updated = {
            "type": "session.updated",
            "session": {"audio": {"output": {"format": {"type": "audio/pcmu", "rate": 8000}}}},
        }
        recorder.receive_event(updated, 1.2)
        recorder.receive_event({"type": "response.output_audio.delta", "delta": sixty_four}, 1.3)
        assert recorder.result.audio_seconds == pytest.approx(0.001 + 0.008, rel=1e-12)

        # The delta's own format and rate win over the session's.
        own = {"format": "pcm16", "sample_rate_hz": 32000}
        recorder.receive_event({"type": "response.audio.delta", "delta": sixty_four, **own}, 1.4)
        assert recorder.result.audio_seconds == pytest.approx(0.001 + 0.008 + 0.001, rel=1e-12)

    def test_beta_session_output_audio_format(self) -> None:
        recorder = self.recorder()
        created = {"type": "session.created", "session": {"output_audio_format": "g711_alaw"}}
        recorder.receive_event(created, 1.0)
        recorder.receive_event(
            {"type": "response.audio.delta", "delta": base64.b64encode(bytes(24)).decode()}, 1.1
        )
        assert recorder.result.audio_seconds == pytest.approx(24 / 1 / 24000, rel=1e-12)

    def test_formats_and_rates(self) -> None:
        recorder = self.recorder()
        four_bytes = base64.b64encode(bytes(4)).decode()
        for extra in ({"format": "pcm_f32le"}, {"format": "g711_ulaw"}, {"sample_rate_hz": 0}):
            delta = {"type": "response.audio.delta", "delta": four_bytes, **extra}
            recorder.receive_event(delta, 1.0)

        assert recorder.result.audio_seconds == pytest.approx(
            (4 / 4 + 4 / 1 + 4 / 2) / 24000, rel=1e-12
        )

    def test_error_shapes_and_malformed_frames(self) -> None:
        recorder = self.recorder()
        recorder.receive_event({"type": "error", "error": {"code": "bad_event"}}, 1.0)
        recorder.receive_event({"type": "error", "error": "denied", "code": "capacity"}, 1.0)
        recorder.receive_event({"type": "error"}, 1.0)
        recorder.receive_event({"no_type": True}, 1.0)
        recorder.receive_malformed()

        assert recorder.result.errors == ["bad_event", "capacity", "unknown"]
        assert recorder.result.event_types[-2:] == ["<untyped>", "<malformed>"]

    def test_audio_of_finished_response_is_not_first_audio(self) -> None:
        recorder = self.recorder()
        recorder.begin_response("create-1", 0.0)
        recorder.receive_event({"type": "response.created", "response_id": "r1"}, 0.1)
        recorder.receive_event({"type": "response.done", "response_id": "r1"}, 0.2)
        recorder.begin_response("create-2", 1.0)
        late = {"type": "response.output_audio.delta", "response_id": "r1", "delta": "AAAA"}
        recorder.receive_event(late, 1.1)

        assert recorder.result.first_audio_seconds is None
        assert recorder.result.audio_frames == 1
        assert recorder.result.response_statuses == ["unknown"]


def pcm16_delta(response_id: str, ms: int) -> dict[str, Any]:
    """An audio delta of ``ms`` milliseconds of PCM16 at 24 kHz (48 bytes per ms)."""
    return {
        "type": "response.output_audio.delta",
        "response_id": response_id,
        "delta": base64.b64encode(bytes(48 * ms)).decode(),
    }


class TestPlayout:
    """The 1x playout model of a client that does not clear its buffer, on injected times."""

    def test_fast_generation_leaves_the_unplayed_rest_and_late_audio_to_be_heard(self) -> None:
        # Four 200 ms deltas generated at 4x arrive every 50 ms; the cancel at
        # 300 ms finds 300 ms played and 500 ms queued; two late deltas add 400 ms.
        playout = PlayoutBuffer()
        for n in range(4):
            playout.add("r1", 0.2, 10.0 + 0.05 * n)
        playout.cancel("r1", 10.3)
        playout.add("r1", 0.2, 10.35)
        playout.add("r1", 0.2, 10.36)

        assert playout.played_at_cancel("r1") == pytest.approx(0.3, abs=1e-9)
        assert playout.heard_after_cancel("r1") == pytest.approx(0.5 + 0.4, abs=1e-9)
        assert playout.total_heard_after_cancel() == pytest.approx(0.9, abs=1e-9)

    def test_real_time_delivery_leaves_only_the_rest_of_the_playing_delta(self) -> None:
        playout = PlayoutBuffer()
        for n in range(3):  # each 200 ms delta arrives as the previous one ends
            playout.add("r1", 0.2, 5.0 + 0.2 * n)
        playout.cancel("r1", 5.45)  # 50 ms into the third delta
        for n in range(3, 5):  # the engine's late deltas, still at real time
            playout.add("r1", 0.2, 5.0 + 0.2 * n)

        assert playout.played_at_cancel("r1") == pytest.approx(0.45, abs=1e-9)
        assert playout.heard_after_cancel("r1") == pytest.approx(0.15 + 0.4, abs=1e-9)

    def test_an_underrun_pauses_playback_until_audio_arrives(self) -> None:
        playout = PlayoutBuffer()
        playout.add("r1", 0.1, 0.0)  # plays 0.0-0.1
        playout.add("r1", 0.1, 0.5)  # silence, then plays 0.5-0.6
        playout.cancel("r1", 0.55)

        assert playout.played_at_cancel("r1") == pytest.approx(0.15, abs=1e-9)
        assert playout.heard_after_cancel("r1") == pytest.approx(0.05, abs=1e-9)

    def test_a_cancel_after_everything_played_hears_nothing_more(self) -> None:
        playout = PlayoutBuffer()
        playout.add("r1", 0.2, 1.0)
        playout.cancel("r1", 2.0)
        playout.cancel("r1", 3.0)  # a second cancel does not move the moment

        assert playout.heard_after_cancel("r1") == 0.0
        assert playout.played_at_cancel("r1") == pytest.approx(0.2, abs=1e-9)

    def test_queued_audio_of_an_earlier_response_delays_the_next_one(self) -> None:
        # r1's 1 s arrives at once and plays 0-1; r2's delta arriving at 0.5
        # plays 1.0-1.2. A cancel of r2 at 1.1 leaves 100 ms of r2 (r1 is not counted).
        playout = PlayoutBuffer()
        playout.add("r1", 1.0, 0.0)
        playout.add("r2", 0.2, 0.5)
        playout.cancel("r2", 1.1)

        assert playout.heard_after_cancel("r2") == pytest.approx(0.1, abs=1e-9)
        assert playout.heard_after_cancel("r1") is None
        assert playout.played_at_cancel("r2") == pytest.approx(0.1, abs=1e-9)

    def test_nothing_cancelled(self) -> None:
        playout = PlayoutBuffer()
        playout.add("r1", 0.2, 0.0)

        assert playout.total_heard_after_cancel() is None
        assert playout.played_at_cancel("r1") is None
        assert playout.heard_after_cancel("unknown") is None

    def test_recorder_reports_the_buffered_rest_without_any_late_delta(self) -> None:
        # The probe cancels after 1000 ms received; at 4x that is 250 ms after the
        # first delta: 750 ms are still queued although no delta comes late.
        recorder = _Recorder(options("ws://unused/", cancel_after_ms=1000.0), started_at=0.0)
        recorder.receive_event({"type": "session.created"}, 0.0)
        recorder.begin_response("create-1", 1.0)
        recorder.receive_event({"type": "response.created", "response_id": "r1"}, 1.0)
        replies: list[dict[str, Any]] = []
        for n in range(5):
            replies = recorder.receive_event(pcm16_delta("r1", 200), 2.0 + 0.05 * n)
        assert replies == [{"type": "response.cancel", "response_id": "r1"}]
        recorder.cancel_sent("r1", 2.25)
        recorder.receive_event(
            {"type": "response.done", "response_id": "r1", "response": {"status": "cancelled"}}, 2.3
        )
        result = recorder.finish()

        assert result.stale_audio_seconds == 0.0
        assert result.old_answer_heard_after_barge_in_ms == pytest.approx(750.0, abs=1e-6)
        assert (
            "old answer heard after barge-in: 750.0 ms"
            in format_result(result, as_json=False).splitlines()
        )
        data = json.loads(format_result(result, as_json=True))
        assert data["old_answer_heard_after_barge_in_ms"] == pytest.approx(750.0, abs=1e-6)

    def test_recorder_adds_late_audio_and_sums_cancelled_responses(self) -> None:
        recorder = _Recorder(options("ws://unused/", cancel_after_ms=200.0), started_at=0.0)
        for index, (rid, t0) in enumerate((("r1", 1.0), ("r2", 5.0)), start=1):
            recorder.begin_response(f"create-{index}", t0)
            recorder.receive_event({"type": "response.created", "response_id": rid}, t0)
            assert recorder.receive_event(pcm16_delta(rid, 200), t0 + 0.1) != []
            recorder.cancel_sent(rid, t0 + 0.15)  # 50 ms played, 150 ms queued
            recorder.receive_event(pcm16_delta(rid, 100), t0 + 0.16)  # late: 100 ms more
            recorder.receive_event({"type": "response.done", "response_id": rid}, t0 + 0.2)

        result = recorder.finish()
        assert result.stale_audio_seconds == pytest.approx(0.2, abs=1e-9)
        assert result.old_answer_heard_after_barge_in_ms == pytest.approx(500.0, abs=1e-6)

    def test_no_cancel_prints_not_applicable(self) -> None:
        recorder = _Recorder(options("ws://unused/"), started_at=0.0)
        recorder.receive_event(pcm16_delta("r1", 200), 1.0)
        result = recorder.finish()

        assert result.old_answer_heard_after_barge_in_ms is None
        assert (
            "old answer heard after barge-in: n/a (no cancel sent)"
            in format_result(result, as_json=False).splitlines()
        )
        assert (
            json.loads(format_result(result, as_json=True))["old_answer_heard_after_barge_in_ms"]
            is None
        )

    async def test_over_a_socket_late_audio_is_heard_after_the_cancel(
        self, aiohttp_server: ServerFactory
    ) -> None:
        engine = FakeEngine(hold_for_cancel=True)
        url = await start(aiohttp_server, engine)
        result = await run_probe(options(url, cancel_after_ms=20.0))

        # The two late deltas (131.25 ms) play in full after the cancel, plus
        # whatever of the 20 ms first delta had not played when the cancel went out.
        late_ms = seconds_of(DELTAS[1:3]) * 1000.0
        heard = result.old_answer_heard_after_barge_in_ms
        assert heard is not None
        assert late_ms <= heard <= late_ms + 20.0 + 1e-6
        lines = format_result(result, as_json=False).splitlines()
        assert lines[5] == f"old answer heard after barge-in: {heard:.1f} ms"
