"""``SessionTrace`` (proxy/session/tracing.py): one session's spans, as a collector gets them.

A session span (the client's ``traceparent`` its parent) with one child span per
response, from the client's ``response.create`` to its ``response.done``; at most
``MAX_OPEN_RESPONSE_SPANS`` open; the session's end closes what is left.
"""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.core.events import classify_client, classify_upstream
from proxy.session.tracing import MAX_OPEN_RESPONSE_SPANS, SessionTrace
from tests.proxy.core.helpers import (
    b_response_cancel,
    b_response_create,
    dumps,
    response_created,
    response_done,
    session_created,
)

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _trace(exporter: InMemorySpanExporter, headers: dict[str, str] | None = None) -> SessionTrace:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    propagator = TraceContextTextMapPropagator()
    parent = propagator.extract(headers or {})
    return SessionTrace(provider.get_tracer("test"), propagator, parent, "s1", "qwen-omni")


def _spans(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def _engine(trace: SessionTrace, *frames: str) -> None:
    for text in frames:
        trace.upstream_event(classify_upstream(text))


def test_the_session_span_continues_the_clients_trace_and_the_engine_is_told() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter, {"traceparent": PARENT})
    headers: dict[str, str] = {}
    trace.upstream_headers(headers)
    assert headers["traceparent"].split("-")[1] == PARENT.split("-")[1]
    _engine(trace, session_created("duplex-1"))
    trace.end("client_closed", 1000)
    span = _spans(exporter)["realtime session"]
    assert span.parent is not None and span.parent.span_id == int(PARENT.split("-")[2], 16)
    assert span.attributes is not None
    assert span.attributes["gen_ai.conversation.id"] == "duplex-1"
    assert span.attributes["proxy.session.outcome"] == "client_closed"
    assert span.status.status_code is StatusCode.UNSET


def test_a_response_span_runs_from_the_request_to_its_done_with_its_usage() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    trace.client_event(classify_client(b_response_create()))
    done = dumps(
        {
            "type": "response.done",
            "response_id": "r1",
            "response": {"id": "r1", "status": "completed", "usage": {"output_tokens": 7}},
        }
    )
    _engine(trace, response_created("r1"), done)
    (span,) = exporter.get_finished_spans()
    assert span.name == "generate_content qwen-omni"
    assert span.attributes is not None
    assert span.attributes["gen_ai.response.id"] == "r1"
    assert span.attributes["gen_ai.usage.output_tokens"] == 7
    assert span.attributes["gen_ai.response.finish_reasons"] == ("completed",)
    assert span.start_time is not None and span.end_time is not None


def test_a_cancel_is_recorded_once_naming_who_asked() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    _engine(trace, response_created("r1"))
    trace.client_event(classify_client(b_response_cancel("r1")))
    trace.cancelled(["r1"])
    _engine(trace, response_done("r1", "cancelled"))
    (span,) = exporter.get_finished_spans()
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    assert events == [("response.cancelled", {"omni_sidecar.cancelled_by": "client"})]


def test_a_failed_response_is_an_error_span() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    _engine(trace, response_created("r1"), response_done("r1", "failed", reason="engine"))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes["error.type"] == "failed"


def test_one_response_span_too_many_ends_the_oldest_as_evicted() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    _engine(trace, *(response_created(f"r{i}") for i in range(MAX_OPEN_RESPONSE_SPANS + 1)))
    (evicted,) = exporter.get_finished_spans()
    assert evicted.attributes is not None
    assert evicted.attributes["gen_ai.response.id"] == "r0"
    assert evicted.attributes["gen_ai.response.finish_reasons"] == ("evicted",)


def test_the_end_closes_open_responses_and_an_abnormal_outcome_is_an_error() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    _engine(trace, response_created("r1"))
    trace.end("overflow", 1008)
    trace.end("client_closed", 1000)  # once only
    spans = _spans(exporter)
    assert len(exporter.get_finished_spans()) == 2
    session = spans["realtime session"]
    assert session.status.status_code is StatusCode.ERROR
    assert session.attributes is not None and session.attributes["omni_sidecar.close_code"] == 1008
    response = spans["generate_content qwen-omni"]
    assert response.attributes is not None
    assert response.attributes["gen_ai.response.finish_reasons"] == ("session_ended",)


def test_a_refused_session_ends_its_span_as_refused() -> None:
    exporter = InMemorySpanExporter()
    trace = _trace(exporter)
    trace.refused("quota_exceeded")
    trace.end("client_closed", 1000)
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["proxy.session.outcome"] == "refused"
    assert span.status.status_code is StatusCode.ERROR
