"""The simulator's playback ledger, commit policies and truncation, over real sockets.

Each test drives a simulator child directly (no sidecar) and checks what a
client and the ``GET /debug/history`` reader observe: ``playback.acknowledged``
and its ledger, ``response.done`` metadata, ``conversation.item.retrieve``
(what the model believes it said), ``response_already_active`` while an
``ack_only`` reply is unacknowledged, ``conversation.item.truncated``, and the
pace of ``--generation-speed``. The rules are vLLM-Omni 0.30's
(docs/design.md, Simulator).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Final

import aiohttp
import pytest

from tests.conftest import TIMEOUT_FACTOR
from tests.integration.helpers import Client, SimulatorChild, connect, module_simulator, pcm16_b64

Event = dict[str, Any]

AUDIO_DELTA: Final = "response.output_audio.delta"
TEXT_DELTA: Final = "response.output_audio_transcript.delta"
#: 5 chunks of 200 ms (a 1000 ms reply), produced as fast as possible.
FAST_ARGS: Final = (
    "--deterministic", "--chunk-ms", "200", "--response-seconds", "1", "--realtime-factor", "0",
)  # fmt: skip
CHUNK_MS: Final = 200
REPLY_MS: Final = 1000
APPEND: Final = {"type": "input_audio_buffer.append", "audio": pcm16_b64(100)}


@pytest.fixture(scope="module")
def truncating_sim() -> Iterator[SimulatorChild]:
    """Default policy (commit_all_on_done), conversation.item.truncate supported."""
    with module_simulator(*FAST_ARGS, "--supports-audio-truncate") as sim:
        yield sim


@pytest.fixture(scope="module")
def ack_only_sim() -> Iterator[SimulatorChild]:
    """ack_only by CLI default, no truncate support."""
    with module_simulator(*FAST_ARGS, "--playback-commit-policy", "ack_only") as sim:
        yield sim


@pytest.fixture(scope="module")
def fast_generation_sim() -> Iterator[SimulatorChild]:
    """Real-time pace of 100 ms chunks, generated 4x faster: a 2 s reply in ~0.5 s."""
    with module_simulator(
        "--deterministic", "--chunk-ms", "100", "--response-seconds", "2",
        "--generation-speed", "4",
    ) as sim:  # fmt: skip
        yield sim


# ----------------------------------------------------------------------------- helpers


async def open_session(c: Client, **session: Any) -> Event:
    """``session.update`` (the first one opens); return ``session.updated``'s session."""
    await c.send(
        {"type": "session.update", "session": {"modalities": ["audio", "text"], **session}}
    )
    return dict((await c.recv_until("session.updated"))["session"])


async def ask(c: Client) -> None:
    """Commit 100 ms of input and ask for a response."""
    for event in (APPEND, {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
        await c.send(event)


async def full_reply(c: Client) -> tuple[str, Event]:
    """Ask, read to ``response.done``; return (response_id, response.done)."""
    await ask(c)
    done = await c.recv_until("response.done")
    await c.recv_until("rate_limits.updated")
    return done["response_id"], done


def spoken(c: Client, rid: str, chunks: int) -> str:
    """The transcript of the first ``chunks`` deltas of ``rid`` (what that much audio says)."""
    texts = [e["delta"] for e in c.events if e["type"] == TEXT_DELTA and e["response_id"] == rid]
    return "".join(texts[:chunks]).rstrip()


async def retrieve_text(c: Client, item_id: str) -> str:
    await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
    item = (await c.recv_until("conversation.item.retrieved"))["item"]
    assert item["id"] == item_id
    return str(item["content"][0]["transcript"])


async def ack(
    c: Client, rid: str, played: int, committed: int | None = None, **extra: Any
) -> Event:
    """Send ``playback.ack`` for ``rid``; return the next acknowledged-or-error event."""
    event: Event = {"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}",
                    "played_ms": played, **extra}  # fmt: skip
    if committed is not None:
        event["committed_ms"] = committed
    await c.send(event)
    return await c.recv_until(lambda e: e["type"] in ("playback.acknowledged", "error"))


async def debug_history(sim: SimulatorChild, session_id: str) -> Event:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{sim.http_url}/debug/history") as resp,
    ):
        assert resp.status == 200
        body = await resp.json()
    return dict(body["sessions"][session_id])


async def create_outcome(c: Client, *, commit: bool) -> str:
    """``response.create`` (after a new user turn when ``commit``); return
    ``response.created`` or the error code.

    Without ``commit`` the turn count stays: a user commit before the first ack
    would make that ack ``playback_ack_too_late``.
    """
    if commit:
        await ask(c)
    else:
        await c.send({"type": "response.create"})
    event = await c.recv_until(
        lambda e: (
            e["type"] == "response.created"
            or (e["type"] == "error" and e["error"]["code"] == "response_already_active")
        )
    )
    return "response.created" if event["type"] == "response.created" else "response_already_active"


def ledger(generated: int, played: int, committed: int) -> dict[str, int]:
    return {"generated_ms": generated, "sent_ms": generated, "played_ms": played,
            "committed_ms": committed}  # fmt: skip


# ------------------------------------------------------------------- commit_all_on_done


async def test_commit_all_on_done_history_gets_the_whole_reply_without_acks(
    truncating_sim: SimulatorChild,
) -> None:
    async with connect(truncating_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c)
        assert session["playback_commit_policy"] == "commit_all_on_done"
        rid, done = await full_reply(c)
        meta = done["response"]["metadata"]
        assert meta["committed"] is True
        assert meta["playback"] == ledger(REPLY_MS, 0, 0)
        whole = spoken(c, rid, 5)
        assert await retrieve_text(c, f"item_{rid}") == whole
        history = await debug_history(truncating_sim, session["id"])
        assert history["playback_commit_policy"] == "commit_all_on_done"
        assistant = history["items"][-1]
        assert (assistant["id"], assistant["role"], assistant["text"], assistant["audio_ms"]) == (
            f"item_{rid}", "assistant", whole, REPLY_MS,
        )  # fmt: skip
        assert history["items"][0]["role"] == "user" and history["pending"] == []
        # Nothing waits for playback under this policy.
        assert await create_outcome(c, commit=True) == "response.created"


async def test_partial_ack_cuts_history_and_a_full_ack_restores_it(
    truncating_sim: SimulatorChild,
) -> None:
    async with connect(truncating_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c)
        rid, _ = await full_reply(c)
        answer = await ack(c, rid, 2 * CHUNK_MS)
        # The wheel's shape: everything under ``event``; committed_ms defaults to played_ms.
        assert answer == {
            "type": "playback.acknowledged",
            "event_id": answer["event_id"],
            "server_event_seq": answer["server_event_seq"],
            "event": {
                "type": "playback.acknowledged",
                "session_id": session["id"],
                "epoch": 0,
                "item_id": f"item_{rid}",
                "played_ms": 400,
                "committed_ms": 400,
                "truncate": False,
                "playback": ledger(REPLY_MS, 400, 400),
                "history_committed": True,
            },
        }
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 2)
        answer = await ack(c, rid, REPLY_MS, REPLY_MS)
        assert answer["event"]["history_committed"] is True
        assert answer["event"]["playback"] == ledger(REPLY_MS, REPLY_MS, REPLY_MS)
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 5)


# ---------------------------------------------------------------------------- ack_only


async def test_ack_only_history_waits_for_acks_and_the_next_response_waits_for_playback(
    truncating_sim: SimulatorChild,
) -> None:
    async with connect(truncating_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c, playback_commit_policy="ack_only")
        assert session["playback_commit_policy"] == "ack_only"
        rid, done = await full_reply(c)
        assert done["response"]["metadata"]["committed"] is False
        assert await retrieve_text(c, f"item_{rid}") == ""
        history = await debug_history(truncating_sim, session["id"])
        assert [e["id"] for e in history["pending"]] == [f"item_{rid}"]
        assert [e["role"] for e in history["items"]] == ["user"]

        assert await create_outcome(c, commit=False) == "response_already_active"
        # A partial ack commits that much; the rest is still unacknowledged.
        answer = await ack(c, rid, 3 * CHUNK_MS)
        assert answer["event"]["history_committed"] is True
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 3)
        assert await create_outcome(c, commit=False) == "response_already_active"
        # A truncating ack below what was sent does not end the wait either (0.30.0).
        answer = await ack(c, rid, 3 * CHUNK_MS, truncate=True)
        assert answer["event"]["playback"]["committed_ms"] == 3 * CHUNK_MS
        assert await create_outcome(c, commit=False) == "response_already_active"
        # The final ack releases it.
        answer = await ack(c, rid, REPLY_MS, REPLY_MS)
        assert answer["event"]["playback"] == ledger(REPLY_MS, REPLY_MS, REPLY_MS)
        assert await create_outcome(c, commit=True) == "response.created"
        # truncate: true capped the item for good.
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 3)


@pytest.mark.parametrize("trigger", ["output_audio_buffer.clear", "barge_in", "response.cancel"])
async def test_ack_only_clear_after_a_completed_reply_frees_the_turn(
    truncating_sim: SimulatorChild, trigger: str
) -> None:
    """0.30.0 forwards a clear for the latest completed reply to the session (and
    counts still-playing audio as response work for barge_in and response.cancel):
    history is cut at the acked position, the epoch advances, the wait ends, and
    the client sees output_audio_buffer.cleared."""
    async with connect(truncating_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c, playback_commit_policy="ack_only")
        rid, _ = await full_reply(c)
        await ack(c, rid, 2 * CHUNK_MS)
        await c.send({"type": trigger})
        cleared = await c.recv_until("output_audio_buffer.cleared")
        assert cleared["response_id"] == rid
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 2)
        await ask(c)
        created = await c.recv_until(lambda e: e["type"] in ("response.created", "error"))
        assert created["type"] == "response.created"
        assert created["response_id"].startswith(f"resp-{session['id']}-1-")


async def test_cli_default_policy_and_ack_errors(ack_only_sim: SimulatorChild) -> None:
    async with connect(ack_only_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c)
        assert session["playback_commit_policy"] == "ack_only"
        assert session["capabilities"]["supports_audio_truncate"] is False
        rid, done = await full_reply(c)
        assert done["response"]["metadata"]["committed"] is False

        codes = []
        for bad in (
            {"response_id": rid, "item_id": "item_other", "played_ms": 10},
            {"response_id": "resp-unknown", "played_ms": 10},
            {"response_id": rid, "played_ms": "ten"},
        ):
            await c.send({"type": "playback.ack", **bad})
            codes.append((await c.recv_until("error"))["error"]["code"])
        assert codes == ["playback_item_mismatch", "playback_item_not_found", "bad_event"]

        # A later user turn committed before any ack: the reply lost its place in history.
        for event in (APPEND, {"type": "input_audio_buffer.commit"}):
            await c.send(event)
        await c.recv_until("input_audio_buffer.committed")
        answer = await ack(c, rid, REPLY_MS)
        assert answer["type"] == "error"
        assert answer["error"]["code"] == "playback_ack_too_late"
        assert await retrieve_text(c, f"item_{rid}") == ""

        await c.send({"type": "conversation.item.truncate", "item_id": f"item_{rid}",
                      "content_index": 0, "audio_end_ms": 100})  # fmt: skip
        assert (await c.recv_until("error"))["error"]["code"] == "unsupported_audio_truncate"


# ------------------------------------------------------------------------ truncation


async def test_conversation_item_truncate_cuts_history_at_audio_end_ms(
    truncating_sim: SimulatorChild,
) -> None:
    async with connect(truncating_sim.ws_url + "?autostart=0") as c:
        session = await open_session(c)
        assert session["capabilities"]["supports_audio_truncate"] is True
        rid, _ = await full_reply(c)
        item_id = f"item_{rid}"
        # Half-way into the second chunk: the text is cut inside that chunk's words.
        await c.send({"type": "conversation.item.truncate", "item_id": item_id,
                      "content_index": 0, "audio_end_ms": 300})  # fmt: skip
        truncated = await c.recv_until("conversation.item.truncated")
        assert {
            k: v for k, v in truncated.items() if k not in ("event_id", "server_event_seq")
        } == {
            "type": "conversation.item.truncated",
            "item_id": item_id,
            "content_index": 0,
            "audio_end_ms": 300,
            "event": {
                "type": "conversation.item.truncated",
                "session_id": session["id"],
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 300,
                "truncated": True,
            },
        }
        # Then, as in the engine, the same cut as a truncating ack.
        acknowledged = await c.recv()
        assert acknowledged["type"] == "playback.acknowledged"
        assert acknowledged["event"]["truncate"] is True
        assert acknowledged["event"]["playback"] == ledger(REPLY_MS, 300, 300)
        one, two = spoken(c, rid, 1), spoken(c, rid, 2)
        expected = two[: len(one) + (len(two) - len(one)) // 2].rstrip()
        assert await retrieve_text(c, item_id) == expected
        history = await debug_history(truncating_sim, session["id"])
        assistant = history["items"][-1]
        assert (assistant["text"], assistant["audio_ms"], assistant["full_text"]) == (
            expected, 300, spoken(c, rid, 5),
        )  # fmt: skip
        # A later ack cannot lengthen a truncated item.
        await ack(c, rid, REPLY_MS, REPLY_MS)
        assert await retrieve_text(c, item_id) == expected

        user_item = next(e["item"]["id"] for e in c.events
                         if e["type"] == "conversation.item.added" and e["item"]["role"] == "user")  # fmt: skip
        for target, code in ((user_item, "bad_event"), ("item_nope", "item_not_found")):
            await c.send({"type": "conversation.item.truncate", "item_id": target,
                          "content_index": 0, "audio_end_ms": 100})  # fmt: skip
            assert (await c.recv_until("error"))["error"]["code"] == code


async def test_cancel_keeps_only_the_acked_audio_in_history_whatever_the_policy(
    fast_generation_sim: SimulatorChild,
) -> None:
    async with connect(fast_generation_sim.ws_url + "?autostart=0") as c:
        await open_session(c)  # commit_all_on_done
        await ask(c)
        first = await c.recv_until(AUDIO_DELTA)
        rid = first["response_id"]
        await c.recv_until(
            lambda e: e["type"] == AUDIO_DELTA and e["metadata"]["audio_duration_ms"] >= 300
        )
        await c.send({"type": "playback.ack", "response_id": rid, "item_id": f"item_{rid}",
                      "played_ms": 200})  # fmt: skip
        await c.send({"type": "response.cancel"})
        answer = await c.recv_until("playback.acknowledged")
        assert answer["event"]["history_committed"] is False  # the response was still running
        done = await c.recv_until("response.done")
        sent = 100 * sum(
            1 for e in c.events if e["type"] == AUDIO_DELTA and e["response_id"] == rid
        )
        meta = done["response"]["metadata"]
        assert done["response"]["status"] == "cancelled"
        assert (meta["committed_ms"], meta["playback"]) == (200, ledger(sent, 200, 200))
        assert await retrieve_text(c, f"item_{rid}") == spoken(c, rid, 2)

        # Not acknowledged at all: nothing of it in history, even under commit_all_on_done.
        await ask(c)
        second = (await c.recv_until(AUDIO_DELTA))["response_id"]
        await c.send({"type": "response.cancel"})
        await c.recv_until("response.done")
        assert await retrieve_text(c, f"item_{second}") == ""


# ------------------------------------------------------------------------ generation speed


async def test_generation_speed_sends_a_2s_reply_in_about_half_a_second(
    fast_generation_sim: SimulatorChild,
) -> None:
    loop = asyncio.get_running_loop()
    frames: list[list[str]] = []
    for _ in range(2):
        async with connect(fast_generation_sim.ws_url + "?autostart=0") as c:
            await open_session(c)
            started = loop.time()
            await ask(c)
            mark = c.mark()
            done = await c.recv_until("response.done")
            wall = loop.time() - started
            await c.recv_until("rate_limits.updated")
            kinds = c.types(mark)
            deltas = [e for e in c.events[mark:] if e["type"] == AUDIO_DELTA]
            assert len(deltas) == 20 and kinds.count(TEXT_DELTA) == 20
            assert [d["metadata"]["audio_duration_ms"] for d in deltas] == list(
                range(100, 2001, 100)
            )
            assert kinds.index("response.output_audio.done") > max(
                i for i, kind in enumerate(kinds) if kind == AUDIO_DELTA
            )
            assert done["response"]["metadata"]["playback"]["sent_ms"] == 2000
            # Paced (20 chunks on an absolute 25 ms schedule), yet 4x faster than real time.
            assert 0.45 <= wall < 1.6 * TIMEOUT_FACTOR, wall
            frames.append(c.frames)
    # --deterministic still makes two identical sessions byte-identical.
    assert frames[0] == frames[1]
