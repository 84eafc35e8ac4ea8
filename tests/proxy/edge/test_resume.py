"""What a resume of a session held here gets when the session cannot take it
(proxy/edge/resume.py; docs/design.md, Resume), and how the engine's first
answer to a passed resume is read. Sans sockets: the session and the
connection are fakes that record what a peer would observe.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from metrics import SidecarMetrics
from proxy.core import notices
from proxy.core.lifecycle import SessionState
from proxy.core.resume_token import ResumeTokens
from proxy.edge.resume import ResumeRequest, resume_held, resume_unknown
from proxy.edge.resume_spent import SpentTokens

TOKENS = ResumeTokens(b"fleet-secret-0123456789abcdef")
KEY = "key-alpha"


class Connection:
    """The new connection: what it was sent and how it was closed."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.close_code: int | None = None

    async def send_str(self, text: str) -> None:
        self.sent.append(text)

    async def close(self, *, code: int, message: bytes) -> None:
        self.close_code = code


class Held:
    """A held session the registry finds; ``attach`` answers ``attaches``."""

    def __init__(self, state: SessionState, attaches: bool) -> None:
        self.view = SimpleNamespace(state=state)
        self.side = SimpleNamespace()
        self.upstream = None
        self.attaches = attaches
        self.attached = 0

    def attach(self, side: Any, cursor: int) -> bool:
        self.attached += 1
        return self.attaches


class Registry:
    def __init__(self, relay: Held, *, handing_over: bool = False) -> None:
        self.relay, self.handing_over = relay, handing_over

    def holds(self, session_id: str) -> bool:
        return True

    def resumable(self, session_id: str, token: str, key_id: str) -> Held:
        return self.relay


async def _resume(
    registry: Registry,
) -> tuple[Connection, SidecarMetrics, CollectorRegistry, SpentTokens]:
    metrics_registry = CollectorRegistry()
    metrics = SidecarMetrics(metrics_registry, process_metrics=False)
    connection, spent = Connection(), SpentTokens()
    side = SimpleNamespace(client=connection, follow=lambda previous: None)
    token = TOKENS.issue("duplex-1", KEY, "engine-tok", 0)
    body = {"type": "session.resume", "session_id": "duplex-1", "resume_token": token}
    request = ResumeRequest("duplex-1", token, 0, body, well_formed=True)
    done = await resume_held(
        registry,  # type: ignore[arg-type]
        metrics,
        connection,
        lambda upstream: side,  # type: ignore[arg-type,return-value]
        request,
        KEY,
        (TOKENS, spent),
    )
    assert done
    return connection, metrics, metrics_registry, spent


def _result(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("omni_sidecar_resumes_total", {"result": result})
    return value or 0.0


async def test_a_resume_while_the_drain_hands_the_session_over_gets_1012_and_spends_nothing() -> (
    None
):
    held = Held(SessionState.OPEN, attaches=True)
    connection, _, metrics, spent = await _resume(Registry(held, handing_over=True))
    assert held.attached == 0, "never attached to a session that moves"
    assert connection.close_code == 1012 and not connection.sent
    assert not await spent.spent("duplex-1", "engine-tok", 0), "its token resumes elsewhere"
    assert _result(metrics, "resumed") == 0


async def test_a_resume_of_a_session_that_just_ended_gets_the_one_refusal() -> None:
    connection, _, metrics, _ = await _resume(Registry(Held(SessionState.CLOSED, attaches=False)))
    assert connection.sent == [notices.resume_refused().text]
    assert _result(metrics, "refused") == 1 and _result(metrics, "resync_required") == 0


async def test_a_resume_the_journal_cannot_serve_is_counted_resync_required() -> None:
    """``attach`` wrote ``session.resync_required`` itself: the connection just closes."""
    connection, _, metrics, _ = await _resume(Registry(Held(SessionState.OPEN, attaches=False)))
    assert not connection.sent and connection.close_code == 1000
    assert _result(metrics, "resync_required") == 1


@pytest.mark.parametrize(
    "code",
    sorted(notices.RESUME_REFUSALS),
)
def test_every_engine_refusal_of_a_resume_says_the_replica_does_not_hold_it(code: str) -> None:
    error = {"type": "invalid_request_error", "code": code, "message": "x"}
    answer = orjson.dumps({"type": "error", "error": error}).decode()
    assert resume_unknown(answer) is (code != "session_resume_conflict")


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        ({"type": "session.resumed", "session_id": "d"}, True),
        ({"type": "session.resync_required", "reason": "journal_gap"}, True),
        ({"type": "error", "error": {"code": "invalid_session_resume"}}, False),
        ({"type": "error", "error": {"code": "resource_exhausted"}}, False),
        ({"type": "session.created"}, False),
    ],
)
def test_a_pool_takes_a_replica_as_the_holder_only_on_an_answer_that_says_so(
    answer: dict[str, Any], found: bool
) -> None:
    assert resume_unknown(orjson.dumps(answer).decode()) is not found


def test_every_resume_code_of_the_engine_protocol_is_a_refusal() -> None:
    """docs/engine-protocol.md, Resume: each becomes the one answer for the client."""
    assert {
        "invalid_session_resume",
        "session_resume_expired",
        "unsupported_session_resume",
        "invalid_resume_token",
        "session_resume_conflict",
    } <= notices.RESUME_REFUSALS
