"""``SessionObserver`` (proxy/session/observer.py): a session's metrics, lifecycle and trace.

Per-event counts are plain integers until ``flush`` adds what grew to the
counters (at a scrape, at the end): a flush adds each event once. A drain's
report is exported when it comes; the session's end counts its outcome once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics
from proxy.core.events import classify_upstream
from proxy.core.lifecycle import EndReason
from proxy.core.session_core import SessionCore
from proxy.session.observer import LIFECYCLE_EVENTS, SessionObserver
from proxy.session.registry import SessionRegistry
from tests.proxy.core.helpers import (
    audio,
    b_audio_append,
    b_response_cancel,
    b_response_create,
    error,
    make_settings,
    response_created,
    session_created,
)

ROOM = 1 << 20


def _observer() -> tuple[SessionObserver, SessionCore, CollectorRegistry]:
    prometheus = CollectorRegistry()
    registry = SessionRegistry(
        SidecarMetrics(prometheus, process_metrics=False), max_total_pending_output_bytes=1 << 30
    )
    observer = SessionObserver(registry, "s1", client_address="127.0.0.1")
    core = SessionCore(make_settings(), new_event_id=lambda: "event_proxy")
    observer.watch(core)
    return observer, core, prometheus


def _value(prometheus: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    return prometheus.get_sample_value(name, labels or {}) or 0.0


def _events(prometheus: CollectorRegistry, direction: str, kind: str) -> float:
    return _value(prometheus, "omni_sidecar_events_total", {"direction": direction, "kind": kind})


def test_counts_reach_the_counters_at_a_flush_each_once() -> None:
    observer, core, prometheus = _observer()
    append, create = b_audio_append(), b_response_create()
    for text in (append, create, "not json"):
        observer.client_frame(len(text), core.receive_client(text, 0.0))
    for text in (audio("r1", 400), response_created("r1"), error()):
        observer.upstream_event(classify_upstream(text))
    observer.upstream_event(classify_upstream("not json"))
    assert _events(prometheus, "client_to_upstream", "audio") == 0, "nothing before a flush"
    assert observer.unflushed()[0] == 3
    observer.flush()
    observer.flush()
    assert _events(prometheus, "client_to_upstream", "audio") == 1
    assert _events(prometheus, "client_to_upstream", "control") == 1
    assert _events(prometheus, "client_to_upstream", "invalid") == 1
    assert _value(
        prometheus, "omni_sidecar_bytes_total", {"direction": "client_to_upstream"}
    ) == len(append) + len(create)
    for kind in ("audio", "control", "error", "invalid"):
        assert _events(prometheus, "upstream_to_client", kind) == 1, kind
    assert observer.unflushed() == (0, 0, 0, 0)
    assert observer.events_client_to_upstream == 3


def test_a_drains_report_is_exported_and_the_lifecycle_noted() -> None:
    observer, core, prometheus = _observer()
    core.receive_upstream(session_created("duplex-9"), 0.0)
    core.receive_upstream(response_created("r1"), 0.0)
    core.receive_client(b_response_cancel("r1"), 0.0)
    core.receive_upstream(audio("r1", 400, seq=1), 0.0)  # late: dropped
    observer.after_drain(core.drain(0.0, 0))
    assert _value(prometheus, "omni_sidecar_dropped_events_total", {"reason": "late_audio"}) == 1
    kinds = [event["kind"] for event in observer.lifecycle()]
    assert kinds == ["created", "cancel", "engine_session"]
    assert observer.lifecycle()[-1]["detail"] == "duplex-9"


def test_the_end_counts_the_outcome_once_and_notes_the_close() -> None:
    observer, core, prometheus = _observer()
    core.receive(EndReason.SHUTDOWN, 0.0)
    observer.after_drain(core.drain(0.0, ROOM))
    observer.session_end()
    assert _value(prometheus, "omni_sidecar_sessions_total", {"outcome": "shutdown"}) == 1
    last = observer.lifecycle()[-1]
    assert last["kind"] == "close" and last["detail"] == "outcome shutdown, code 1001"


def test_an_observer_with_no_session_ends_as_an_error() -> None:
    prometheus = CollectorRegistry()
    registry = SessionRegistry(
        SidecarMetrics(prometheus, process_metrics=False), max_total_pending_output_bytes=1
    )
    SessionObserver(registry, "s1").session_end()
    assert _value(prometheus, "omni_sidecar_sessions_total", {"outcome": "error"}) == 1


def test_the_lifecycle_keeps_the_newest_events() -> None:
    observer, _, _ = _observer()
    for i in range(LIFECYCLE_EVENTS + 5):
        observer.note("step", str(i))
    events = observer.lifecycle()
    assert len(events) == LIFECYCLE_EVENTS
    assert events[-1]["detail"] == str(LIFECYCLE_EVENTS + 4)


def test_a_client_may_be_held_unless_the_sidecar_drains() -> None:
    registry = SessionRegistry(
        SidecarMetrics(CollectorRegistry(), process_metrics=False), max_total_pending_output_bytes=1
    )
    observer = SessionObserver(registry, "s1")
    assert observer.may_hold()
    registry.draining = True
    assert not observer.may_hold()


def test_a_resume_the_core_refuses_counts_as_refused() -> None:
    observer, core, prometheus = _observer()
    resume = '{"type":"session.resume","session_id":"duplex-1","resume_token":"forged"}'
    core.receive_client(resume, 0.0)
    observer.after_drain(core.drain(0.0, ROOM))
    observer.after_drain(core.drain(0.0, ROOM))
    assert _value(prometheus, "omni_sidecar_resumes_total", {"result": "refused"}) == 1
