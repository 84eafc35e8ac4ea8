"""OpenTelemetry tracing: a span per session, a child span per response.

Imported only when ``tracing = "otlp"`` (:func:`proxy.startup.start_tracing`):
with tracing off neither this module nor any ``opentelemetry`` package is
loaded. The observer calls a session's :class:`SessionTrace` through the
:class:`proxy.session.observer.SessionTracer` protocol, for response-level
events only (never per audio delta). The spans, their attributes, the
exporter and the bounds: docs/design.md, Tracing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.core.events import ClientEvent, ClientKind, EventKind, UpstreamEvent
from proxy.core.response_requests import MAX_PENDING_CREATES

__all__ = [
    "EXPORT_AT_EXIT_SECONDS",
    "GEN_AI_OPERATION",
    "MAX_OPEN_RESPONSE_SPANS",
    "OtlpTracing",
    "SessionTrace",
]

log = logging.getLogger("omni_sidecar.tracing")

#: Seconds the export of queued spans may take at exit; what is not exported by
#: then is dropped (one WARNING), so SIGTERM exits within drain_timeout plus a few
#: seconds even when the collector does not answer.
EXPORT_AT_EXIT_SECONDS: Final = 3.0
#: ``gen_ai.operation.name``: the semantic conventions' well-known value for
#: multimodal generation (a realtime response is audio and text out).
GEN_AI_OPERATION: Final = "generate_content"
#: ``gen_ai.provider.name`` (not one of the well-known values: a custom one).
_PROVIDER: Final = "vllm_omni"
#: Response spans open at once per session (spans); one more ends the oldest.
MAX_OPEN_RESPONSE_SPANS: Final = 32
#: Outcomes (proxy.core.session_core.Outcome values) that end the session span in error.
_ABNORMAL: Final = frozenset({"overflow", "engine_unavailable", "error", "rate_limited"})
#: Who cancelled, by the client event that asked.
_CANCELLED_BY: Final = {
    ClientKind.RESPONSE_CANCEL: "client",
    ClientKind.OUTPUT_AUDIO_BUFFER_CLEAR: "client",
    ClientKind.INPUT_CANCEL: "client",
    ClientKind.BARGE_IN: "barge_in",
    ClientKind.TURN_SIGNAL: "barge_in",
}
_INSTRUMENTATION: Final = "omni_sidecar"
_DEFAULT_SERVICE: Final = "omni-sidecar"


class OtlpTracing:
    """The process's tracer provider and OTLP/HTTP exporter (``OTEL_*`` configured).

    Args:
        environ: the process environment (``OTEL_SERVICE_NAME``; the SDK and
            the exporter read the other ``OTEL_*`` variables themselves).
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        attributes: dict[str, Any] = {}
        if not environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = _DEFAULT_SERVICE
        self._provider = TracerProvider(
            resource=Resource.create(attributes), shutdown_on_exit=False
        )
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer(_INSTRUMENTATION)
        self._propagator = TraceContextTextMapPropagator()

    def session(self, key: str, headers: Mapping[str, str], *, model: str | None) -> SessionTrace:
        """Start the session span (the client's ``traceparent`` as its parent, if valid)."""
        parent = self._propagator.extract(headers)
        return SessionTrace(self._tracer, self._propagator, parent, key, model)

    def shutdown(self, timeout: float = EXPORT_AT_EXIT_SECONDS) -> None:
        """Export what is queued, for at most ``timeout`` seconds, and stop.

        The SDK's shutdown runs in a daemon thread of its own; when it is not done
        in time (a collector that refuses or never answers) the process goes on
        to exit without it, and the spans it still held are lost.
        """
        done = threading.Event()

        def export_and_stop() -> None:
            try:
                self._provider.shutdown()
            finally:
                done.set()

        threading.Thread(
            target=export_and_stop, name="omni-sidecar-trace-exit", daemon=True
        ).start()
        if not done.wait(timeout):
            log.warning(
                "tracing: the span export did not finish within %.0f s at exit (is the "
                "collector reachable?); the spans not exported yet are dropped",
                timeout,
            )


class SessionTrace:
    """One session's spans (implements ``proxy.session.observer.SessionTracer``).

    Args:
        tracer: where spans come from.
        propagator: W3C trace context, for the engine's handshake.
        parent: the client's trace context (empty: a new trace).
        key: the sidecar's session key.
        model: the client's ``?model=`` (``gen_ai.request.model``).
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        propagator: TraceContextTextMapPropagator,
        parent: Context,
        key: str,
        model: str | None,
    ) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._model = model
        self._span = tracer.start_span(
            "realtime session",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"proxy.session.id": key},
        )
        self._context = trace.set_span_in_context(self._span)
        self._conversation = key
        self._ended = False
        self._responses: dict[str, Span] = {}
        self._cancel_reported: set[str] = set()
        #: ``response.create`` times awaiting their ``response.created``, as many as the
        #: core remembers (the oldest dropped).
        self._creates: deque[int] = deque(maxlen=MAX_PENDING_CREATES)
        self._cancelled_by = "engine"

    # -- the handshake ---------------------------------------------------------------------

    def upstream_headers(self, headers: dict[str, str]) -> None:
        self._propagator.inject(headers, context=self._context)

    def refused(self, reason: str) -> None:
        if self._ended:
            return
        self._span.set_attribute("proxy.session.outcome", "refused")
        self._span.set_attribute("omni_sidecar.refusal", reason)
        self._span.set_status(Status(StatusCode.ERROR, reason))
        self._finish()

    # -- events (response-level only) -------------------------------------------------------

    def client_event(self, event: ClientEvent) -> None:
        if event.kind is ClientKind.RESPONSE_CREATE:
            self._creates.append(time.time_ns())
        elif event.cancels:
            self._cancelled_by = _CANCELLED_BY.get(event.kind, "client")

    def upstream_event(self, event: UpstreamEvent) -> None:
        kind = event.kind
        if kind is EventKind.RESPONSE_CREATED:
            if event.response_id is not None:
                self._start_response(event.response_id)
        elif kind is EventKind.RESPONSE_DONE:
            if event.response_id is not None:
                self._end_response(event)
        elif kind is EventKind.SESSION_CREATED:
            session = (event.body or {}).get("session")
            upstream_session_id = session.get("id") if isinstance(session, dict) else None
            if isinstance(upstream_session_id, str) and upstream_session_id:
                self._conversation = upstream_session_id
                self._span.set_attribute("gen_ai.conversation.id", upstream_session_id)
        elif kind is EventKind.OVERLAP_DECISION:
            if event.action == "barge_in":
                self._cancelled_by = "barge_in"
        elif kind is EventKind.SPEECH_STARTED:
            self._cancelled_by = "barge_in"

    def cancelled(self, response_ids: Sequence[str]) -> None:
        by = self._cancelled_by
        for response_id in response_ids:
            span = self._responses.get(response_id)
            if span is not None and response_id not in self._cancel_reported:
                self._cancel_reported.add(response_id)
                span.add_event("response.cancelled", {"omni_sidecar.cancelled_by": by})
        self._cancelled_by = "engine"

    def overflow(self, policy: str) -> None:
        attributes = {"omni_sidecar.overflow_policy": policy}
        self._span.add_event("output_backpressure", attributes)
        for span in self._responses.values():
            span.add_event("output_backpressure", attributes)
        # The response the policy fails is tombstoned in the same core call.
        self._cancelled_by = "sidecar_overflow"

    def end(self, outcome: str, close_code: int | None) -> None:
        if self._ended:
            return
        for response_id in list(self._responses):
            self._close_response(response_id, "session_ended")
        span = self._span
        span.set_attribute("proxy.session.outcome", outcome)
        if close_code is not None:
            span.set_attribute("omni_sidecar.close_code", close_code)
        if outcome in _ABNORMAL:
            span.set_status(Status(StatusCode.ERROR, outcome))
        self._finish()

    # -- response spans ---------------------------------------------------------------------

    def _start_response(self, response_id: str) -> None:
        if response_id in self._responses:
            return
        if len(self._responses) >= MAX_OPEN_RESPONSE_SPANS:
            self._close_response(next(iter(self._responses)), "evicted")
        start = self._creates.popleft() if self._creates else None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": GEN_AI_OPERATION,
            "gen_ai.provider.name": _PROVIDER,
            "gen_ai.conversation.id": self._conversation,
            "gen_ai.response.id": response_id,
        }
        if self._model:
            attributes["gen_ai.request.model"] = self._model
        name = f"{GEN_AI_OPERATION} {self._model}" if self._model else GEN_AI_OPERATION
        self._responses[response_id] = self._tracer.start_span(
            name,
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=start,
        )

    def _end_response(self, event: UpstreamEvent) -> None:
        response_id = event.response_id
        assert response_id is not None
        span = self._responses.get(response_id)
        if span is None:
            return
        response = (event.body or {}).get("response")
        response = response if isinstance(response, dict) else {}
        status = event.status or "completed"
        if status == "cancelled" and response_id not in self._cancel_reported:
            self._cancel_reported.add(response_id)
            span.add_event("response.cancelled", {"omni_sidecar.cancelled_by": "engine"})
        usage = response.get("usage")
        if isinstance(usage, dict):
            for field, attribute in (
                ("input_tokens", "gen_ai.usage.input_tokens"),
                ("output_tokens", "gen_ai.usage.output_tokens"),
            ):
                value = usage.get(field)
                if isinstance(value, int) and not isinstance(value, bool):
                    span.set_attribute(attribute, value)
        if status == "failed":
            details = response.get("status_details")
            error = details.get("error") if isinstance(details, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            span.set_attribute("error.type", code if isinstance(code, str) else "failed")
            span.set_status(Status(StatusCode.ERROR, "failed"))
        self._close_response(response_id, status)

    def _close_response(self, response_id: str, finish: str) -> None:
        span = self._responses.pop(response_id)
        self._cancel_reported.discard(response_id)
        span.set_attribute("gen_ai.response.finish_reasons", [finish])
        span.end()

    def _finish(self) -> None:
        self._ended = True
        self._span.end()
