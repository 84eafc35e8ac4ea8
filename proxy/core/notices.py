"""Events the proxy writes itself, in the engine's own shapes.

Shapes follow vLLM-Omni 0.30 (docs/engine-protocol.md, Terminal events and errors) and PR #7644 for
``output_backpressure``: the T1 error envelope, a failed ``response.done``
with ``metadata.committed: false``, and ``session.closed`` with a reason.
Ids are passed in (the core has no randomness of its own).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from proxy.core.events import UpstreamEvent, classify_upstream

__all__ = [
    "ERROR_TYPES",
    "compact_session_closed",
    "error_event",
    "response_cancel",
    "response_failed",
    "resume_refused",
    "session_close",
    "session_closed",
    "session_replaced",
    "session_resumed",
    "session_resync_required",
    "with_resume_token",
]

#: error.type per code, as the engine derives it (unknown → invalid_request_error).
ERROR_TYPES: Final[dict[str, str]] = {
    "output_backpressure": "rate_limit_error",
    "input_backpressure": "rate_limit_error",
    "client_rate_limited": "rate_limit_error",
    "quota_exceeded": "rate_limit_error",
    "upstream_frame_too_large": "server_error",
    "resource_exhausted": "rate_limit_error",
    "engine_unavailable": "server_error",
    "internal_error": "server_error",
}


def _event(body: dict[str, Any]) -> UpstreamEvent:
    return classify_upstream(orjson.dumps(body).decode())


def error_event(
    event_id: str, code: str, message: str, *, client_event_id: str | None = None
) -> UpstreamEvent:
    """``error`` in the T1 envelope; echoes the client's event_id when given."""
    error: dict[str, Any] = {
        "type": ERROR_TYPES.get(code, "invalid_request_error"),
        "code": code,
        "message": message,
    }
    if client_event_id is not None:
        error["event_id"] = client_event_id
    return _event({"type": "error", "event_id": event_id, "error": error})


def response_failed(event_id: str, response_id: str, reason: str) -> UpstreamEvent:
    """A failed ``response.done`` (the proxy's terminal for a response it failed)."""
    return _event(
        {
            "type": "response.done",
            "event_id": event_id,
            "response_id": response_id,
            "response": {
                "id": response_id,
                "object": "realtime.response",
                "status": "failed",
                "status_details": {"type": "failed", "reason": reason},
                # The engine always lists the assistant item, even when empty.
                "output": [
                    {
                        "id": "item_" + response_id,
                        "object": "realtime.item",
                        "type": "message",
                        "role": "assistant",
                        "status": "failed",
                        "content": [],
                    }
                ],
                "metadata": {"committed": False, "reason": reason},
            },
        }
    )


def session_closed(
    event_id: str, session_id: str | None, reason: str, *, detail: str | None = None
) -> UpstreamEvent:
    """``session.closed``: always the last event of a session."""
    body: dict[str, Any] = {
        "type": "session.closed",
        "event_id": event_id,
        # A string like the engine's (SessionClosed.session_id is str), "" if unknown.
        "session_id": session_id or "",
        "reason": reason,
        "event": {} if detail is None else {"detail": detail},
    }
    return _event(body)


def compact_session_closed(event_id: str, session_id: str | None) -> UpstreamEvent:
    """Replacement for a closure notice over the size limit (same identity)."""
    return session_closed(event_id, session_id, "close_details_exceed_output_limit")


def response_cancel(response_id: str) -> str:
    """Upstream ``response.cancel`` naming one response."""
    return orjson.dumps({"type": "response.cancel", "response_id": response_id}).decode()


def session_close(reason: str) -> str:
    """Upstream ``session.close`` so that a resumable engine frees the slot now."""
    return orjson.dumps({"type": "session.close", "reason": reason}).decode()


def session_resumed(
    event_id: str,
    session_id: str | None,
    session: dict[str, Any] | None,
    *,
    generation: int,
    resume_token: str,
) -> UpstreamEvent:
    """``session.resumed``: a dropped client is attached again (the replay follows)."""
    body: dict[str, Any] = {
        "type": "session.resumed",
        "event_id": event_id,
        "session_id": session_id,
        "attachment_generation": generation,
        "resume_token": resume_token,
    }
    if session is not None:
        body["session"] = session
    return _event(body)


def session_replaced(event_id: str, session_id: str | None, generation: int) -> UpstreamEvent:
    """``session.replaced``: a resume on another connection took the session from
    this one (``generation``: this connection's attachment generation)."""
    return _event(
        {
            "type": "session.replaced",
            "event_id": event_id,
            "session_id": session_id,
            "attachment_generation": generation,
        }
    )


def session_resync_required(event_id: str, session_id: str | None, reason: str) -> UpstreamEvent:
    """``session.resync_required``: what the client missed can no longer be replayed."""
    return _event(
        {
            "type": "session.resync_required",
            "event_id": event_id,
            "session_id": session_id,
            "reason": reason,
        }
    )


#: Every error code with which an engine refuses a ``session.resume``
#: (docs/engine-protocol.md, Resume): the client gets the one answer for each.
RESUME_REFUSALS: Final = frozenset(
    {
        "invalid_session_resume",
        "session_resume_expired",
        "unsupported_session_resume",
        "invalid_resume_token",
        "session_resume_conflict",
    }
)


def with_resume_token(event: UpstreamEvent, token: str) -> UpstreamEvent:
    """The engine's ``session.created``/``session.resumed`` with the client's bound
    ``token`` in place of the engine's own; the rest of the frame as the engine wrote it.

    The engine's token never reaches a client other than inside ``token`` (a client
    could resume with it unbound). It is swapped where it stands when the frame spells
    it once, plainly, and has no escape that could spell it again (in a key a parser
    drops), and the result is read back to prove it; otherwise the frame is written
    anew, every other copy of the engine's token (a string that is it) made empty.
    """
    body = dict(event.body or {})
    engine_token = body.pop("resume_token", None)
    if not (isinstance(engine_token, str) and engine_token):
        return _event({**body, "resume_token": token})
    if _holds(body, engine_token):
        return _event({**_blanked(body, engine_token), "resume_token": token})
    body["resume_token"] = token
    literal = orjson.dumps(engine_token).decode()
    if "\\" not in event.text and event.text.count(engine_token) == 1 and literal in event.text:
        swapped = classify_upstream(event.text.replace(literal, orjson.dumps(token).decode()))
        if swapped.body == body:
            return swapped
    return _event(body)


def _holds(value: Any, secret: str) -> bool:
    """``secret`` stands somewhere in ``value`` as a string of its own (a name or a value)."""
    if isinstance(value, str):
        return value == secret
    if isinstance(value, dict):
        return any(_holds(k, secret) or _holds(v, secret) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds(v, secret) for v in value)
    return False


def _blanked(value: Any, secret: str) -> Any:
    """``value`` with every string that is ``secret`` made empty."""
    if isinstance(value, str):
        return "" if value == secret else value
    if isinstance(value, dict):
        return {_blanked(k, secret): _blanked(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_blanked(v, secret) for v in value]
    return value


def resume_refused(event_id: str | None = None) -> UpstreamEvent:
    """The one answer to a ``session.resume`` that is not the session's own.

    Unknown, expired, a forged or spent token, another key: nothing in it
    tells them apart, nor whether the session exists.
    """
    body: dict[str, Any] = {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": "session_resume_expired",
            "message": "unknown or expired session",
        },
    }
    if event_id is not None:
        body["event_id"] = event_id
    return _event(body)
