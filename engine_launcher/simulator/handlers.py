"""What each client event does to a simulated session (docs/engine-protocol.md, Client events;
Cancellation in the engine).

One function per canonical client event type; :data:`HANDLERS` is the dispatch
table (aliases are resolved before lookup, see ``protocol.CLIENT_ALIASES``).
Handlers only call the session's state and emitting API; they do no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from engine_launcher.simulator.conversation import Conversation, InputAudioError, InputBuffer
from engine_launcher.simulator.playback_history import PlaybackCursor
from engine_launcher.simulator.session_resume import (
    INVALID_EVENT_ACK,
    INVALID_SESSION_RESUME,
    UNSUPPORTED_SESSION_RESUME,
    Refusal,
    parse_resume_request,
)
from engine_launcher.simulator.session_update import SettingsError, apply_update, truthy
from engine_launcher.simulator.wire import Payload

if TYPE_CHECKING:
    from engine_launcher.simulator.duplex_session import DuplexSession

__all__ = ["HANDLERS", "Handler"]

Handler = Callable[["DuplexSession", Payload], None]


def _named_response(event: Payload) -> str | None:
    named = event.get("response_id")
    return named if isinstance(named, str) and named else None


# ------------------------------------------------------------------ sessions


def on_session_update(s: DuplexSession, event: Payload) -> None:
    """First one opens (created + updated); later ones answer ``session.updated``."""
    session = event.get("session", {})
    if not isinstance(session, dict):
        s.error("bad_event", "session must be an object", event)
        return
    try:
        s.settings = apply_update(s.settings, session)
    except SettingsError as exc:
        s.error(exc.code, str(exc), event)
        return
    if s.session_id:
        s.emit({"type": "session.updated", "session": s.session_object()})
    else:
        s.open()


def on_session_resume(s: DuplexSession, event: Payload) -> None:
    """A new socket's first message: parse it and leave it to the shell, which finds the session.

    Later on a connection it is refused (docs/engine-protocol.md, Resume); like
    every answer of the engine's transport, the errors carry no ``server_event_seq``.
    """
    if s.session_id:
        message = "session.resume must be the first message of a new connection"
        s.error(UNSUPPORTED_SESSION_RESUME, message, event, journal=False)
        return
    request = parse_resume_request(event)
    if request is None:
        message = "session.resume needs session_id, resume_token and a seq >= 0"
        s.refuse_resume(Refusal(INVALID_SESSION_RESUME, message))
        return
    s.resume_request = request


def on_event_ack(s: DuplexSession, event: Payload) -> None:
    """``session.event_ack``: drop journaled frames up to the seq; no answer unless invalid."""
    seq = event.get("server_event_seq")
    journal = s.journal
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        message = "session.event_ack needs a server_event_seq >= 0"
    elif journal is None or journal.acknowledge(seq):
        return
    else:
        message = f"server_event_seq {seq} is ahead of the last event sent ({journal.last_seq})"
    s.error(INVALID_EVENT_ACK, message, event, journal=False)


def on_heartbeat(s: DuplexSession, event: Payload) -> None:
    """Refresh the lease: ``session.heartbeat_ack``."""
    s.emit({"type": "session.heartbeat_ack", "session_id": s.session_id})


def on_session_close(s: DuplexSession, event: Payload) -> None:
    """``session.closed`` (given reason or ``client_close``), then close 1000."""
    reason = event.get("reason")
    s.request_close(reason if isinstance(reason, str) and reason else "client_close", 1000)


# --------------------------------------------------------------------- input


def on_append(s: DuplexSession, event: Payload) -> None:
    """Buffer input audio; with server VAD, speech during a response barges in."""
    try:
        audio = InputBuffer.decode(event, s.settings.input_format, s.settings.input_rate)
    except InputAudioError as exc:
        s.error(exc.code, str(exc), event)
        return
    if s.settings.server_vad and s.active is not None and InputBuffer.is_speech(event, audio):
        _vad_barge_in(s)
    s.input.add(audio)


def _input_item(s: DuplexSession) -> str:
    if s.input.item_id is None:
        s.input.item_id = s.new_item_id()
    return s.input.item_id


def _vad_barge_in(s: DuplexSession) -> None:
    # docs/engine-protocol.md, Cancellation in the engine: confirmed speech during a response →
    # speech_started,
    # overlap.decision{barge_in}, cancel with reason turn_detected.
    assert s.active is not None
    s.emit(
        {
            "type": "input_audio_buffer.speech_started",
            "audio_start_ms": int(s.input.total_ms),
            "item_id": _input_item(s),
        }
    )
    # Wheel 0.30 ``OverlapDecision``: session_id and epoch at the top level, no
    # response_id there; ``metadata`` is the engine's internal decision event.
    decision = {"policy": "barge_in_on_speech", "action": "barge_in", "reason": "speech_started"}
    s.emit(
        {
            "type": "overlap.decision",
            "session_id": s.session_id,
            "epoch": s.epoch,
            **decision,
            "metadata": {
                "type": "overlap.decision",
                "session_id": s.session_id,
                "epoch": s.epoch,
                **decision,
                "response_id": s.active.response_id,
                "source": "server_vad",
            },
        }
    )
    s.cancel_active("turn_detected")


def on_commit(s: DuplexSession, event: Payload) -> None:
    """Commit fan-out (docs/engine-protocol.md, Response sequence); starts a response only when
    asked to."""
    if event.get("is_speech") is False:
        # Silence declaration: the model keeps listening (docs/engine-protocol.md, Client events).
        s.input.clear()
        s.produce_listen()
        return
    if s.input.bytes == 0:
        s.error("input_audio_buffer_empty", "no audio appended since last commit", event)
        return
    item_id = _input_item(s)
    audio_ms = int(s.input.ms)
    s.input.clear()
    s.turn_id += 1
    # docs/engine-protocol.md, Client events: a commit starts a response only with
    # extra_body.auto_response or an explicit response_create/create_response flag.
    create = (
        truthy(event.get("response_create"))
        or truthy(event.get("create_response"))
        or s.settings.auto_response
    )
    item = Conversation.user_audio_item(item_id, audio_ms)
    previous = s.history.add(item)
    for payload in Conversation.added_events(item, previous):
        s.emit(payload)
    s.emit(
        {
            "type": "input_audio_buffer.committed",
            "previous_item_id": previous,
            "item_id": item_id,
            "event": {
                "turn_id": s.turn_id,
                "epoch": s.epoch,
                "history_len": len(s.history),
                "audio_ms": audio_ms,
                "response_create_deferred": create and s.active is not None,
            },
        }
    )
    s.emit(
        {
            "type": "conversation.item.input_audio_transcription.completed",
            "item_id": item_id,
            "content_index": 0,
            "transcript": item["content"][0]["transcript"],
        }
    )
    s.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item})
    if create:
        if s.active is not None or s.playback_wait:
            s.error("response_already_active", "a response is already active", event)
        else:
            s.start_response()


def on_input_clear(s: DuplexSession, event: Payload) -> None:
    """Drop uncommitted input: ``input_audio_buffer.cleared``."""
    s.input.clear()
    s.emit({"type": "input_audio_buffer.cleared"})


def on_input_cancel(s: DuplexSession, event: Payload) -> None:
    """Clear input and cancel (reason ``barge_in``); always advances the epoch."""
    s.input.clear()
    s.emit({"type": "input_audio_buffer.cleared"})
    if s.active is not None:
        s.cancel_active("barge_in")
    elif not s.release_playback_wait():
        s.epoch += 1


def on_text_append(s: DuplexSession, event: Payload) -> None:
    """Model-native sessions reject text input."""
    s.error("native_text_append_unsupported", "model-native sessions take no text input", event)


# -------------------------------------------------------------- conversation


def on_item_create(s: DuplexSession, event: Payload) -> None:
    """Add a client item; a user or tool-output item counts as input for a response."""
    raw = event.get("item")
    if not isinstance(raw, dict):
        s.error("bad_event", "item must be an object", event)
        return
    item = dict(raw)
    if not isinstance(item.get("id"), str):
        item["id"] = s.new_item_id()
    item.setdefault("object", "realtime.item")
    item.setdefault("status", "completed")
    if item.get("type", "message") == "message":
        item.setdefault("role", "user")
    previous = s.history.add(item)
    for payload in Conversation.added_events(item, previous):
        s.emit(payload)
    s.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item})


def on_item_retrieve(s: DuplexSession, event: Payload) -> None:
    """``conversation.item.retrieved`` or ``item_not_found``.

    An assistant item's transcript is what the engine's history holds for it
    after every cut (acks, truncation, cancel): what the model believes it said,
    ``""`` while an ``ack_only`` reply awaits its ack.
    """
    item_id = str(event.get("item_id"))
    item = s.history.get(item_id)
    if item is None:
        s.error("item_not_found", f"no item {event.get('item_id')!r}", event)
        return
    record = s.record_for_item(item_id)
    if record is not None:
        item = {**item, "content": [{"type": "output_audio", "transcript": record.text or ""}]}
    s.emit({"type": "conversation.item.retrieved", "item": item})


def on_item_delete(s: DuplexSession, event: Payload) -> None:
    """``conversation.item.deleted`` or ``item_not_found``; a reply leaves history with it."""
    item_id = str(event.get("item_id"))
    if s.history.delete(item_id):
        record = s.record_for_item(item_id)
        if record is not None:
            del s.records[record.response_id]
        # The engine echoes its internal event under ``event`` (wheel 0.30 ``ItemDeleted``).
        s.emit(
            {
                "type": "conversation.item.deleted",
                "item_id": item_id,
                "event": {"type": "conversation.item.deleted", "item_id": item_id},
            }
        )
    else:
        s.error("item_not_found", f"no item {item_id!r}", event)


def _int_field(event: Payload, key: str) -> int | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def on_item_truncate(s: DuplexSession, event: Payload) -> None:
    """Cut an assistant item's history at ``audio_end_ms`` (``--supports-audio-truncate``).

    Like the 0.30 engine: ``conversation.item.truncated`` (with the internal
    event and ``truncated``: whether history changed), then the same cut
    applied as a truncating ``playback.ack``, answered by
    ``playback.acknowledged`` (or that ack's error). Without the flag the
    engine announces no truncation and the event is an error.
    """
    if not s.config.supports_audio_truncate:
        s.error("unsupported_audio_truncate", "audio truncation is not supported", event)
        return
    item_id = event.get("item_id")
    audio_end_ms = _int_field(event, "audio_end_ms")
    content_index = _int_field(event, "content_index")
    if not isinstance(item_id, str) or audio_end_ms is None:
        s.error("bad_event", "conversation.item.truncate requires item_id and audio_end_ms", event)
        return
    content_index = 0 if content_index is None else content_index
    record = s.record_for_item(item_id)
    item = s.history.get(item_id)
    if record is None and item is None:
        s.error("item_not_found", f"Conversation item not found: {item_id}", event)
        return
    if record is None:
        s.error(
            "bad_event", "conversation.item.truncate only supports assistant message items", event
        )
        return
    if audio_end_ms < 0:
        s.error("bad_event", "conversation.item.truncate requires non-negative audio_end_ms", event)
        return
    if content_index != 0:
        s.error(
            "bad_event",
            f"conversation.item.truncate content_index out of range: {content_index}",
            event,
        )
        return
    if s.config.release.truncate_needs_audio_item and record.generated_ms <= 0:
        s.error(
            "bad_event", "conversation.item.truncate requires an item that produced audio", event
        )
        return
    record.cap(audio_end_ms)
    truncated = record.truncate(audio_end_ms)
    internal = {
        "type": "conversation.item.truncated",
        "session_id": s.session_id,
        "item_id": item_id,
        "content_index": content_index,
        "audio_end_ms": event.get("audio_end_ms"),
        "truncated": truncated,
    }
    s.emit(
        {
            "type": "conversation.item.truncated",
            "item_id": item_id,
            "content_index": content_index,
            "audio_end_ms": audio_end_ms,
            "event": internal,
        }
    )
    ack = {"item_id": item_id, "played_ms": audio_end_ms, "committed_ms": audio_end_ms}
    _apply_playback_ack(s, {**ack, "type": "playback.ack", "truncate": True}, hard=True)


def _ack_target(s: DuplexSession, event: Payload) -> tuple[str | None, str | None]:
    """(response_id, item_id) an ack is about, filled in the way the engine does."""
    named = event.get("response_id")
    response_id = named if isinstance(named, str) and named else None
    item_id = event.get("item_id")
    if not isinstance(item_id, str) or not item_id:
        item_id = f"item_{response_id}" if response_id is not None else None
    elif response_id is None and item_id.startswith("item_"):
        response_id = item_id.removeprefix("item_")
    if response_id is None and item_id is None:
        waiting = [r for r in s.records.values() if r.ended and not r.in_history]
        if len(waiting) == 1:
            response_id, item_id = waiting[0].response_id, waiting[0].item_id
        elif s.active is not None:
            response_id, item_id = s.active.response_id, s.active.item_id
    return response_id, item_id


def on_playback_ack(s: DuplexSession, event: Payload) -> None:
    """A client's ``playback.ack``: its ``truncate`` flag counts on 0.30 and 0.32.

    0.31 drops the flag as it parses the event (a truncating ack is a plain
    ack there); 0.30 is kept as the simulator always modelled it (the flag counts).
    """
    hard = event.get("truncate") is True and s.config.release.ack_truncate_flag
    _apply_playback_ack(s, event, hard=hard)


def _apply_playback_ack(s: DuplexSession, event: Payload, *, hard: bool) -> None:
    """Apply a playback report to the ledger and history (docs/design.md, Simulator).

    ``played_ms``/``committed_ms`` are cumulative ms of the response's audio
    (``committed_ms`` defaults to ``played_ms``); both only move forward,
    except that ``truncate: true`` sets the committed position exactly and
    caps the item's history there for good. Answered by
    ``playback.acknowledged`` whose ``event`` carries the ledger after the ack
    and ``history_committed`` (whether history changed), or by an error:
    ``playback_item_mismatch`` (item_id is not ``item_<response_id>``),
    ``playback_item_not_found`` (no such reply), ``playback_ack_too_late`` (a
    later user turn was committed before the reply held a history position).

    0.32: the errors carry no ``event_id``; a truncating ack naming no reply
    that produced audio is ``bad_event``; ``playback_ack_too_late`` is not
    raised for a reply without text.

    Args:
        s: the session.
        event: the ack (a client's, or the one ``conversation.item.truncate`` implies).
        hard: apply it as a truncation.
    """
    release = s.config.release
    # 0.32 answers an ack's errors without the ack's event_id.
    echo: Payload | None = event if release.ack_errors_carry_event_id else None
    played = event.get("played_ms", event.get("audio_ms", 0))
    if isinstance(played, bool) or not isinstance(played, int | float):
        s.error("bad_event", "playback.ack requires played_ms", echo)
        return
    committed_raw = event.get("committed_ms")
    committed = (
        int(committed_raw)
        if isinstance(committed_raw, int | float) and not isinstance(committed_raw, bool)
        else int(played)
    )
    response_id, item_id = _ack_target(s, event)
    record = None
    if response_id is not None:
        if item_id != f"item_{response_id}":
            s.error(
                "playback_item_mismatch",
                "playback.ack item_id must match item_<response_id>.",
                echo,
            )
            return
        record = s.records.get(response_id)
        if record is None or (record.released and not record.in_history):
            s.error(
                "playback_item_not_found",
                f"No assistant response item is registered for {response_id}.",
                echo,
            )
            return
        audio_only = (
            release.audio_only_acks_never_late and record.ended and not record.full_text.strip()
        )
        if (
            not record.reserved
            and not record.in_history
            and s.turn_id > record.turn_id
            and not audio_only
        ):
            s.error(
                "playback_ack_too_late",
                "playback.ack arrived after a later user input was committed.",
                echo,
            )
            return
        record.reserved = True
    elif item_id is not None:
        s.error(
            "playback_item_not_found",
            "playback.ack requires a response-owned assistant item.",
            echo,
        )
        return
    if hard and release.truncate_needs_audio_item and (record is None or record.generated_ms <= 0):
        s.error(
            "bad_event",
            "playback.ack truncate requires one identifiable item that produced audio",
            None,
        )
        return
    cursor = record.cursor if record is not None else s.current
    cursor.acknowledge(int(played), committed)
    history_committed = False
    if record is not None:
        if hard:
            cursor.truncate(committed)
            record.cap(committed)
        history_committed = record.truncate(committed)
    # Wheel 0.30 ``PlaybackAcknowledged`` renders only ``event`` (the internal event).
    s.emit(
        {
            "type": "playback.acknowledged",
            "event": {
                "type": "playback.acknowledged",
                "session_id": s.session_id,
                "epoch": s.epoch,
                "item_id": item_id,
                "played_ms": int(played),
                "committed_ms": committed,
                "truncate": hard,
                "playback": cursor.as_dict(),
                "history_committed": history_committed,
            },
        }
    )
    if record is not None and history_committed and committed >= cursor.total_ms:
        record.release()


# ----------------------------------------------------------------- responses


def on_response_create(s: DuplexSession, event: Payload) -> None:
    """Needs committed input, no active response and (``ack_only``) no playback wait."""
    if s.active is not None or s.playback_wait:
        s.error("response_already_active", "a response is already active", event)
    elif not s.history.pending_input:
        s.error("response_create_without_input", "commit input audio first", event)
    else:
        s.start_response()


def on_response_cancel(s: DuplexSession, event: Payload) -> None:
    """docs/engine-protocol.md, Client events: a named id that is not the active one is an error,
    unless idle."""
    named = _named_response(event)
    if s.active is not None:
        if named is None or named == s.active.response_id:
            s.cancel_active("client_cancelled")
        else:
            s.error("response_not_active", f"response {named!r} is not active", event)
    elif s.release_playback_wait():
        # ack_only audio still playing: the engine counts it as response work.
        pass
    elif named is None:
        s.error("response_not_active", "no response is active", event)
    # A named response that already ended is silently ignored.


def on_output_clear(s: DuplexSession, event: Payload) -> None:
    """Cancel the active response (with ``output_audio_buffer.cleared``), or just answer."""
    named = _named_response(event)
    if s.active is not None and named in (None, s.active.response_id):
        s.cancel_active("output_audio_buffer_clear", output_cleared=True)
        return
    target = named or s.last_response_id
    if s.active is None and target == s.last_response_id and s.release_playback_wait():
        # The latest completed reply is still playing under ack_only: the clear
        # reaches the engine, which cuts its history at the acked position and
        # frees the turn (a new epoch).
        return
    if s.active is None and target == s.last_response_id:
        s.current = PlaybackCursor()  # the engine drops the cursor, epoch unchanged
    s.emit({"type": "output_audio_buffer.cleared", "response_id": target})


def on_barge_in(s: DuplexSession, event: Payload) -> None:
    """Hard interrupt (``supports_barge_in``); advances the epoch even when idle."""
    if s.active is not None:
        s.cancel_active("barge_in")
    elif not s.release_playback_wait():
        s.epoch += 1


def on_turn_signal(s: DuplexSession, event: Payload) -> None:
    """``turn.signal{event, payload}``: barge_in, response.cancel or input.cancel."""
    signal = event.get("event")
    payload = event.get("payload")
    payload = payload if isinstance(payload, dict) else {}
    if signal == "barge_in":
        on_barge_in(s, event)
    elif signal == "response.cancel":
        target = {**payload, "event_id": event.get("event_id")}
        target.setdefault("response_id", event.get("response_id"))
        on_response_cancel(s, target)
    elif signal == "input.cancel":
        on_input_cancel(s, event)
    # Other turn signals are accepted without a visible effect here.


HANDLERS: Final[dict[str, Handler]] = {
    "session.update": on_session_update,
    "session.resume": on_session_resume,
    "session.event_ack": on_event_ack,
    "session.heartbeat": on_heartbeat,
    "session.close": on_session_close,
    "input_audio_buffer.append": on_append,
    "input_audio_buffer.commit": on_commit,
    "input_audio_buffer.clear": on_input_clear,
    "input.cancel": on_input_cancel,
    "input.text.append": on_text_append,
    "conversation.item.create": on_item_create,
    "conversation.item.retrieve": on_item_retrieve,
    "conversation.item.delete": on_item_delete,
    "conversation.item.truncate": on_item_truncate,
    "response.create": on_response_create,
    "response.cancel": on_response_cancel,
    "output_audio_buffer.clear": on_output_clear,
    "barge_in": on_barge_in,
    "turn.signal": on_turn_signal,
    "playback.ack": on_playback_ack,
}
