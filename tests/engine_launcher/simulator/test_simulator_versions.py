"""``--engine-version 0.30|0.31|0.32``: what each simulated engine release does.

Most tests drive a simulator child over a real socket (no sidecar) and assert
what a client observes: the three overflow events in order and close 1000, no
audio of a cancelled response left in the engine's queue on 0.31+, gap-free
``server_event_seq``, 0.32's truncation rules and ``event_id``-less ack errors,
the capacity error, and the plain realtime handler's ``invalid_event``. A few
drive the sans-I/O session directly where the wire cannot show a property
exactly (the reserve, the order inside one overflow). docs/design.md, Simulator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import pytest

from engine_launcher.simulator.audio import make_audio_bank
from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.delivery import (
    OutputEntry,
    OutputLimits,
    OutputOverflow,
    OutputQueue,
)
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.flags import SimulatorConfig, build_parser, parse_args
from engine_launcher.simulator.handlers import HANDLERS
from engine_launcher.simulator.outbox import CloseFrame
from engine_launcher.simulator.releases import ENGINE_VERSIONS, release_of
from tests.conftest import DEADLINE, wait_until
from tests.integration.helpers import (
    AUDIO_DELTA,
    Client,
    SimulatorChild,
    connect,
    module_simulator,
    pcm16_b64,
    sim_metric,
)

Event = dict[str, Any]

#: Every release the simulator plays (engine_launcher/simulator/releases.py); the
#: tests read what each does from its row, so a new release runs them all.
VERSIONS: Final = ENGINE_VERSIONS
BOUNDED: Final = tuple(v for v in VERSIONS if release_of(v).bounded_output)
APPEND: Final = {"type": "input_audio_buffer.append", "audio": pcm16_b64(100)}
ASK: Final = (APPEND, {"type": "input_audio_buffer.commit"}, {"type": "response.create"})
#: A long reply produced as fast as possible, in big (4 s, ~256 KB) deltas:
#: enough to fill the loopback socket buffers and queue inside the engine.
FLOOD_ARGS: Final = ("--realtime-factor", "0", "--chunk-ms", "4000", "--response-seconds", "600")
#: The same reply paced at one delta per 20 ms (~13 MB/s): still generating
#: when a stalled reader's cancel arrives.
PACED_FLOOD_ARGS: Final = (
    "--chunk-ms", "4000", "--response-seconds", "600", "--generation-speed", "200",
)  # fmt: skip


def assert_seq_gap_free(events: list[Event]) -> None:
    """``server_event_seq`` runs 1, 2, 3, ... over everything read (session.created has none)."""
    seqs = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert seqs == list(range(1, len(seqs) + 1)), f"gap or repeat in {seqs[:5]}...{seqs[-5:]}"


async def ask(c: Client) -> None:
    for event in ASK:
        await c.send(event)


# ------------------------------------------------------------------- the queue itself


def _entry(size: int) -> OutputEntry:
    return OutputEntry(payload={"type": "x"}, size=size)


def test_queue_reserve_takes_only_errors_and_response_done_and_keeps_fifo() -> None:
    q = OutputQueue(OutputLimits(max_bytes=100, max_events=2, reserve_bytes=50, reserve_events=1))
    q.put(_entry(40))
    q.put(_entry(40))
    with pytest.raises(OutputOverflow):
        q.put(_entry(1))  # events budget spent, not allowed in the reserve
    q.put(_entry(30), may_reserve=True)
    with pytest.raises(OutputOverflow):
        q.put(_entry(1), may_reserve=True)  # the reserve holds one event
    q.put_final("closed")
    assert (q.events, q.bytes) == (3, 110)
    popped = [q.pop(), q.pop(), q.pop()]
    assert [e.size for e in popped if isinstance(e, OutputEntry)] == [40, 40, 30]
    assert q.pop() == "closed" and q.pop() is None and q.bytes == 0


def test_unbounded_queue_on_030_never_overflows() -> None:
    q = OutputQueue(None)
    for _ in range(10_000):
        q.put(_entry(1_000_000))
    assert q.events == 10_000


def _core(version: str, **flags: Any) -> DuplexSession:
    config = SimulatorConfig(
        chunk_ms=100, response_seconds=10, engine_version=version, deterministic=True, **flags
    )
    return DuplexSession(config, make_audio_bank(100, 8000), SimulatorStats(), handlers=HANDLERS)


def _frames(session: DuplexSession) -> tuple[list[Event], list[CloseFrame]]:
    frames = session.events_to_send()
    closes = [f for f in frames if isinstance(f, CloseFrame)]
    return [json.loads(f) for f in frames if isinstance(f, str)], closes


@pytest.mark.parametrize("version", BOUNDED)
def test_core_overflow_ends_with_error_failed_done_and_closed(version: str) -> None:
    s = _core(version, max_pending_output_events=20)
    for text in (APPEND, {"type": "input_audio_buffer.commit", "response_create": True}):
        s.receive_text(json.dumps(text))
    (rid,) = s.responses_to_start()
    for _ in range(30):  # nobody drains: the 20-event budget runs out
        s.produce_chunk(rid)
    events, closes = _frames(s)
    assert [e["type"] for e in events[-3:]] == ["error", "response.done", "session.closed"]
    error, done, closed = events[-3:]
    assert error["error"] == {
        "type": "rate_limit_error",
        "code": "output_backpressure",
        "message": "duplex session pending output limit exceeded",
    }
    assert done["response_id"] == rid and done["response"]["status"] == "failed"
    assert done["response"]["status_details"] == {"type": "failed", "reason": "output_backpressure"}
    assert closed["reason"] == "output_backpressure"
    assert closes == [CloseFrame(1000, "output_backpressure")]
    # The failed response's queued audio was removed before numbering: no gap.
    assert AUDIO_DELTA not in [e["type"] for e in events]
    assert_seq_gap_free(events)


# --------------------------------------------------------------------- over sockets


@pytest.fixture(scope="module", params=BOUNDED)
def small_bound_sim(request: pytest.FixtureRequest) -> Iterator[SimulatorChild]:
    """0.31/0.32 with a 512 KiB output bound: a stalled reader overflows it at once."""
    with module_simulator(
        *FLOOD_ARGS, "--engine-version", request.param, "--max-pending-output-bytes", "524288"
    ) as sim:
        yield sim


async def test_a_stalled_reader_gets_the_three_overflow_events_in_order_then_1000(
    small_bound_sim: SimulatorChild,
) -> None:
    # Read before asking: the overflow may come before a read after it would.
    before = await sim_metric(small_bound_sim, "vllm_omni_sim_output_overflows_total")
    async with connect(small_bound_sim.ws_url, receive_buffer_bytes=16384) as c:
        await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
        await ask(c)

        async def overflowed() -> bool:
            now = await sim_metric(small_bound_sim, "vllm_omni_sim_output_overflows_total")
            return now > before

        await wait_until(overflowed, what="the simulator's output overflow")  # not reading
        events = await c.recv_until_closed()
    assert [e["type"] for e in events[-3:]] == ["error", "response.done", "session.closed"]
    error, done, closed = events[-3:]
    assert error["error"]["code"] == "output_backpressure"
    assert error["error"]["type"] == "rate_limit_error" and "event_id" not in error["error"]
    assert done["response"]["status_details"] == {"type": "failed", "reason": "output_backpressure"}
    assert closed["reason"] == "output_backpressure"
    assert c.close_code == 1000
    assert_seq_gap_free(events)


async def test_030_queues_without_bound_for_a_stalled_reader(simulator: Any) -> None:
    sim = await simulator(*FLOOD_ARGS)  # 0.30 by default
    async with connect(sim.ws_url, receive_buffer_bytes=16384) as c:
        await ask(c)

        async def grown() -> bool:
            queued = await sim_metric(sim, "vllm_omni_sim_outbox_bytes")
            return queued > 4 * 1024 * 1024

        await wait_until(grown, what="0.30's queue past 4 MiB")
        assert await sim_metric(sim, "vllm_omni_sim_output_overflows_total") == 0
        assert not c.ws.closed


@pytest.mark.parametrize("version", VERSIONS)
async def test_cancel_with_audio_queued_in_the_engine(simulator: Any, version: str) -> None:
    """0.31+: the cancel removes the queued audio (none after it, seq gap-free); 0.30 sends it all.

    The client does not read until the engine has audio queued, then cancels
    and reads to the cancelled ``response.done``.
    """
    release = release_of(version)
    bound = ("--max-pending-output-bytes", str(256 * 1024 * 1024)) if release.bounded_output else ()
    sim = await simulator(*PACED_FLOOD_ARGS, "--engine-version", version, *bound)
    async with connect(sim.ws_url, receive_buffer_bytes=16384) as c:
        await ask(c)

        async def queued() -> bool:
            return await sim_metric(sim, "vllm_omni_sim_outbox_events") >= 10

        await wait_until(queued, what="audio queued inside the engine")
        await c.send({"type": "response.cancel"})
        await c.recv_until("rate_limits.updated", timeout=3 * DEADLINE)
        removed = await sim_metric(sim, "vllm_omni_sim_removed_audio_events_total")
        late = await sim_metric(sim, "vllm_omni_sim_late_audio_events_total")
    done = next(e for e in c.events if e["type"] == "response.done")
    assert done["response"]["status"] == "cancelled"
    received = sum(1 for e in c.events if e["type"] == AUDIO_DELTA)
    generated = done["response"]["metadata"]["playback"]["generated_ms"] // 4000
    assert_seq_gap_free(c.events)
    if not release.drops_cancelled_audio:
        assert removed == 0 and late == 3
        assert received == generated  # everything queued, plus the late chunks, arrived
    else:
        assert late == 0 and removed >= 1
        assert received + removed == generated


# ------------------------------------------------------------------ playback, 0.32


@pytest.fixture(scope="module", params=VERSIONS)
def paced_sim(request: pytest.FixtureRequest) -> Iterator[SimulatorChild]:
    """1 s chunks at real-time pace: a cancel right after response.created beats all audio."""
    with module_simulator(
        "--engine-version",
        request.param,
        "--supports-audio-truncate",
        "--response-seconds",
        "3",
        "--late-audio-chunks",
        "0",
    ) as sim:
        sim.version = request.param  # type: ignore[attr-defined]
        yield sim


async def _reply_without_audio(c: Client) -> str:
    await c.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    await ask(c)
    rid = str((await c.recv_until("response.created"))["response"]["id"])
    await c.send({"type": "response.cancel"})
    await c.recv_until("rate_limits.updated")
    return rid


async def test_truncation_of_a_reply_that_produced_no_audio(paced_sim: SimulatorChild) -> None:
    """0.32: a truncating ack or conversation.item.truncate for it is bad_event (the ack's
    without event_id); 0.31 ignores the ack's truncate flag; 0.30 applies both."""
    release = release_of(paced_sim.version)  # type: ignore[attr-defined]
    async with connect(paced_sim.ws_url + "?autostart=0") as c:
        rid = await _reply_without_audio(c)
        assert not [e for e in c.events if e["type"] == AUDIO_DELTA]
        ack = {"type": "playback.ack", "event_id": "evt_ack", "response_id": rid,
               "item_id": f"item_{rid}", "played_ms": 0, "truncate": True}  # fmt: skip
        await c.send(ack)
        answer = await c.recv_until(lambda e: e["type"] in ("error", "playback.acknowledged"))
        truncate = {"type": "conversation.item.truncate", "event_id": "evt_cut",
                    "item_id": f"item_{rid}", "content_index": 0, "audio_end_ms": 0}  # fmt: skip
        await c.send(truncate)
        cut = await c.recv_until(lambda e: e["type"] in ("error", "conversation.item.truncated"))
    if release.truncate_needs_audio_item:
        assert answer["type"] == "error" and answer["error"]["code"] == "bad_event"
        assert ("event_id" in answer["error"]) is release.ack_errors_carry_event_id
        assert cut["type"] == "error" and cut["error"]["code"] == "bad_event"
        assert cut["error"]["event_id"] == "evt_cut"
    else:
        assert answer["type"] == "playback.acknowledged"
        assert answer["event"]["truncate"] is release.ack_truncate_flag
        assert cut["type"] == "conversation.item.truncated"


async def test_ack_errors_carry_the_event_id_before_032_only(paced_sim: SimulatorChild) -> None:
    release = release_of(paced_sim.version)  # type: ignore[attr-defined]
    async with connect(paced_sim.ws_url + "?autostart=0") as c:
        await c.send({"type": "session.update", "session": {}})
        await c.recv_until("session.updated")
        await c.send({"type": "playback.ack", "event_id": "evt_nf", "response_id": "resp-nope",
                      "item_id": "item_resp-nope", "played_ms": 10})  # fmt: skip
        error = await c.recv_until("error")
    assert error["error"]["code"] == "playback_item_not_found"
    expected = "evt_nf" if release.ack_errors_carry_event_id else None
    assert error["error"].get("event_id") == expected


# ---------------------------------------------------------------------- capacity


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_full_engine_accepts_then_refuses_the_open_and_closes_1000(
    simulator: Any, version: str
) -> None:
    sim = await simulator("--engine-version", version, "--max-sessions", "1")
    async with connect(sim.ws_url + "?autostart=0") as first:
        await first.send({"type": "session.update", "session": {}})
        await first.recv_until("session.updated")
        async with connect(sim.ws_url + "?autostart=0") as second:
            await second.send({"type": "session.update", "session": {}})
            events = await second.recv_until_closed()
        assert [e["type"] for e in events] == ["error"]
        error = events[0]["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted"
        assert error["message"] == "duplex_session_capacity_exhausted: limit=1"
        # docs/engine-protocol.md: only 0.32 marks it retryable; 0.30 and 0.31 carry no
        # such field at all (not even false).
        if release_of(version).open_rejections_retryable:
            assert error["retryable"] is True
        else:
            assert "retryable" not in error, error
        assert "server_event_seq" not in events[0]
        assert second.close_code == 1000
        # A dropped socket would only detach the session (its slot held for the
        # disconnect grace, test_simulator_resume.py): session.close frees it.
        await first.send({"type": "session.close"})
        await first.recv_until_closed()

    # The slot comes back once the first session is over (its socket closes last).
    async def no_socket() -> bool:
        return await sim_metric(sim, "vllm_omni_sim_sessions_active") == 0

    await wait_until(no_socket, what="the first session over")
    async with connect(sim.ws_url + "?autostart=0") as third:
        await third.send({"type": "session.update", "session": {}})
        for _ in range(int(DEADLINE / 0.05)):
            event = await third.recv()
            if event["type"] in ("session.updated", "error"):
                break
        if event["type"] == "error":  # the first socket's cleanup raced this open
            pytest.fail(f"slot not released: {event}")


# ------------------------------------------------------------- non-duplex handler


@pytest.fixture(scope="module")
def plain_sim() -> Iterator[SimulatorChild]:
    with module_simulator(
        "--engine-version", "0.32", "--session-mode", "realtime", "--realtime-factor", "0",
        "--response-seconds", "1",
    ) as sim:  # fmt: skip
        yield sim


@pytest.mark.parametrize(
    "event_type",
    ["playback.ack", "barge_in", "turn.signal", "input.cancel", "session.resume",
     "output_audio_buffer.clear", "session.close"],
)  # fmt: skip
async def test_plain_realtime_answers_duplex_only_events_with_invalid_event(
    plain_sim: SimulatorChild, event_type: str
) -> None:
    async with connect(plain_sim.ws_url) as c:
        created = await c.recv()
        assert created["type"] == "session.created" and "server_event_seq" not in created
        await c.send({"type": event_type, "event_id": "evt_1", "played_ms": 1})
        error = await c.recv_until("error")
    assert error["error"]["code"] == "invalid_event"
    assert error["error"]["type"] == "invalid_request_error"
    # Only output_audio_buffer.clear passes the OpenAI schema and keeps its event_id.
    echoed = "evt_1" if event_type == "output_audio_buffer.clear" else None
    assert error["error"]["event_id"] == echoed


async def test_plain_realtime_still_answers_a_turn_without_seq(plain_sim: SimulatorChild) -> None:
    async with connect(plain_sim.ws_url) as c:
        await ask(c)
        await c.recv_until("response.done")
    assert AUDIO_DELTA in c.types()
    assert not [e for e in c.events if "server_event_seq" in e]


async def test_plain_realtime_refuses_duplex(plain_sim: SimulatorChild) -> None:
    async with connect(plain_sim.ws_url + "?duplex=1") as c:
        events = await c.recv_until_closed()
    assert events == [
        {"type": "error", "code": "unsupported", "error": "VAD realtime is not enabled"}
    ]
    assert c.close_code == 1008


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-pending-output-bytes", "1000"],  # 0.30 has no bound
        ["--session-mode", "realtime"],  # 0.30 has no plain handler here
        ["--engine-version", "9.99"],
        ["--engine-version", "0.31", "--output-reserve-events", "0"],
        ["--max-sessions", "0"],
    ],
)
def test_flags_that_do_not_fit_the_version_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("python -m engine_launcher.simulator")
    )


def test_help_says_what_each_version_does() -> None:
    text = " ".join(build_parser().format_help().split())
    for phrase in (*(f"{v}:" for v in VERSIONS), "output_backpressure", "--max-sessions"):
        assert phrase in text


# -- audio profiles ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], (24000, 1000, "pcm16")),
        (["--audio-profile", "minicpmo"], (24000, 1000, "pcm16")),
        (["--audio-profile", "nemotron"], (22050, 80, "pcm_f32le")),
        (["--audio-profile", "nemotron", "--chunk-ms", "200"], (22050, 200, "pcm_f32le")),
        (["--audio-profile", "nemotron", "--sample-rate", "24000"], (24000, 80, "pcm_f32le")),
    ],
)
def test_an_audio_profile_sets_the_formats_and_explicit_flags_win(
    argv: list[str], expected: tuple[int, int, str]
) -> None:
    config = parse_args(argv)
    assert (config.sample_rate, config.chunk_ms, config.input_format) == expected
