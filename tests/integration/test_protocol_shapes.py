"""Event shapes checked against vLLM-Omni 0.30's own protocol code (from the PyPI wheel).

Two producers of wire events are ours and must not drift from the real engine:

- ``proxy.core.notices``: the events the sidecar writes itself (``error``
  output_backpressure / engine_unavailable, a failed ``response.done``,
  ``session.closed``) and the two commands it sends upstream;
- the simulator (``engine_launcher.simulator``), which every relay test runs
  against.

Each event is rebuilt as an instance of the wheel's event class for its
``type`` (``vllm_omni/protocol/duplex/events.py``, which re-exports the Tier 1
classes of ``protocol/realtime/events.py``): every key we send must be a field
the class renders, every value must have the field's type, and the class must
render exactly what we sent. A whole simulated GA session (a completed
response, a cancel with late audio, a server-VAD barge-in, listen, errors,
close) is also replayed through the engine's Realtime projection
(``vllm_omni/engine/duplex/realtime_events.py``: internal event → wire events)
and through ``DuplexClient``'s parser, so order and addressing are checked too.

Known differences are listed exactly (``KNOWN_*``): a new drift fails, and so
does a fixed one that is still listed.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses
import random
import types
import typing
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import orjson
import pytest

from proxy.core import notices
from tests.conftest import DEADLINE, TIMEOUT_FACTOR
from tests.integration.helpers import Client, SimulatorChild, connect, module_simulator, pcm16_b64

#: The ``vllm_omni`` fixture (session scope: the wheel is fetched and loaded once).
pytest_plugins = ["tests.integration.vllm_omni_wheel"]

if TYPE_CHECKING:
    from tests.integration.vllm_omni_wheel import EngineSession, VllmOmni

Event = dict[str, Any]

#: Stamped by the engine's attachment registry when it journals an event, not by the class.
TRANSPORT_KEYS: Final = frozenset({"server_event_seq"})

# ------------------------------------------------------------------ comparison helpers


def vocabulary(vo: VllmOmni) -> dict[str, type]:
    """Wire ``type`` → the wheel's event class (Tier 2 wins over its Tier 1 twin)."""
    base = vo.duplex_events.RealtimeEvent
    found: dict[str, type] = {}
    for name in vo.duplex_events.__all__:
        cls = getattr(vo.duplex_events, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, base)
            and cls.wire_type not in ("", "duplex.raw")
        ):
            found[cls.wire_type] = cls
    return found


def _conforms(value: object, hint: Any) -> bool:
    """Whether a JSON value fits a dataclass field annotation of the wheel."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint in (object, Any):
        return True
    if origin is not None:
        if origin in (tuple, list):  # rendered as a JSON array
            return isinstance(value, list | tuple)
        return isinstance(origin, type) and issubclass(origin, Mapping) and isinstance(value, dict)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def _kwargs_from_wire(vo: VllmOmni, cls: type, wire: Event) -> tuple[dict[str, Any], list[str]]:
    """Map a wire object onto the class's fields; return (kwargs, keys it cannot hold)."""
    names = {f.name for f in dataclasses.fields(cls)}
    body = {k: v for k, v in wire.items() if k != "type" and k not in TRANSPORT_KEYS}
    kwargs: dict[str, Any] = {}
    unmapped: list[str] = []
    if issubclass(cls, vo.realtime_events.ErrorEvent):
        error = body.pop("error", None)
        if isinstance(error, dict):
            error = dict(error)
            error.pop("type")  # derived from the code by the class
            for wire_key, name in (
                ("code", "code"), ("message", "message"),
                ("event_id", "related_event_id"), ("param", "param"),
            ):  # fmt: skip
                if wire_key in error:
                    kwargs[name] = error.pop(wire_key)
            kwargs["extra"] = error
        else:
            unmapped.append("error")  # the flat route-level shape is not this class
    elif cls is vo.duplex_events.Listen:
        response = body.pop("response", None)
        if isinstance(response, dict):
            kwargs["details"] = response.get("metadata", {})
    for key, value in body.items():
        if key in names:
            kwargs[key] = value
        elif key == "event" and "details" in names:
            kwargs["details"] = value
        elif key == "metadata" and "details" in names and "metadata" not in names:
            kwargs["details"] = value  # overlap.decision
        else:
            unmapped.append(key)
    return kwargs, unmapped


def _diff(ours: object, theirs: object, path: str, skip: frozenset[str]) -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out: list[str] = []
        for key in theirs:
            if key not in ours:
                out.append(f"{path}{key}: missing (wheel renders {theirs[key]!r})")
        for key in ours:
            where = f"{path}{key}"
            if key not in theirs:
                if where not in skip:
                    out.append(f"{where}: not rendered by the wheel")
            else:
                out.extend(_diff(ours[key], theirs[key], where + ".", skip))
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            p
            for i, (a, b) in enumerate(zip(ours, theirs))
            for p in _diff(a, b, f"{path}{i}.", skip)
        ]
    if ours != theirs:
        return [f"{path.rstrip('.')}: ours {ours!r}, wheel renders {theirs!r}"]
    return []


def class_problems(vo: VllmOmni, wire: Event) -> list[str]:
    """Every way ``wire`` differs from what the wheel's class for its type renders."""
    cls = vocabulary(vo).get(wire.get("type", ""))
    if cls is None:
        return [f"type {wire.get('type')!r} is not in the wheel's event vocabulary"]
    kwargs, unmapped = _kwargs_from_wire(vo, cls, wire)
    problems = [f"{key}: not a field of {cls.__name__}" for key in unmapped]
    hints = typing.get_type_hints(cls)
    for name, value in kwargs.items():
        if not _conforms(value, hints[name]):
            problems.append(f"{name}: {value!r} does not fit {cls.__name__}.{name}: {hints[name]}")
    rendered = cls(**kwargs).to_realtime()
    ours = {k: v for k, v in wire.items() if k not in TRANSPORT_KEYS}
    problems += _diff(ours, rendered, "", frozenset(unmapped))
    return problems


def by_type(vo: VllmOmni, events: list[Event]) -> dict[str, list[str]]:
    """``class_problems`` of a session, collected per event type (each problem once)."""
    found: dict[str, list[str]] = {}
    for event in events:
        for problem in class_problems(vo, event):
            # Values of one occurrence (ids, payloads) are not the point: keep the path.
            key = problem.split(": ours ")[0] if ": ours " in problem else problem
            bucket = found.setdefault(event["type"], [])
            if key not in bucket:
                bucket.append(key)
    return found


def body_of(event: Any) -> Event:
    return orjson.loads(event.text)


# ------------------------------------------------------------------------ notices

#: Codes whose error.type the sidecar fixes itself although the 0.30 table lacks them.
KNOWN_ERROR_TYPE_DIFFERENCES: Final = {
    # PR #7644 (unreleased) renders output_backpressure as rate_limit_error; 0.30's
    # REALTIME_ERROR_TYPES_BY_CODE has no entry, so its class would say invalid_request_error.
    "output_backpressure": "rate_limit_error",
    # A sidecar-only code (the engine has no such event); server_error is the honest class.
    "engine_unavailable": "server_error",
}


@pytest.mark.parametrize(
    "code",
    ["output_backpressure", "engine_unavailable", "input_backpressure", "resource_exhausted",
     "internal_error", "bad_event"],
)  # fmt: skip
@pytest.mark.parametrize("client_event_id", [None, "evt_client_1"])
def test_error_notice_has_the_wheel_error_shape(
    vllm_omni: VllmOmni, code: str, client_event_id: str | None
) -> None:
    wire = body_of(
        notices.error_event("event_" + "a" * 32, code, "text", client_event_id=client_event_id)
    )
    problems = class_problems(vllm_omni, wire)
    wheel_type = vllm_omni.errors.realtime_error_type(code)
    if code in KNOWN_ERROR_TYPE_DIFFERENCES:
        assert code not in vllm_omni.errors.REALTIME_ERROR_TYPES_BY_CODE
        assert problems == [
            f"error.type: ours {KNOWN_ERROR_TYPE_DIFFERENCES[code]!r}, wheel renders {wheel_type!r}"
        ]
    else:
        assert problems == []
        assert wire["error"]["type"] == wheel_type


def test_failed_response_done_notice_has_the_wheel_shape(vllm_omni: VllmOmni) -> None:
    rid = "resp-duplex-" + "b" * 32 + "-0-0000000c"
    wire = body_of(notices.response_failed("event_" + "c" * 32, rid, "output_backpressure"))
    assert class_problems(vllm_omni, wire) == []

    # What the engine's own projection sends for a failed response of the same id.
    projection = vllm_omni.projection
    state = projection.RealtimeProjectionState(session_id="duplex-" + "b" * 32)
    projection.project_internal_event(state, {"type": "response.created", "response_id": rid})
    engine = [
        e.to_realtime()
        for e in projection.project_internal_event(
            state,
            {
                "type": "response.done",
                "response_id": rid,
                "status": "failed",
                "status_details": {"type": "failed", "reason": "output_backpressure"},
                "committed": False,
                "reason": "output_backpressure",
            },
        )
    ]
    done = next(e for e in engine if e["type"] == "response.done")
    assert wire.keys() == done.keys()
    assert wire["response"].keys() == done["response"].keys()
    for key in ("id", "object", "status", "status_details"):
        assert wire["response"][key] == done["response"][key], key
    assert wire["response_id"] == done["response_id"] == rid
    assert wire["response"]["metadata"]["committed"] is False
    assert wire["response"]["metadata"]["reason"] == "output_backpressure"
    # Like the engine, the notice lists the response's assistant item as failed.
    assert wire["response"]["output"] == [
        {
            "id": "item_" + rid,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "failed",
            "content": [],
        }
    ]
    engine_item = done["response"]["output"][0]
    for key in ("id", "type", "role", "status"):
        assert wire["response"]["output"][0][key] == engine_item[key], key
    assert [(i["id"], i["status"]) for i in done["response"]["output"]] == [
        (f"item_{rid}", "failed")
    ]


@pytest.mark.parametrize("reason", ["output_backpressure", "engine_unavailable", "shutdown"])
def test_session_closed_notice_has_the_wheel_shape(vllm_omni: VllmOmni, reason: str) -> None:
    sid = "duplex-" + "d" * 32
    for wire in (
        body_of(notices.session_closed("event_" + "e" * 32, sid, reason)),
        body_of(notices.session_closed("event_" + "e" * 32, sid, reason, detail="upstream 1011")),
        body_of(notices.compact_session_closed("event_" + "e" * 32, sid)),
    ):
        assert class_problems(vllm_omni, wire) == []
        assert vllm_omni.client.wrap_event(wire).session_id == sid


def test_session_closed_notice_before_session_created_has_a_string_session_id(
    vllm_omni: VllmOmni,
) -> None:
    """With no session.created seen yet the notice sends ``session_id: ""``: the
    wheel's ``SessionClosed.session_id`` is a ``str`` (the engine never sends null)."""
    wire = body_of(notices.session_closed("event_" + "e" * 32, None, "engine_unavailable"))
    assert class_problems(vllm_omni, wire) == []
    assert vllm_omni.client.wrap_event(wire).session_id == ""


def test_upstream_commands_parse_as_engine_commands(vllm_omni: VllmOmni) -> None:
    """What the sidecar sends upstream on overflow, through the engine's client-event parser."""
    commands = vllm_omni.commands
    cancel = commands.command_from_realtime(orjson.loads(notices.response_cancel("resp-x")))
    assert isinstance(cancel, commands.CancelResponse)
    assert cancel.response_id == "resp-x"
    close = commands.command_from_realtime(
        orjson.loads(notices.session_close("output_backpressure"))
    )
    assert isinstance(close, commands.CloseSession)
    assert close.reason == "output_backpressure"


# ------------------------------------------------------------- a whole simulated session

#: 200 ms chunks, one every 20 ms, 20 per response (400 ms); 2 late chunks after a cancel.
SIM_ARGS: Final = (
    "--event-names", "ga", "--deterministic", "--chunk-ms", "200",
    "--realtime-factor", f"{0.1 * TIMEOUT_FACTOR:g}", "--response-seconds", "4",
    "--late-audio-chunks", "2", "--supports-audio-truncate",
)  # fmt: skip
SILENCE: Final = pcm16_b64(200)
LOUD: Final = pcm16_b64(100, amplitude=0.3)
AUDIO_DELTA: Final = "response.output_audio.delta"


async def _run_session(url: str) -> list[Event]:
    """One GA session exercising every server event the simulator has (deadlines in Client)."""
    append = {"type": "input_audio_buffer.append", "audio": SILENCE}
    async with connect(url + "?autostart=0") as client:
        c: Client = client
        await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
        await c.recv_until("session.updated")
        await c.send({"type": "session.heartbeat"})
        await c.recv_until("session.heartbeat_ack")
        # 1. a completed response, then its playback ack
        for event in (append, {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
            await c.send(event)
        done = await c.recv_until("response.done")
        await c.recv_until("rate_limits.updated")
        rid = done["response_id"]
        await c.send({"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}",
                      "played_ms": 3000, "committed_ms": 3000})  # fmt: skip
        await c.recv_until("playback.acknowledged")
        # ... then cut by a truncating ack and by conversation.item.truncate
        await c.send({"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}",
                      "played_ms": 2000, "truncate": True})  # fmt: skip
        await c.recv_until("playback.acknowledged")
        await c.send({"type": "conversation.item.truncate", "item_id": f"item_{rid}",
                      "content_index": 0, "audio_end_ms": 1000})  # fmt: skip
        await c.recv_until("conversation.item.truncated")
        await c.recv_until("playback.acknowledged")
        # 2. a silence declaration: the model keeps listening
        await c.send(append)
        await c.send({"type": "input_audio_buffer.commit", "is_speech": False})
        await c.recv_until("response.listen")
        # 3. response.cancel mid-response (late audio, cancelled terminal)
        for event in (append, {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
            await c.send(event)
        await c.recv_until(AUDIO_DELTA)
        await c.send({"type": "response.cancel"})
        await c.recv_until("rate_limits.updated")
        # 4. rejected and bookkeeping events
        await c.send({"type": "response.cancel", "event_id": "evt_idle_cancel"})
        await c.recv_until("error")
        first_user_item = next(
            e["item"]["id"] for e in c.events
            if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"
        )  # fmt: skip
        await c.send({"type": "conversation.item.delete", "item_id": first_user_item})
        await c.recv_until("conversation.item.deleted")
        await c.send(append)
        await c.send({"type": "input_audio_buffer.clear"})
        await c.recv_until("input_audio_buffer.cleared")
        # 5. server-VAD barge-in
        await c.send(
            {"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}}
        )
        await c.recv_until("session.updated")
        for event in (append, {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
            await c.send(event)
        await c.recv_until(AUDIO_DELTA)
        await c.send({"type": "input_audio_buffer.append", "audio": LOUD})
        await c.recv_until("rate_limits.updated")
        # 6. close
        await c.send({"type": "session.close"})
        await c.recv_until_closed()
        return c.events


@pytest.fixture(scope="module")
def ga_sim() -> Iterator[SimulatorChild]:
    with module_simulator(*SIM_ARGS) as sim:
        yield sim


@pytest.fixture(scope="module")
def ga_session(ga_sim: SimulatorChild) -> list[Event]:
    """Every event of one scripted GA session, straight from the simulator."""
    loop = asyncio.new_event_loop()  # module scope: outside any test's loop
    try:
        return loop.run_until_complete(_run_session(ga_sim.ws_url))
    finally:
        loop.close()


def test_the_scripted_session_covers_the_interesting_events(ga_session: list[Event]) -> None:
    seen = {e["type"] for e in ga_session}
    assert {
        "session.created", "session.updated", "session.heartbeat_ack", "response.speak",
        AUDIO_DELTA, "response.done", "playback.acknowledged", "response.listen", "error",
        "conversation.item.deleted", "input_audio_buffer.cleared",
        "input_audio_buffer.speech_started", "overlap.decision", "session.closed",
        "conversation.item.truncated",
    } <= seen  # fmt: skip
    statuses = [e["response"]["status"] for e in ga_session if e["type"] == "response.done"]
    assert statuses == ["completed", "cancelled", "cancelled"]
    assert ga_session[-1]["type"] == "session.closed"


def test_every_simulator_event_type_is_in_the_wheel_vocabulary(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    known = vocabulary(vllm_omni)
    assert sorted({e["type"] for e in ga_session} - known.keys()) == []


#: Remaining, deliberate differences between the simulator and the wheel's classes.
KNOWN_SIMULATOR_CLASS_DIFFERENCES: Final[dict[str, list[str]]] = {
    # The simulator puts the top-level response_id on the assistant item's
    # conversation.item.* events too (its own tests rely on "every event of a
    # response carries response_id"); the engine's ItemAdded/ItemCreated/ItemDone
    # have no such field. The sidecar must not (and does not) depend on it.
    "conversation.item.added": ["response_id: not a field of ItemAdded"],
    "conversation.item.created": ["response_id: not a field of ItemCreated"],
    "conversation.item.done": ["response_id: not a field of ItemDone"],
}


def test_simulator_events_render_like_the_wheel_classes(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    assert by_type(vllm_omni, ga_session) == KNOWN_SIMULATOR_CLASS_DIFFERENCES


# ---------------------------------------------------------- the engine's own projection

#: Emitted by the engine's runner/transport directly, not through the Realtime projection.
NOT_PROJECTED: Final = frozenset(
    {"error", "session.heartbeat_ack", "playback.acknowledged", "overlap.decision",
     "input_audio_buffer.cleared"}
)  # fmt: skip


def internal_events(session: list[Event]) -> list[Event]:
    """The engine-internal events that would make the engine send ``session``."""
    out: list[Event] = []
    items: dict[str, Event] = {}
    skip_updated = False
    for i, event in enumerate(session):
        kind = event["type"]
        if kind == "session.created":
            out.append({"type": kind, "session": event["session"],
                        "attachment_generation": event.get("attachment_generation"),
                        "resume_token": event.get("resume_token")})  # fmt: skip
            skip_updated = True  # the projection adds the first session.updated itself
        elif kind == "session.updated":
            if not skip_updated:
                out.append({"type": kind, "session": event["session"]})
            skip_updated = False
        elif kind == "conversation.item.added":
            items[event["item"]["id"]] = event["item"]
        elif kind == "input_audio_buffer.committed":
            transcript = items[event["item_id"]]["content"][0]["transcript"]
            out.append({**event["event"], "type": "input.committed",
                        "realtime_item_id": event["item_id"],
                        "message": {"role": "user", "transcript": transcript}})  # fmt: skip
        elif kind == "response.created":
            out.append({**event["response"]["metadata"]["duplex_event"], "type": kind,
                        "response_id": event["response_id"],
                        "modalities": event["response"]["modalities"]})  # fmt: skip
        elif kind == AUDIO_DELTA:
            text = session[i + 1]
            assert text["type"] == "response.output_audio_transcript.delta"
            out.append({**event["metadata"], "type": kind, "response_id": event["response_id"],
                        "audio": event["delta"], "text": text["delta"], "format": event["format"],
                        "sample_rate_hz": event["sample_rate_hz"], "model_speak": True})  # fmt: skip
        elif kind == "response.done":
            response = event["response"]
            internal = {**response["metadata"], "response_id": event["response_id"]}
            if response["status"] == "cancelled":
                out.append({**internal, "type": "audio.cancelled",
                            "reason": response["status_details"]["reason"]})  # fmt: skip
            else:
                out.append({**internal, "type": kind, "status": response["status"],
                            "status_details": response["status_details"]})  # fmt: skip
        elif kind == "response.listen":
            out.append({"type": kind, "epoch": event.get("epoch")})
        elif kind == "conversation.item.truncated":
            out.append(event["event"])  # the session's internal event, echoed by the engine
        elif kind in ("conversation.item.deleted", "input_audio_buffer.speech_started"):
            out.append(
                {k: v for k, v in event.items() if k not in ("event_id", "server_event_seq")}
            )
        elif kind == "session.closed":
            out.append({"type": kind, "session_id": event["session_id"], "reason": event["reason"]})
    return out


#: Fields whose values must agree position by position (addressing, not payload).
ADDRESSING: Final = ("response_id", "item_id", "previous_item_id", "output_index", "content_index")


def _addressing(event: Event, keys: Iterable[str]) -> dict[str, Any]:
    """The addressing fields among ``keys`` (those the engine's event has)."""
    out = {k: event.get(k) for k in ADDRESSING if k in keys}
    for key in ("item", "part"):
        if isinstance(event.get(key), dict):
            value = event[key]
            out[key] = {k: value.get(k) for k in ("id", "type", "role", "status")}
            if isinstance(value.get("content"), list):
                out[key]["content"] = [part.get("type") for part in value["content"]]
    if isinstance(event.get("response"), dict):
        response = event["response"]
        out["response"] = {k: response.get(k) for k in ("id", "status", "status_details")}
        out["response"]["output"] = [
            (item.get("id"), item.get("status"), [p.get("type") for p in item.get("content", [])])
            for item in response.get("output", [])
        ]
    return out


#: Remaining, deliberate differences to the engine's projection (top-level keys).
KNOWN_PROJECTION_KEY_DIFFERENCES: Final = {
    ("conversation.item.added", "extra", "response_id"),
    ("conversation.item.created", "extra", "response_id"),
    ("conversation.item.done", "extra", "response_id"),
}


def test_simulator_session_matches_the_engine_projection(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    projection = vllm_omni.projection
    sid = ga_session[0]["session"]["id"]
    state = projection.RealtimeProjectionState(session_id=sid, initial_session_update=True)
    engine: list[Event] = []
    for internal in internal_events(ga_session):
        engine += [e.to_realtime() for e in projection.project_internal_event(state, internal)]
    ours = [e for e in ga_session if e["type"] not in NOT_PROJECTED]

    assert [e["type"] for e in ours] == [e["type"] for e in engine]
    key_differences = set()
    for mine, theirs in zip(ours, engine):
        for key in mine.keys() - theirs.keys() - TRANSPORT_KEYS:
            key_differences.add((mine["type"], "extra", key))
        for key in theirs.keys() - mine.keys():
            key_differences.add((mine["type"], "missing", key))
    assert key_differences == KNOWN_PROJECTION_KEY_DIFFERENCES
    mismatched = [
        (i, mine["type"], _addressing(mine, theirs), _addressing(theirs, theirs))
        for i, (mine, theirs) in enumerate(zip(ours, engine))
        if _addressing(mine, theirs) != _addressing(theirs, theirs)
    ]
    assert mismatched == []


def test_session_object_has_what_the_engine_projection_adds(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    """``session.created.session``: the projection fills missing defaults (setdefault)."""
    projection = vllm_omni.projection
    session = ga_session[0]["session"]
    state = projection.RealtimeProjectionState(session_id=session["id"])
    filled = projection.realtime_session_payload(state, session)
    assert sorted(filled.keys() - session.keys()) == KNOWN_SESSION_OBJECT_MISSING


#: Keys the engine's session object always has and the simulator's lacks (informational:
#: the simulator's session object is a plausible model-native one, not the projection's).
KNOWN_SESSION_OBJECT_MISSING: Final = sorted(
    ["input_audio_format", "input_audio_transcription", "output_audio_format",
     "output_modalities", "tracing", "type"]
)  # fmt: skip


# --------------------------------------------------------------- DuplexClient's parser


async def test_duplex_client_parser_demultiplexes_the_simulator_session(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    """Feed the session into DuplexClientBase._dispatch (no transport) and read it back."""
    client_mod = vllm_omni.client

    class Replay(client_mod.DuplexClientBase):  # type: ignore[misc,name-defined]
        async def _open(self) -> None:
            return None

        async def _send_command(self, payload: dict[str, object]) -> None:
            return None

        async def _teardown(self) -> None:
            return None

    client = Replay(model="omni-sim")
    handles: list[Any] = []

    async def consume() -> None:
        while True:
            try:
                async for handle in client.responses():
                    handles.append(handle)
                return
            except client_mod.DuplexProtocolError as exc:
                assert exc.code == "response_not_active"  # the idle response.cancel

    consumer = asyncio.ensure_future(consume())
    for event in ga_session:
        await client._dispatch(dict(event))
    async with asyncio.timeout(DEADLINE):
        await consumer
    assert client.session_id == ga_session[0]["session"]["id"]
    assert client._closed.is_set() and client._closed_marker.expected

    spoken = [h for h in handles if h.decision == "speak"]
    assert [h.done_event.raw["response"]["status"] for h in spoken] == [
        "completed", "cancelled", "cancelled",
    ]  # fmt: skip
    assert [h.decision for h in handles if h.decision != "speak"] == ["listen"]
    for handle in spoken:
        deltas = [
            e
            for e in ga_session
            if e["type"] == AUDIO_DELTA and e["response_id"] == handle.response_id
        ]
        chunks = []
        async with asyncio.timeout(DEADLINE):
            async for chunk in handle.audio():
                chunks.append(chunk)
        assert b"".join(chunks) == b"".join(base64.b64decode(e["delta"]) for e in deltas)
        transcript_done = next(
            e["transcript"] for e in ga_session
            if e["type"] == "response.output_audio_transcript.done"
            and e["response_id"] == handle.response_id
        )  # fmt: skip
        assert handle.transcript == transcript_done


# ------------------------------------------------- playback ledger (the wheel's own source)


def _wheel_source(vo: VllmOmni, path: str) -> ast.Module:
    with zipfile.ZipFile(vo.wheel) as archive:
        return ast.parse(archive.read(path).decode("utf-8"))


def _literal_keys(node: ast.Dict) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _dict_with(tree: ast.AST, key: str, value: str) -> ast.Dict:
    """The one dict literal in ``tree`` that maps ``key`` to the string ``value``."""
    found = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == key
                and isinstance(v, ast.Constant) and v.value == value
                for k, v in zip(node.keys, node.values))
    ]  # fmt: skip
    assert len(found) == 1, f"{len(found)} dicts with {key}={value!r}"
    return found[0]


def wheel_playback_acknowledged_keys(vo: VllmOmni) -> tuple[set[str], set[str], set[str]]:
    """From the wheel's source (not importable: it needs torch): the keys of the
    ``playback.acknowledged`` event, of the ledger, and the ack's error codes."""
    ledger = _wheel_source(vo, "vllm_omni/engine/duplex/session/playback_ledger.py")
    event_keys = _literal_keys(_dict_with(ledger, "type", "playback.acknowledged"))
    codes = {
        node.args[0].value
        for node in ast.walk(ledger)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "error_event"
        and node.args and isinstance(node.args[0], ast.Constant)
    }  # fmt: skip
    config = _wheel_source(vo, "vllm_omni/engine/duplex/config.py")
    cursor = next(
        n
        for n in ast.walk(config)
        if isinstance(n, ast.ClassDef) and n.name == "DuplexPlaybackCursor"
    )
    as_dict = next(
        n for n in ast.walk(cursor) if isinstance(n, ast.FunctionDef) and n.name == "as_dict"
    )
    returned = next(n for n in ast.walk(as_dict) if isinstance(n, ast.Return))
    assert isinstance(returned.value, ast.Dict)
    return event_keys, _literal_keys(returned.value), codes


#: The ack errors the simulator answers with (each one in test_simulator_playback.py).
SIMULATOR_ACK_ERROR_CODES: Final = frozenset(
    {"bad_event", "playback_item_mismatch", "playback_item_not_found", "playback_ack_too_late"}
)


def test_playback_acknowledged_has_the_wheels_ledger_shape(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    event_keys, ledger_keys, codes = wheel_playback_acknowledged_keys(vllm_omni)
    acknowledged = [e for e in ga_session if e["type"] == "playback.acknowledged"]
    assert len(acknowledged) == 3
    for wire in acknowledged:
        assert wire.keys() - TRANSPORT_KEYS == {"type", "event_id", "event"}
        assert wire["event"].keys() == event_keys
        assert wire["event"]["playback"].keys() == ledger_keys
    assert [e["event"]["truncate"] for e in acknowledged] == [False, True, True]
    assert [e["event"]["committed_ms"] for e in acknowledged] == [3000, 2000, 1000]
    assert codes == SIMULATOR_ACK_ERROR_CODES


def test_audio_delta_metadata_is_what_the_engine_projection_renders(
    vllm_omni: VllmOmni, ga_session: list[Event]
) -> None:
    """Our delta ``metadata`` (ledger, cumulative duration, text marks) keeps only keys
    the engine's internal delta has, and its projection renders them unchanged."""
    channel = _wheel_source(vllm_omni, "vllm_omni/engine/duplex/session/model_channel.py")
    internal = _dict_with(channel, "type", "response.output_audio.delta")
    # Keys the wheel adds to that payload after building it (payload["..."] = ...).
    internal_keys = _literal_keys(internal) | {
        node.slice.value
        for node in ast.walk(channel)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
        and getattr(node.value, "id", "") == "payload" and isinstance(node.slice, ast.Constant)
    }  # fmt: skip
    projection = vllm_omni.projection
    sid = ga_session[0]["session"]["id"]
    state = projection.RealtimeProjectionState(session_id=sid)
    deltas = [e for e in ga_session if e["type"] == AUDIO_DELTA]
    assert deltas
    for delta in deltas:
        meta = delta["metadata"]
        assert meta.keys() <= internal_keys, meta.keys() - internal_keys
        rendered = [
            e.to_realtime()
            for e in projection.project_internal_event(
                state,
                {
                    **meta,
                    "type": AUDIO_DELTA,
                    "response_id": delta["response_id"],
                    "audio": delta["delta"],
                    "format": delta["format"],
                    "sample_rate_hz": delta["sample_rate_hz"],
                },
            )
        ]
        wire = next(e for e in rendered if e["type"] == AUDIO_DELTA)
        assert wire["metadata"] == meta


# ------------------------------------- history and ledger against the engine's own session


@pytest.fixture(scope="module")
def engine_session(vllm_omni: VllmOmni) -> EngineSession:
    # Imported here: the plugin module must be imported by pytest first (assert rewriting).
    from tests.integration.vllm_omni_wheel import WheelUnavailable, load_engine_session

    try:
        return load_engine_session(vllm_omni)
    except WheelUnavailable as exc:
        pytest.skip(f"the engine's session modules are unavailable: {exc}")


DIFF_CHUNK_MS: Final = 200
DIFF_CHUNKS: Final = 5


class WheelSide:
    """The wheel's ``DuplexEngineSession`` + ``apply_playback_ack``, driven the way its
    session runner does on begin, audio, completion, cancel and an idle clear (the
    runner itself needs torch; this glue paraphrases its calls)."""

    def __init__(self, es: EngineSession, policy: str) -> None:
        config = es.config.DuplexSessionConfig(playback_commit_policy=policy)
        self.s = es.engine_session.DuplexEngineSession(session_id="duplex-w", config=config)
        self.apply_ack = es.playback_ledger.apply_playback_ack
        self.rids: list[str] = []

    def commit(self) -> None:
        self.s.commit_audio_input(transcript="user")

    def begin(self) -> None:
        self.rids.append(self.s.begin_response())

    def chunk(self, text: str) -> None:
        before = self.s.playback.sent_ms
        self.s.append_assistant_text(text)
        self.s.mark_audio_sent(
            before + DIFF_CHUNK_MS, text_chars=len(self.s.assistant_transcript())
        )

    def complete(self) -> bool:
        rid = self.s.active_response_id
        message = self.s.end_response(commit_text=True)
        self.s.register_history_item(f"item_{rid}", message)
        return message is not None

    def cancel(self) -> None:
        s = self.s
        rid, committed = s.active_response_id, s.playback.committed_ms
        message = s.end_response(commit_text=True, playback_commit_policy="ack_only")
        item = f"item_{rid}"
        if message is not None:
            s.register_history_item(item, message)
        elif committed > 0 and not s.playback_ack_is_too_late(rid, item):
            s.truncate_history_item(item, audio_end_ms=committed)
        s.barge_in()
        s.clear_playback_cursor()

    def waiting(self) -> bool:
        playback = self.s.playback
        return bool(
            self.s.config.playback_commit_policy == "ack_only"
            and playback.sent_ms > playback.committed_ms
        )

    def clear_idle(self) -> None:
        s = self.s
        if self.waiting():
            last = s.last_response_id
            s.truncate_history_item(
                f"item_{last}",
                audio_end_ms=s.playback.committed_ms,
                playback=s.playback_for_response(last),
            )
            s.barge_in()
        s.clear_playback_cursor()

    def ack(self, k: int, **fields: Any) -> Event:
        rid = self.rids[k]
        (event,) = self.apply_ack(
            self.s, {"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}", **fields}
        )
        details = getattr(event, "details", None)
        return dict(details) if details is not None else {"code": event.code}

    def text(self, k: int) -> str | None:
        message = self.s.history_item_ids.get(f"item_{self.rids[k]}")
        return (message.get("content") or None) if message is not None else None


class SimSide:
    """The simulator's session core, fed the same client events (socket-free)."""

    def __init__(self, policy: str) -> None:
        from engine_launcher.simulator import DuplexSession, SimulatorConfig, SimulatorStats
        from engine_launcher.simulator.audio import make_audio_bank
        from engine_launcher.simulator.handlers import HANDLERS

        config = SimulatorConfig(
            chunk_ms=DIFF_CHUNK_MS, response_seconds=DIFF_CHUNKS * DIFF_CHUNK_MS / 1000,
            realtime_factor=0, late_audio_chunks=0, deterministic=True,
            playback_commit_policy=policy,
        )  # fmt: skip
        bank = make_audio_bank(DIFF_CHUNK_MS, 8000)
        self.s = DuplexSession(config, bank, SimulatorStats(), handlers=HANDLERS)
        self.rids: list[str] = []
        self.send({"type": "session.update", "session": {}})

    def send(self, event: Event) -> list[Event]:
        self.s.receive_text(orjson.dumps(event).decode())
        return [orjson.loads(f) for f in self.s.events_to_send() if isinstance(f, str)]

    def commit(self) -> None:
        self.send({"type": "input_audio_buffer.append", "audio": SILENCE})
        self.send({"type": "input_audio_buffer.commit"})

    def begin(self) -> None:
        assert self.send({"type": "response.create"})[0]["type"] == "response.created"
        self.rids += self.s.responses_to_start()

    def chunk(self) -> tuple[str, list[Event]]:
        self.s.produce_chunk(self.rids[-1])
        events = [orjson.loads(f) for f in self.s.events_to_send() if isinstance(f, str)]
        text = next(e["delta"] for e in events if e["type"] == TEXT_DELTA)
        return text, events

    def ack(self, k: int, **fields: Any) -> Event:
        rid = self.rids[k]
        last = self.send(
            {"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}", **fields}
        )[-1]
        return {"code": last["error"]["code"]} if last["type"] == "error" else dict(last["event"])

    def text(self, k: int) -> str | None:
        # What the model believes it said, as conversation.item.retrieve reports it.
        rid = self.rids[k]
        if self.s.history.get(f"item_{rid}") is None:
            return self.s.records[rid].text  # still running: not retrievable yet
        (retrieved,) = self.send({"type": "conversation.item.retrieve", "item_id": f"item_{rid}"})
        return retrieved["item"]["content"][0]["transcript"] or None


TEXT_DELTA: Final = "response.output_audio_transcript.delta"


def _same_ack(wheel: Event, sim: Event, w: WheelSide, s: SimSide) -> tuple[Event, Event]:
    """Both answers with ids made comparable (response ids differ by construction)."""
    out = []
    for answer, rids in ((wheel, w.rids), (sim, s.rids)):
        answer = {k: v for k, v in answer.items() if k != "session_id"}
        if isinstance(answer.get("item_id"), str):
            answer["item_id"] = rids.index(answer["item_id"].removeprefix("item_"))
        out.append(answer)
    return out[0], out[1]


def _differential_run(es: EngineSession, seed: int) -> None:
    rng = random.Random(seed)
    policy = rng.choice(["commit_all_on_done", "ack_only"])
    w, s = WheelSide(es, policy), SimSide(policy)
    log: list[object] = [seed, policy]

    def check(step: str) -> None:
        for k in range(len(s.rids)):
            assert w.text(k) == s.text(k), (step, k, log)
        assert w.waiting() == s.s.playback_wait, (step, log)

    def ack(k: int, fields: dict[str, Any]) -> None:
        log.append(("ack", k, fields))
        theirs, ours = _same_ack(w.ack(k, **fields), s.ack(k, **fields), w, s)
        assert ours == theirs, log

    for _ in range(rng.randint(1, 2)):
        if s.s.playback_wait:
            log.append("clear")
            w.clear_idle()
            s.send({"type": "output_audio_buffer.clear"})
            check("clear")
        w.commit()
        s.commit()
        w.begin()
        s.begin()
        k = len(s.rids) - 1
        chunks = rng.randint(1, DIFF_CHUNKS)
        done: Event | None = None
        for i in range(chunks):
            text, events = s.chunk()
            w.chunk(text)
            done = next((e for e in events if e["type"] == "response.done"), None)
            if done is not None:
                log.append("complete")
                assert done["response"]["metadata"]["committed"] == w.complete(), log
                break
            if rng.random() < 0.1:
                log.append("user commit while speaking")
                w.commit()
                s.commit()
            if rng.random() < 0.3:
                fields: dict[str, Any] = {"played_ms": rng.randint(0, (i + 1) * DIFF_CHUNK_MS)}
                if rng.random() < 0.2:
                    fields["truncate"] = True
                ack(k, fields)
        if done is None:
            log.append("cancel")
            w.cancel()
            s.send({"type": "response.cancel"})
        check("end")
        for _ in range(rng.randint(0, 3)):
            roll = rng.random()
            if roll < 0.15:
                log.append("user commit")
                w.commit()
                s.commit()
            elif roll < 0.25:
                log.append("clear")
                w.clear_idle()
                s.send({"type": "output_audio_buffer.clear"})
            else:
                fields = {"played_ms": rng.choice([0, 100, 200, 300, 500, 800, 1000, 1200])}
                if rng.random() < 0.4:
                    fields["committed_ms"] = rng.choice([0, 150, 400, 1000])
                if rng.random() < 0.3:
                    fields["truncate"] = True
                ack(rng.randrange(len(s.rids)), fields)
            check("after")


def test_history_and_acks_match_the_engines_own_session_bookkeeping(
    engine_session: EngineSession,
) -> None:
    """Random sessions (policy, acks while speaking and after, truncating acks, user
    turns committed in between, cancels, idle clears) run on the simulator and on the
    wheel's ``DuplexEngineSession``: every ``playback.acknowledged`` (or its error),
    the assistant text history holds, ``response.done``'s ``committed`` and whether
    the next response would be refused agree step by step."""
    for seed in range(200):
        _differential_run(engine_session, seed)


# --------------------------------------------------------------------------- resume


def test_resume_events_render_like_the_wheel_classes(vllm_omni: VllmOmni) -> None:
    """session.resumed/replaced/resync_required/expired of the simulator's core (no socket)."""
    from engine_launcher.simulator import DuplexSession, SimulatorConfig, SimulatorStats
    from engine_launcher.simulator.audio import make_audio_bank
    from engine_launcher.simulator.handlers import HANDLERS
    from engine_launcher.simulator.session_resume import EngineResumeRequest, ResyncRequired

    def core(**flags: Any) -> DuplexSession:
        config = SimulatorConfig(chunk_ms=100, response_seconds=1, **flags)
        return DuplexSession(
            config, make_audio_bank(100, 8000), SimulatorStats(), handlers=HANDLERS
        )

    def frames(s: DuplexSession) -> list[Event]:
        return [orjson.loads(f) for f in s.events_to_send() if isinstance(f, str)]

    s = core(replay_max_bytes=3000)
    s.receive_text(orjson.dumps({"type": "session.update", "session": {}}).decode())
    token = frames(s)[0]["resume_token"]
    s.detach(now=1.0)
    s.resume(EngineResumeRequest(s.session_id, token, 1), now=2.0)
    events = frames(s) + [orjson.loads(s.replaced_frame(1))]
    append = {"type": "input_audio_buffer.append", "audio": pcm16_b64(100)}
    for event in (append, {"type": "input_audio_buffer.commit", "response_create": True}):
        s.receive_text(orjson.dumps(event).decode())
    (rid,) = s.responses_to_start()
    for _ in range(3):
        s.produce_chunk(rid)  # past 3000 bytes: journal_overflow
    events += frames(s)
    s.expire()
    events += frames(s)
    refused = core()
    refused.refuse_resume(ResyncRequired(s.session_id, "journal_gap"))
    events += frames(refused)
    kinds = {e["type"] for e in events}
    assert {"session.resumed", "session.replaced", "session.resync_required",
            "session.expired"} <= kinds  # fmt: skip
    assert by_type(vllm_omni, [e for e in events if e["type"].startswith("session.")]) == {}
