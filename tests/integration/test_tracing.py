"""OpenTelemetry tracing (docs/design.md, Tracing), seen by an OTLP collector.

A real ``omni-sidecar serve`` child exports to an in-process OTLP/HTTP
collector (an aiohttp app on a free loopback port that decodes
``ExportTraceServiceRequest``); a scripted engine records the handshake
headers it got. ``OTEL_BSP_SCHEDULE_DELAY`` is short, and every test waits on
the spans it needs, with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.aiohttp_private import bound_port
from tests.conftest import DEADLINE, free_port, wait_until
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.helpers import AUDIO_DELTA, REPO_ROOT, clean_env, connect, run_cli
from tests.integration.served import Served, ready, serve

KIB = 1024
#: The client's own trace: W3C ``traceparent`` fields.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
#: Audio deltas of the first response: none of them may become a span.
DELTAS = 40


class Collector:
    """An OTLP/HTTP trace receiver on ``127.0.0.1:<free port>``."""

    def __init__(self) -> None:
        self.requests = 0
        self.spans: list[Span] = []
        self.services: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Collector:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = bound_port(site)
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.requests += 1
        for resource_spans in message.resource_spans:
            for kv in resource_spans.resource.attributes:
                if kv.key == "service.name":
                    self.services.add(kv.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, prefix: str) -> list[Span]:
        return [span for span in self.spans if span.name.startswith(prefix)]

    def response(self, response_id: str) -> Span | None:
        return next(
            (s for s in self.spans if attributes(s).get("gen_ai.response.id") == response_id),
            None,
        )


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def attributes(span: Any) -> dict[str, Any]:
    """A span's (or span event's) attributes as a dict."""
    return {kv.key: _value(kv.value) for kv in span.attributes}


def events(span: Span) -> dict[str, dict[str, Any]]:
    return {event.name: attributes(event) for event in span.events}


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    receiver = await Collector().start()
    yield receiver
    await receiver.aclose()


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


def otel_env(collector: Collector) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "20",
        "OTEL_SERVICE_NAME": "sidecar-under-test",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_SDK_DISABLED": "false",
    }


async def stop(server: Served) -> int:
    """SIGTERM the child this test started; its exit status once it exited."""
    server.proc.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(server.proc.wait, DEADLINE)


async def test_session_and_response_spans(
    tmp_path: Path, collector: Collector, engine: ScriptedEngine
) -> None:
    """A client ``traceparent`` is honoured and passed on; a response span per
    response with the GenAI attributes; a client cancel and a barge-in are
    events naming who cancelled; audio deltas make no spans."""
    with serve(tmp_path, engine.ws_url, "--tracing", "otlp", env=otel_env(collector)) as server:
        await ready(server)
        traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        url = server.ws + "?model=tiny-omni"
        async with connect(url, headers={"traceparent": traceparent}) as client:
            conn = await engine.next_connection()
            upstream_parent = conn.headers.get("traceparent", "")
            await conn.send({"type": "session.created", "session": {"id": "sess_e1"}})
            await client.recv_until("session.created")
            await client.send({"type": "response.create"})
            await conn.receive_until("response.create")
            r1_created_ns = time.time_ns()
            await conn.send({"type": "response.created", "response": {"id": "r1"}})
            for n in range(DELTAS):
                await conn.send({"type": AUDIO_DELTA, "response_id": "r1", "delta": "AAAA", "n": n})
            usage = {"input_tokens": 7, "output_tokens": 11, "total_tokens": 18}
            await conn.send(
                {
                    "type": "response.done",
                    "response": {"id": "r1", "status": "completed", "usage": usage},
                }
            )
            await client.recv_until("response.done")
            r2_created_ns = time.time_ns()
            await conn.send({"type": "response.created", "response": {"id": "r2"}})
            await client.recv_until("response.created")
            await client.send({"type": "response.cancel", "response_id": "r2"})
            await conn.receive_until("response.cancel")
            await conn.send(
                {"type": "response.done", "response": {"id": "r2", "status": "cancelled"}}
            )
            await client.recv_until("response.done")
            # A client barge-in cancels what is playing.
            await conn.send({"type": "response.created", "response": {"id": "r3"}})
            await client.recv_until("response.created")
            await client.send({"type": "barge_in"})
            await conn.receive_until("barge_in")
            await conn.send(
                {"type": "response.done", "response": {"id": "r3", "status": "cancelled"}}
            )
            await client.recv_until("response.done")
            await client.send({"type": "session.close"})
            await client.recv_until_closed()

        await wait_until(
            lambda: len(collector.named("realtime session")) == 1,
            what="the session span at the collector",
        )
        assert await stop(server) == 0
    session = collector.named("realtime session")[0]
    assert session.trace_id.hex() == CLIENT_TRACE
    assert session.parent_span_id.hex() == CLIENT_SPAN
    assert session.kind == Span.SPAN_KIND_SERVER
    assert session.status.code != Status.STATUS_CODE_ERROR
    s_attrs = attributes(session)
    assert s_attrs["proxy.session.outcome"] == "client_closed"
    assert s_attrs["omni_sidecar.close_code"] == 1000
    assert s_attrs["gen_ai.conversation.id"] == "sess_e1"
    assert collector.services == {"sidecar-under-test"}

    # The engine's handshake carried the session span as its parent.
    version, trace_id, parent_id, _flags = upstream_parent.split("-")
    assert (version, trace_id, parent_id) == ("00", CLIENT_TRACE, session.span_id.hex())

    r1, r2 = collector.response("r1"), collector.response("r2")
    assert r1 is not None and r2 is not None
    for span in (r1, r2):
        assert span.trace_id == session.trace_id
        assert span.parent_span_id == session.span_id
        assert span.name == "generate_content tiny-omni"
        assert span.kind == Span.SPAN_KIND_CLIENT
    # r1 starts at the client's response.create; r2 (none asked) at response.created.
    assert r1.start_time_unix_nano < r1_created_ns
    assert r2.start_time_unix_nano >= r2_created_ns
    a1 = attributes(r1)
    assert a1["gen_ai.operation.name"] == "generate_content"
    assert a1["gen_ai.request.model"] == "tiny-omni"
    assert a1["gen_ai.conversation.id"] == "sess_e1"
    assert (a1["gen_ai.usage.input_tokens"], a1["gen_ai.usage.output_tokens"]) == (7, 11)
    assert a1["gen_ai.response.finish_reasons"] == ["completed"]
    assert "response.cancelled" not in events(r1)
    assert attributes(r2)["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert events(r2)["response.cancelled"] == {"omni_sidecar.cancelled_by": "client"}
    r3 = collector.response("r3")
    assert r3 is not None
    assert events(r3)["response.cancelled"] == {"omni_sidecar.cancelled_by": "barge_in"}
    # Three responses, one session, 40 audio deltas: four spans, no more.
    assert len(collector.spans) == 4


async def test_overflow_is_an_event_and_an_error_end(
    tmp_path: Path, collector: Collector, engine: ScriptedEngine
) -> None:
    """A stalled client overflows its output bound: an ``output_backpressure`` event
    on the session and its response, and the session span ends in error."""
    flags = (
        "--tracing", "otlp", "--max-pending-output-bytes", str(256 * KIB),
        "--client-write-buffer-bytes", str(16 * KIB), "--playback-ack", "off",
    )  # fmt: skip
    with serve(tmp_path, engine.ws_url, *flags, env=otel_env(collector)) as server:
        await ready(server)
        overflows = 'omni_sidecar_overflows_total{policy="close_session"}'
        async with connect(server.ws, receive_buffer_bytes=64 * KIB) as client:
            conn = await engine.next_connection()
            await conn.send({"type": "response.created", "response": {"id": "r1"}})
            frame = {"type": AUDIO_DELTA, "response_id": "r1", "delta": "A" * (64 * KIB)}
            sent = 0
            while await server.metric(overflows) == 0:
                assert sent < 200, "no overflow after 12 MiB"
                await conn.send({**frame, "n": sent})
                sent += 1
            # The sidecar sends session.close; the scripted engine answers it and closes.
            await client.recv_until_closed()
        await wait_until(
            lambda: len(collector.named("realtime session")) == 1,
            what="the session span at the collector",
        )
    session = collector.named("realtime session")[0]
    assert session.status.code == Status.STATUS_CODE_ERROR
    assert attributes(session)["proxy.session.outcome"] == "overflow"
    assert events(session)["output_backpressure"] == {
        "omni_sidecar.overflow_policy": "close_session"
    }
    r1 = collector.response("r1")
    assert r1 is not None
    assert "output_backpressure" in events(r1)
    # Up to 200 audio deltas: one session span and one response span.
    assert len(collector.spans) == 2


async def test_sigterm_with_a_dead_collector_exits_within_a_few_seconds(
    tmp_path: Path, engine: ScriptedEngine
) -> None:
    """The collector's port refuses connections. The spans of one session are still
    queued at SIGTERM; the SDK alone would retry them for OTEL_EXPORTER_OTLP_TIMEOUT
    (10 s) per batch after "stopped". The export at exit gets EXPORT_AT_EXIT_SECONDS,
    so with nothing to drain the process exits within 5 s, status 0, and says why."""
    from proxy.session.tracing import EXPORT_AT_EXIT_SECONDS

    dead = free_port()  # nothing listens there
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}",
        "OTEL_BSP_SCHEDULE_DELAY": "60000",  # queued until the exit
        "OTEL_SDK_DISABLED": "false",
    }
    with serve(tmp_path, engine.ws_url, "--tracing", "otlp", env=env) as server:
        await ready(server)
        async with connect(server.ws) as client:
            conn = await engine.next_connection()
            await conn.send({"type": "session.created", "session": {"id": "sess_dead"}})
            await conn.send({"type": "response.created", "response": {"id": "r1"}})
            await conn.send({"type": "response.done", "response": {"id": "r1"}})
            await client.recv_until("response.done")
        await wait_until(lambda: _none_live(server), what="no session left")
        started = time.monotonic()
        status = await stop(server)
        took = time.monotonic() - started
        print(f"\nSIGTERM with a dead collector: exit {status} after {took:.2f} s")
        assert status == 0
        assert took < 5.0, took
        assert took >= EXPORT_AT_EXIT_SECONDS * 0.9, "the export at exit was not even tried"
        assert "the span export did not finish" in server.log()


async def _none_live(server: Served) -> bool:
    return await server.live_sessions() == 0


async def test_tracing_off_exports_nothing(
    tmp_path: Path, collector: Collector, engine: ScriptedEngine
) -> None:
    """Default settings with every OTEL_* variable pointing at a collector: a whole
    session and a clean stop later, the collector has heard nothing."""
    with serve(tmp_path, engine.ws_url, env=otel_env(collector)) as server:
        await ready(server)
        async with connect(server.ws) as client:
            conn = await engine.next_connection()
            assert "traceparent" not in conn.headers
            await conn.send({"type": "response.created", "response": {"id": "r1"}})
            await conn.send({"type": "response.done", "response": {"id": "r1"}})
            await client.recv_until("response.done")
            await client.send({"type": "session.close"})
            await client.recv_until_closed()
        assert await stop(server) == 0
    assert collector.requests == 0


_IMPORTS_CHECK = textwrap.dedent(
    """
    import sys
    from proxy.settings import Settings
    import proxy.cli, proxy.server, proxy.edge.client_app, proxy.session.relay, proxy.session.observer
    from proxy.startup import start_tracing

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    assert start_tracing(Settings(), env) is None
    off = {**env, "OTEL_SDK_DISABLED": "true"}
    assert start_tracing(Settings(tracing="otlp"), off) is None
    loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry", "proxy.session.tracing")))
    print(loaded)
    """
)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Off (the default, or OTEL_SDK_DISABLED=true): neither proxy.session.tracing nor
    any opentelemetry module is loaded in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTS_CHECK],
        capture_output=True, text=True, cwd=REPO_ROOT, env=clean_env(), timeout=DEADLINE,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


async def test_tracing_without_the_packages_is_a_config_error(engine: ScriptedEngine) -> None:
    """``tracing = "otlp"`` with OpenTelemetry missing: exit 2 and one line naming the fix."""
    shadow = REPO_ROOT / "tests" / "fakes" / "no_otel"
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    env = clean_env(PYTHONPATH=path, OTEL_SDK_DISABLED="false")
    status, _out, err = await run_cli(
        "serve", "--upstream", engine.ws_url, "--tracing", "otlp", env=env
    )
    assert status == 2, err
    assert "tracing" in err and "omni-sidecar[otel]" in err
    assert "Traceback" not in err


async def test_tracing_over_grpc_is_a_config_error(engine: ScriptedEngine) -> None:
    """Only OTLP/HTTP ships: asking for gRPC stops the start with exit 2."""
    env = clean_env(OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_SDK_DISABLED="false")
    status, _out, err = await run_cli(
        "serve", "--upstream", engine.ws_url, "--tracing", "otlp", env=env
    )
    assert status == 2, err
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in err
