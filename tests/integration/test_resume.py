"""Calls survive a dropped connection: session resume through the sidecar (docs/design.md, Resume).

A client whose connection drops (no close frame) without ``session.close``
finds its session held for ``client_resume_grace``: the engine keeps
streaming into the session's bounded output, and a ``session.resume`` on a new
connection (same API key, the session's current token) gets ``session.resumed``
and every event after its cursor exactly once, never audio of a response
cancelled before the drop. A forged or replayed token, or another key, is
refused with one answer; a client that never comes back frees the engine's
session and its key's slot when the grace ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import orjson
import pytest

from tests.aiohttp_private import abort
from tests.conftest import DEADLINE, free_port, wait_until
from tests.integration.helpers import (
    SILENCE_100MS,
    Client,
    RawWebSocket,
    SimulatorChild,
    connect,
    module_simulator,
    sim_metric,
)

pytestmark = pytest.mark.timeout(90)

AUDIO: Final = "response.output_audio.delta"
GRACE: Final = 20.0
KEY_A, KEY_B = "sk-resume-A-41d7", "sk-resume-B-9c02"


@pytest.fixture(scope="module")
def streaming_sim() -> Iterator[SimulatorChild]:
    # 200 ms chunks in real time, 2 s responses; 0.30's late audio after a cancel.
    args = ("--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "2")
    with module_simulator(*args, "--late-audio-chunks", "3") as sim:
        yield sim


def _url(proxy: Any) -> str:
    # A client that may resume opens its session with its first message.
    return proxy.url + "?duplex=1&autostart=0"


async def _open(client: Client) -> dict[str, Any]:
    await client.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    return await client.recv_until("session.created")


async def _ask(client: Client) -> None:
    await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
    await client.send({"type": "input_audio_buffer.commit"})
    await client.send({"type": "response.create"})


def _cursor(client: Client) -> int:
    return max((e["server_event_seq"] for e in client.events if "server_event_seq" in e), default=0)


def _resume(created: dict[str, Any], cursor: int, token: str | None = None) -> dict[str, Any]:
    return {
        "type": "session.resume",
        "session_id": created["session"]["id"],
        "resume_token": token if token is not None else created["resume_token"],
        "last_received_server_event_seq": cursor,
    }


@contextlib.asynccontextmanager
async def _dropped_mid_response(
    proxy: Any, **connect_kwargs: Any
) -> AsyncIterator[tuple[dict[str, Any], int, Client]]:
    """A session whose client drops (no close frame) after 3 audio deltas of a response."""
    async with connect(_url(proxy), **connect_kwargs) as client:
        created = await _open(client)
        await _ask(client)
        for _ in range(3):
            await client.recv_until(AUDIO)
        cursor = _cursor(client)
        abort(client.ws)
        registry = proxy.sidecar.state.registry
        await wait_until(lambda: registry.detached() == 1, what="the session held")
        yield created, cursor, client


async def test_a_dropped_client_resumes_and_gets_every_event_after_its_cursor_once(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    # Acks on the client's behalf off: the engine's answers to them are hidden
    # from the client, a server_event_seq gap of their own.
    proxy = await sidecar(
        upstream=streaming_sim.ws_url, client_resume_grace=GRACE, playback_ack="off"
    )
    async with (
        _dropped_mid_response(proxy) as (created, received, _),
        connect(_url(proxy)) as client,
    ):
        # Two events it did receive are claimed missed: at least those two are replayed.
        cursor = received - 2
        await client.send(_resume(created, cursor))
        resumed = await client.recv()
        assert resumed["type"] == "session.resumed"
        assert resumed["session_id"] == created["session"]["id"]
        assert resumed["resume_token"] != created["resume_token"], "a fresh token"
        done = await client.recv_until("response.done")
        assert done["response"]["status"] == "completed", "the response completes"
        seqs = [e["server_event_seq"] for e in client.events if "server_event_seq" in e]
        assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), (cursor, seqs)
        await client.send({"type": "session.close"})
        await client.recv_until_closed()
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 1
    assert proxy.metric("omni_sidecar_resume_replayed_events_total") >= 2


async def test_audio_of_a_response_cancelled_before_the_drop_is_not_replayed(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=streaming_sim.ws_url, client_resume_grace=GRACE)
    async with connect(_url(proxy)) as client:
        created = await _open(client)
        await _ask(client)
        first = await client.recv_until(AUDIO)
        cancelled = first["response_id"]
        await client.send({"type": "response.cancel", "response_id": cancelled})
        await client.recv_until(lambda e: e["type"] == "response.done")
        await _ask(client)  # the next response
        await client.recv_until(AUDIO)
        cursor = _cursor(client)
        abort(client.ws)
    registry = proxy.sidecar.state.registry
    await wait_until(lambda: registry.detached() == 1, what="the session held")
    async with connect(_url(proxy)) as client:
        await client.send(_resume(created, cursor))
        assert (await client.recv())["type"] == "session.resumed"
        await client.recv_until(lambda e: e["type"] == "response.done")
        late = [e for e in client.events if e["type"] == AUDIO and e["response_id"] == cancelled]
        assert late == [], "no audio of the cancelled response after the resume"


def _spelled_with_escapes(request: dict[str, Any]) -> str:
    """The resume as a JSON parser reads it, its ``type`` spelled with an escape."""
    text = orjson.dumps(request).decode()
    return text.replace('"session.resume"', '"session\\u002eresume"')


@pytest.mark.parametrize(
    "how", ["forged", "replayed", "other_key", "escaped_other_key", "unknown_session", "malformed"]
)
async def test_a_resume_that_is_not_the_sessions_own_is_refused_with_one_answer(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path, how: str
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha\n{KEY_B} name=beta\n")
    proxy = await sidecar(
        upstream=streaming_sim.ws_url, client_resume_grace=GRACE, api_keys_file=str(keys)
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    async with _dropped_mid_response(proxy, headers=own) as (created, cursor, _):
        token = created["resume_token"]
        headers = own
        fresh: dict[str, Any] = {}
        if how == "replayed":  # a legitimate resume first: its token is spent
            async with connect(_url(proxy), headers=own) as legit:
                await legit.send(_resume(created, cursor))
                fresh = await legit.recv()
                assert fresh["type"] == "session.resumed"
                abort(legit.ws)
            registry = proxy.sidecar.state.registry
            await wait_until(lambda: registry.detached() == 1, what="held again")
            token = created["resume_token"]
        elif how == "forged":
            token = token[:-4] + "AAAA"
        elif how in ("other_key", "escaped_other_key"):
            headers = {"Authorization": f"Bearer {KEY_B}"}
        request: dict[str, Any] = _resume(created, cursor, token)
        if how == "unknown_session":
            request["session_id"] = "duplex-0000"
        if how == "malformed":  # no token at all: never passed on as an ordinary frame
            del request["resume_token"]
        text = _spelled_with_escapes(request) if how.startswith("escaped") else request
        async with connect(_url(proxy), headers=headers) as attacker:
            await attacker.send(text)
            refusal = await attacker.recv()
            events = await attacker.recv_until_closed()
        assert refusal["type"] == "error"
        assert refusal["error"]["code"] == "session_resume_expired"
        assert refusal["error"]["message"] == "unknown or expired session", "one answer for all"
        assert not [e for e in events if e["type"] in (AUDIO, "session.resumed")]
        # The session's own client can still resume.
        async with connect(_url(proxy), headers=own) as client:
            await client.send(_resume(created, cursor, fresh.get("resume_token")))
            assert (await client.recv())["type"] == "session.resumed"
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "refused"}) == 1


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.parametrize("how", ["other_key", "escaped_other_key", "forged", "spent"])
async def test_every_sidecar_of_the_fleet_refuses_a_resume_that_is_not_the_sessions_own(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path, how: str
) -> None:
    """A sidecar that does not hold the session (another of the fleet, or one started
    after the holder: the same thing, it knows only the shared secret and Redis)
    checks the token's binding and generation before the engine, which knows only
    its own token, hears of the resume: nothing reaches the engine, and the owner
    still resumes where the session is held."""
    from tests.integration.test_quota_redis import redis_server

    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha\n{KEY_B} name=beta\n")
    redis_port = free_port()
    fleet = {
        "upstream": streaming_sim.ws_url,
        "client_resume_grace": GRACE,
        "api_keys_file": str(keys),
        "resume_secret_file": str(tmp_path / "resume-secret"),
        "quota_redis_url": f"redis://127.0.0.1:{redis_port}/0",
    }
    own = {"Authorization": f"Bearer {KEY_A}"}
    resumes_before = await sim_metric(streaming_sim, "vllm_omni_sim_resumes_total")
    with redis_server(redis_port, tmp_path) as redis_proc:
        await redis_proc.ready()
        holder = await sidecar(**fleet)
        async with _dropped_mid_response(holder, headers=own) as (created, cursor, _):
            token, current = created["resume_token"], created["resume_token"]
            headers = own
            if how == "spent":  # resumed once where it is held: the first token is spent
                async with connect(_url(holder), headers=own) as legit:
                    await legit.send(_resume(created, cursor))
                    resumed = await legit.recv()
                    assert resumed["type"] == "session.resumed", resumed
                    current = resumed["resume_token"]
                    abort(legit.ws)
                registry = holder.sidecar.state.registry
                await wait_until(lambda: registry.detached() == 1, what="held again")
            elif how == "forged":
                token = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
            else:
                headers = {"Authorization": f"Bearer {KEY_B}"}
            other = await sidecar(**fleet)
            request = _resume(created, cursor, token)
            text = _spelled_with_escapes(request) if how.startswith("escaped") else request
            async with connect(_url(other), headers=headers) as attacker:
                await attacker.send(text)
                refusal = await attacker.recv()
                events = await attacker.recv_until_closed()
            assert refusal["error"]["code"] == "session_resume_expired", refusal
            assert refusal["error"]["message"] == "unknown or expired session"
            assert not [e for e in events if e["type"] in (AUDIO, "session.resumed")]
            assert other.metric("omni_sidecar_resumes_total", {"result": "refused"}) == 1
            assert other.metric("omni_sidecar_resumes_total", {"result": "passed_upstream"}) == 0
            async with connect(_url(holder), headers=own) as client:
                await client.send(_resume(created, cursor, current))
                assert (await client.recv())["type"] == "session.resumed"
    resumes_after = await sim_metric(streaming_sim, "vllm_omni_sim_resumes_total")
    assert resumes_after == resumes_before, "no resume reached the engine"


@pytest.mark.parametrize(
    "how",
    [
        "no_model",  # the engine reads the first message of a URL without model= as a resume
        "last_autostart",  # autostart=1&autostart=0: the engine reads the last value
        "after_a_ping",  # a ping first: the resume is the engine's first message still
    ],
)
async def test_a_spent_token_is_refused_whatever_the_url_and_whatever_comes_first(
    streaming_sim: SimulatorChild, sidecar: Any, how: str
) -> None:
    """A spent token never reaches the engine, which does not know it is spent (a local
    resume does not rotate its token): on a URL that says it opens with its first
    message (the last value of a repeated name, as the engine reads it; a ping before
    it) the sidecar reads it first (the held-here path, the spent check); on any other
    the session core refuses a resume outright."""
    proxy = await sidecar(upstream=streaming_sim.ws_url, client_resume_grace=GRACE)
    registry = proxy.sidecar.state.registry
    urls = {
        "no_model": proxy.url + "?duplex=1",
        "last_autostart": proxy.url + "?duplex=1&model=m&autostart=1&autostart=0",
        "after_a_ping": _url(proxy),
    }
    resumes_before = await sim_metric(streaming_sim, "vllm_omni_sim_resumes_total")
    async with _dropped_mid_response(proxy) as (created, cursor, _):
        async with connect(_url(proxy)) as legit:  # resumed here: the first token is spent
            await legit.send(_resume(created, cursor))
            resumed = await legit.recv()
            assert resumed["type"] == "session.resumed"
            abort(legit.ws)
        await wait_until(lambda: registry.detached() == 1, what="held again")
        async with connect(urls[how]) as replay:
            if how == "after_a_ping":
                await replay.ws.ping()
            await replay.send(_resume(created, cursor, created["resume_token"]))
            refusal = await replay.recv()
            events = await replay.recv_until_closed()
        assert refusal["type"] == "error", f"a spent token resumed the session: {refusal}"
        assert refusal["error"]["code"] == "session_resume_expired"
        assert not [e for e in events if e["type"] in (AUDIO, "session.resumed")]
        # The owner's current token resumes it where the sidecar reads the first message
        # (a URL that says so); on any other, the session core refuses every resume.
        async with connect(_url(proxy) if how == "no_model" else urls[how]) as client:
            if how == "after_a_ping":
                await client.ws.ping()
            await client.send(_resume(created, cursor, resumed["resume_token"]))
            assert (await client.recv())["type"] == "session.resumed"
    refused = proxy.metric("omni_sidecar_resumes_total", {"result": "refused"})
    assert refused == 1, "each refusal counted once, the edge's or (no_model) the core's"
    resumes_after = await sim_metric(streaming_sim, "vllm_omni_sim_resumes_total")
    assert resumes_after == resumes_before, "no resume reached the engine"


@pytest.mark.parametrize("named", ["held_here", "unknown"])
async def test_another_keys_resume_is_refused_before_the_engine_link_closes(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path, monkeypatch: Any, named: str
) -> None:
    """A key with no session here opens a slot and an engine link for its connection:
    a resume of another key's session is refused at once, the link closed after, so
    the answer takes as long whether the session it names is held here or not (a
    close round trip to a slow engine would tell another key which ids are held).
    The link's close waits until the test has the refusal: refused after it, the
    refusal would never come."""
    from proxy.edge import session_open  # pure Python (proxy/native.py)

    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha\n{KEY_B} name=beta\n")
    proxy = await sidecar(
        upstream=streaming_sim.ws_url, client_resume_grace=GRACE, api_keys_file=str(keys)
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    async with _dropped_mid_response(proxy, headers=own) as (created, cursor, _):
        refused = asyncio.Event()
        closing = session_open._close_link

        async def close_once_refused(upstream: Any, timeout: float) -> None:
            await refused.wait()
            await closing(upstream, timeout)

        monkeypatch.setattr(session_open, "_close_link", close_once_refused)
        request = _resume(created, cursor)
        if named == "unknown":
            request["session_id"] = "duplex-0000"
        async with connect(_url(proxy), headers={"Authorization": f"Bearer {KEY_B}"}) as other:
            await other.send(request)
            try:
                refusal = await other.recv(timeout=DEADLINE / 4)
            finally:
                refused.set()
            await other.recv_until_closed()
        assert refusal["error"]["code"] == "session_resume_expired"
        assert proxy.sidecar.state.registry.detached() == 1, "the owner's session stays held"


async def test_a_client_that_never_comes_back_frees_its_slots_when_the_grace_ends(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path
) -> None:
    grace = 1.0
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha max_sessions=1\n")
    proxy = await sidecar(
        upstream=streaming_sim.ws_url, client_resume_grace=grace, api_keys_file=str(keys)
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    registry = proxy.sidecar.state.registry
    async with _dropped_mid_response(proxy, headers=own):
        started = asyncio.get_running_loop().time()
        await wait_until(lambda: not registry.relays, timeout=grace + 5, what="the session ended")
        ended = asyncio.get_running_loop().time() - started
    assert ended <= grace + 5
    assert proxy.metric("omni_sidecar_resume_grace_expired_total") == 1
    # The key's one concurrent slot is free again: a new session is admitted.
    async with connect(_url(proxy), headers=own) as client:
        assert (await _open(client))["type"] == "session.created"


async def test_a_client_that_closes_cleanly_is_not_held(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    proxy = await sidecar(upstream=streaming_sim.ws_url, client_resume_grace=GRACE)
    registry = proxy.sidecar.state.registry
    async with connect(_url(proxy)) as client:
        await _open(client)
        await client.ws.close()  # a close frame: the client meant to leave
    await wait_until(lambda: not registry.relays, what="the session ended at once")
    assert registry.detached() == 0


async def test_a_resume_needs_no_slot_of_its_own_and_a_new_session_then_is_refused_in_band(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path
) -> None:
    """max_sessions 1, held by the dropped session: its resume is admitted (it takes
    that slot back, not another), while a new session of the same key at that
    moment is refused after its upgrade, with an ``error`` and 1013."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha\n")
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        api_keys_file=str(keys),
        max_sessions=1,
        playback_ack="off",
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    async with _dropped_mid_response(proxy, headers=own) as (created, cursor, _):
        async with connect(_url(proxy), headers=own) as newcomer:
            await newcomer.send({"type": "session.update", "session": {"modalities": ["audio"]}})
            refusal = await newcomer.recv()
            await newcomer.recv_until_closed()
        assert refusal["type"] == "error"
        assert refusal["error"]["code"] == "capacity"
        assert newcomer.close_code == 1013
        async with connect(_url(proxy), headers=own) as client:
            await client.send(_resume(created, cursor))
            assert (await client.recv())["type"] == "session.resumed"
            done = await client.recv_until("response.done")
            assert done["response"]["status"] == "completed"
    assert proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"}) == 1
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 1


async def test_a_resume_another_sidecar_holds_goes_to_the_engine_replica_that_has_it(
    simulator: Any, sidecar: Any, tmp_path: Path
) -> None:
    """Two sidecars in front of the same two engines (a fleet whose router sent the
    resume elsewhere). The session lives on the second engine; the other sidecar
    does not hold it, so it passes the resume on: to its first replica, which does
    not know the session, then to the second, which resumes it and replays. The
    sidecar that held it sees ``session.replaced`` and lets go without closing the
    engine's session. Both read one ``resume_secret_file``: the token the holder
    issued verifies on the other."""
    from engine_launcher.engine_config import EngineConfig

    args = ("--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "2")
    first, second = await simulator(*args), await simulator(*args)
    engine = EngineConfig(
        kind="external", upstreams=(first.ws_url, second.ws_url), health_interval=0.2
    )
    fleet = {"resume_secret_file": str(tmp_path / "resume-secret")}
    holder = await sidecar(engine=engine, client_resume_grace=GRACE, playback_ack="off", **fleet)
    other = await sidecar(engine=engine, client_resume_grace=GRACE, playback_ack="off", **fleet)
    for proxy in (holder, other):
        await wait_until(
            lambda p=proxy: p.sidecar.router.states == ["ready", "ready"],  # type: ignore[misc]
            what="both engines ready",
        )
    async with connect(_url(holder)) as on_first:  # placed on engine 0: the next goes to 1
        await _open(on_first)
        async with _dropped_mid_response(holder) as (created, cursor, _):
            registry = holder.sidecar.state.registry
            (held,) = [r for r in registry.relays.values() if r.view.detached_at is not None]
            assert registry.detail(held.key)["engine"] == 1
            async with connect(_url(other)) as client:
                await client.send(_resume(created, cursor))
                resumed = await client.recv()
                assert resumed["type"] == "session.resumed", resumed
                done = await client.recv_until("response.done")
                assert done["response"]["status"] == "completed"
                seqs = [e["server_event_seq"] for e in client.events if "server_event_seq" in e]
                assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), (cursor, seqs)
                (moved,) = other.sidecar.state.registry.relays.values()
                assert other.sidecar.state.registry.detail(moved.key)["engine"] == 1
                await wait_until(lambda: held.key not in registry.relays, what="holder let go")
    assert other.metric("omni_sidecar_resumes_total", {"result": "passed_upstream"}) == 1
    assert await sim_metric(second, "vllm_omni_sim_resumes_total") == 1


async def test_a_held_session_ends_when_the_sidecar_drains(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    """A drain refuses new connections, resumes too: a session held for one would
    only hold the drain up until its grace. One held when the drain starts ends at
    once; one whose client drops during the drain is not held. The engine is
    asked to close both (nothing stays detached there)."""
    proxy = await sidecar(
        upstream=streaming_sim.ws_url, client_resume_grace=GRACE, drain_timeout=GRACE
    )
    loop = asyncio.get_running_loop()
    async with _dropped_mid_response(proxy), connect(_url(proxy)) as attached:
        await _open(attached)
        started = loop.time()
        stopping = asyncio.ensure_future(proxy.stop())
        registry = proxy.sidecar.state.registry
        await wait_until(lambda: len(registry.relays) == 1, what="the held session ended")
        abort(attached.ws)  # dropped during the drain
        assert await stopping == 0
        stopped = loop.time() - started
    assert stopped < GRACE / 2, f"the drain waited {stopped:.1f} s for a held session"
    assert await sim_metric(streaming_sim, "vllm_omni_sim_sessions_detached") == 0


async def test_a_cursor_older_than_the_journal_gets_resync_required_and_the_session_stays_held(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    """``resume_journal_bytes`` smaller than one audio delta: the journal keeps
    nothing that was written, so a resume from an old cursor cannot be served
    without a hole: ``session.resync_required`` {journal_gap}, not a silent gap."""
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        resume_journal_bytes=1024,
        playback_ack="off",
    )
    async with _dropped_mid_response(proxy) as (created, _, _):
        async with connect(_url(proxy)) as client:
            await client.send(_resume(created, 1))
            notice = await client.recv()
            await client.recv_until_closed()
        assert notice["type"] == "session.resync_required", notice
        assert notice["reason"] == "journal_gap"
        assert notice["session_id"] == created["session"]["id"]
        registry = proxy.sidecar.state.registry
        assert registry.detached() == 1, "still held"
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "resync_required"}) == 1


async def test_a_resume_takes_over_a_connection_that_still_looks_alive(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    """A half-open connection the sidecar has not noticed: the resume wins, the old
    connection gets ``session.replaced`` and close 1000, and the new one is served
    at once (not after the old one's ``close_timeout``)."""
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        playback_ack="off",
        close_timeout=GRACE,
    )
    async with connect(_url(proxy)) as old:
        created = await _open(old)
        await _ask(old)
        await old.recv_until(AUDIO)
        async with connect(_url(proxy)) as new:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await new.send(_resume(created, _cursor(old)))
            resumed = await new.recv()
            assert resumed["type"] == "session.resumed"
            await new.send({"type": "session.close"})  # read at once: answered by the engine
            await new.recv_until("session.closed")
            waited = loop.time() - started
            assert waited < GRACE / 2, f"served after {waited:.1f} s (close_timeout {GRACE} s)"
            events = await old.recv_until_closed()
            replaced = [e for e in events if e["type"] == "session.replaced"]
            assert replaced, [e["type"] for e in events]
            assert replaced[0]["session_id"] == created["session"]["id"]
            assert replaced[0]["attachment_generation"] == resumed["attachment_generation"] - 1
            assert old.close_code == 1000


async def test_a_token_this_sidecar_issued_resumes_through_another_sidecar(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path
) -> None:
    """The holder gives a resumed client a token of its own (the engine's, marked
    and bound, of the next generation); that client's next drop lands on another
    sidecar of the fleet, which passes the resume to the engine: the engine must
    get its own token, never one with the sidecar's mark (it would refuse it)."""
    sim = streaming_sim
    fleet = {"resume_secret_file": str(tmp_path / "resume-secret")}
    holder = await sidecar(
        upstream=sim.ws_url, client_resume_grace=GRACE, playback_ack="off", **fleet
    )
    other = await sidecar(
        upstream=sim.ws_url, client_resume_grace=GRACE, playback_ack="off", **fleet
    )
    async with _dropped_mid_response(holder) as (created, cursor, _):
        async with connect(_url(holder)) as client:
            await client.send(_resume(created, cursor))
            resumed = await client.recv()
            assert resumed["type"] == "session.resumed"
            assert resumed["resume_token"] != created["resume_token"], "the sidecar's own"
            await client.recv_until(AUDIO)
            cursor = _cursor(client)
            abort(client.ws)
        registry = holder.sidecar.state.registry
        await wait_until(lambda: registry.detached() == 1, what="held again")
        async with connect(_url(other)) as client:
            await client.send(_resume(created, cursor, resumed["resume_token"]))
            answer = await client.recv()
            assert answer["type"] == "session.resumed", answer
        await wait_until(lambda: not registry.relays, what="the holder let go")
    assert other.metric("omni_sidecar_resumes_total", {"result": "passed_upstream"}) == 1


async def test_a_refusal_after_the_upgrade_for_an_engine_out_of_reach_closes_1014(
    simulator: Any, sidecar: Any
) -> None:
    """A key that holds a session upgrades a newcomer before admitting it; when the
    engine it is placed on cannot be reached, the in-band refusal is ``error``
    {upstream_unavailable} and close 1014 (bad gateway), not 1013 (try later)."""
    from engine_launcher.engine_config import EngineConfig

    args = ("--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "2")
    first, second = await simulator(*args), await simulator(*args)
    # No health poll before the newcomer: the second replica still counts as ready.
    engine = EngineConfig(
        kind="external", upstreams=(first.ws_url, second.ws_url), health_interval=600.0
    )
    proxy = await sidecar(engine=engine, client_resume_grace=GRACE, playback_ack="off")
    await wait_until(lambda: proxy.sidecar.router.states == ["ready", "ready"], what="ready")
    async with _dropped_mid_response(proxy):  # on the first replica: the next goes to the second
        second.stop()
        async with connect(_url(proxy)) as newcomer:
            await newcomer.send({"type": "session.update", "session": {"modalities": ["audio"]}})
            refusal = await newcomer.recv()
            await newcomer.recv_until_closed()
    assert refusal["type"] == "error"
    assert refusal["error"]["code"] == "upstream_unavailable"
    assert newcomer.close_code == 1014


async def test_a_key_gets_all_its_sessions_back_after_one_blip_with_no_second_slot(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path
) -> None:
    """One Wi-Fi blink for a client with three calls: the key's quota (3), the
    address's (3) and the sidecar's slots (3) are all full. Two old connections
    end at once (the sidecar sees the drop), the third is half-open (it looks
    alive). All three resume at the same time: none is refused (429, 503) and
    none takes a second slot; the half-open one is replaced (``session.replaced``,
    close), its resume takes over its resources."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha max_sessions=3\n")
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        api_keys_file=str(keys),
        max_sessions=3,
        max_sessions_per_ip=3,
        playback_ack="off",
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    registry = proxy.sidecar.state.registry
    async with contextlib.AsyncExitStack() as stack:
        calls = [await stack.enter_async_context(connect(_url(proxy), headers=own)) for _ in "abc"]
        created = [await _open(call) for call in calls]
        for call in calls:
            await _ask(call)
            await call.recv_until(AUDIO)
        cursors = [_cursor(call) for call in calls]

        async def come_back(n: int) -> Client:
            client = await stack.enter_async_context(connect(_url(proxy), headers=own))
            await client.send(_resume(created[n], cursors[n]))
            return client

        # calls[2] stays open, unread: half-open as far as the sidecar knows. Its
        # client comes back first, before the sidecar sees the other two drop.
        resumed = [await come_back(2)]
        abort(calls[0].ws)
        abort(calls[1].ws)
        await wait_until(lambda: registry.detached() == 2, what="two held")
        resumed += await asyncio.gather(come_back(0), come_back(1))
        for client in resumed:
            assert (await client.recv())["type"] == "session.resumed"
        replaced = await calls[2].recv_until("session.replaced")
        assert replaced["session_id"] == created[2]["session"]["id"]
        await calls[2].recv_until_closed()
        assert calls[2].close_code == 1000
        for client in resumed:
            done = await client.recv_until("response.done")
            assert done["response"]["status"] == "completed"
        rejected = proxy.metric("omni_sidecar_sessions_rejected_total", {"reason": "capacity"})
        rejected += proxy.metric(
            "omni_sidecar_sessions_rejected_total", {"reason": "quota_exceeded"}
        )
        assert rejected == 0, "no 429, no 503"
        assert proxy.metric("omni_sidecar_resumes_total", {"result": "resumed"}) == 3
        # Three sessions, three slots of each kind: none taken twice.
        assert proxy.metric("omni_sidecar_session_slots_used") == 3
        assert proxy.metric("omni_sidecar_sessions_active") == 3
        assert proxy.metric("omni_sidecar_resume_waiting") == 0
        (alpha,) = proxy.sidecar.state.quota.headroom()
        assert alpha["sessions"] == 3
        assert proxy.sidecar.state.admission.per_ip == {"127.0.0.1": 3}


@pytest.mark.parametrize("reads", ["at_once", "after_a_stall"])
async def test_an_idle_session_replays_more_than_one_write_buffer_at_once(
    streaming_sim: SimulatorChild, sidecar: Any, reads: str
) -> None:
    """Dropped while idle (its response done, nothing queued), resumed from an early
    cursor: ``session.resumed`` and a replay of many write buffers' worth go out at
    once, not one buffer's worth per frame that happens to arrive later; also to a
    client that reads only once its transport stopped taking writes."""
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        playback_ack="off",
        client_write_buffer_bytes=16 * 1024,
    )
    async with connect(_url(proxy)) as client:
        created = await _open(client)
        for _ in range(2):  # far more than the client's buffers take without reading
            await _ask(client)
            await client.recv_until("response.done")
        seqs = [e["server_event_seq"] for e in client.events if "server_event_seq" in e]
        cursor, missed = seqs[0], seqs[1:]  # as if it had received only the first
        abort(client.ws)
    registry = proxy.sidecar.state.registry
    await wait_until(lambda: registry.detached() == 1, what="the session held")
    raw = await RawWebSocket.connect(_url(proxy))  # reads only when asked to
    try:
        raw.send_text(orjson.dumps(_resume(created, cursor)).decode())
        if reads == "after_a_stall":
            (relay,) = registry.relays.values()
            await wait_until(lambda: relay.side.writer.paused, what="writes paused")
        events: list[dict[str, Any]] = []
        while [e["type"] for e in events].count("response.done") < 2:
            opcode, payload = await raw.read_frame()
            assert opcode == 0x1
            events.append(orjson.loads(payload))
    finally:
        raw.close()
    assert events[0]["type"] == "session.resumed"
    replayed = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert replayed == missed, f"{replayed} != {missed}"
    assert sum(1 for e in events if e["type"] == AUDIO) >= 10, "many buffers' worth"


async def test_a_resume_on_a_connection_that_took_slots_gives_them_back_first(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    """A connection opened before its key had a session to resume took the slots a
    new session needs; when its first message turns out to resume a session held
    here after all, it gives them back before it attaches: never a second slot."""
    proxy = await sidecar(upstream=streaming_sim.ws_url, client_resume_grace=GRACE)
    async with connect(_url(proxy)) as early:  # no session yet: it takes a slot
        await wait_until(
            lambda: proxy.metric("omni_sidecar_session_slots_used") == 1, what="its slot"
        )
        async with _dropped_mid_response(proxy) as (created, cursor, _):
            assert proxy.metric("omni_sidecar_session_slots_used") == 2
            await early.send(_resume(created, cursor))
            assert (await early.recv())["type"] == "session.resumed"
            assert proxy.metric("omni_sidecar_session_slots_used") == 1, "the held session's"
            assert proxy.metric("omni_sidecar_sessions_active") == 1


@pytest.mark.parametrize("full", ["per_key", "in_all"])
async def test_silent_connections_up_to_the_cap_cannot_stop_the_owners_resume(
    streaming_sim: SimulatorChild, sidecar: Any, tmp_path: Path, full: str
) -> None:
    """Connections that never send wait for their first message without a slot,
    at most ``max_resume_waits_per_key`` of a key and ``max_resume_waits`` in all.
    With the waits full of silent ones (the owner's own key's, or another key's),
    the owner's resume still gets through: it pushes the oldest silent wait out
    (of its key, or of the key with the most), which is refused with capacity."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} name=alpha\n{KEY_B} name=beta\n")
    cap = 4
    limits = {"max_resume_waits_per_key": cap, "max_resume_waits": 100}
    if full == "in_all":
        limits = {"max_resume_waits_per_key": 100, "max_resume_waits": cap}
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        api_keys_file=str(keys),
        max_sessions=2,
        handshake_timeout=DEADLINE * 3,
        **limits,
    )
    own = {"Authorization": f"Bearer {KEY_A}"}
    other = {"Authorization": f"Bearer {KEY_B}"}
    silent_key = own if full == "per_key" else other
    async with contextlib.AsyncExitStack() as stack:
        if full == "in_all":  # the other key holds a session too, so its connections may wait
            await _open(await stack.enter_async_context(connect(_url(proxy), headers=other)))
        created, cursor, _ = await stack.enter_async_context(
            _dropped_mid_response(proxy, headers=own)
        )
        silent = [
            await stack.enter_async_context(connect(_url(proxy), headers=silent_key))
            for _ in range(cap)
        ]
        await wait_until(
            lambda: proxy.metric("omni_sidecar_resume_waiting") == cap, what="the waits full"
        )
        async with connect(_url(proxy), headers=own) as client:
            await client.send(_resume(created, cursor))
            assert (await client.recv())["type"] == "session.resumed"
            pushed_out = await silent[0].recv()
            await silent[0].recv_until_closed()
            assert pushed_out["type"] == "error" and pushed_out["error"]["code"] == "capacity"
            assert silent[0].close_code == 1013
            assert proxy.metric("omni_sidecar_resume_wait_evictions_total") == 1
            assert proxy.metric("omni_sidecar_resume_waiting") == cap - 1, "the rest wait on"


async def test_without_auth_silent_connections_push_out_their_own_waits_not_the_owners(
    streaming_sim: SimulatorChild, sidecar: Any
) -> None:
    """Without API keys every client shares one key: the first-message waits go by
    client address, so a flood of silent connections from one address pushes out its
    own oldest wait, never the owner's resume waiting from another."""
    proxy = await sidecar(
        upstream=streaming_sim.ws_url,
        client_resume_grace=GRACE,
        trusted_proxies=("127.0.0.1/32",),
        max_resume_waits_per_key=2,
        max_resume_waits=100,
        handshake_timeout=DEADLINE * 3,
    )
    owner = {"X-Forwarded-For": "198.51.100.7"}
    flood = {"X-Forwarded-For": "203.0.113.9"}
    async with contextlib.AsyncExitStack() as stack:
        created, cursor, _ = await stack.enter_async_context(
            _dropped_mid_response(proxy, headers=owner)
        )
        back = await stack.enter_async_context(connect(_url(proxy), headers=owner))
        await wait_until(lambda: proxy.metric("omni_sidecar_resume_waiting") == 1, what="waiting")
        silent = [
            await stack.enter_async_context(connect(_url(proxy), headers=flood)) for _ in range(3)
        ]
        await wait_until(
            lambda: proxy.metric("omni_sidecar_resume_wait_evictions_total") == 1,
            what="the flood's own oldest wait pushed out",
        )
        assert (await silent[0].recv())["error"]["code"] == "capacity"
        await back.send(_resume(created, cursor))
        assert (await back.recv())["type"] == "session.resumed"


@pytest.mark.parametrize("answer", ["nobody_holds_it", "one_holds_it"])
async def test_a_pool_asks_every_replica_at_once_for_a_resume_held_elsewhere(
    sidecar: Any, answer: str
) -> None:
    """A resume this sidecar does not hold goes to the engines. With a pool of three,
    every replica is asked before any has answered, so a refusal comes with the
    slowest answer, not with the answers (or timeouts) added up; and the replica
    that holds the session gets it while another has not answered at all."""
    from engine_launcher.engine_config import EngineConfig
    from tests.fakes.scripted_engine import ScriptedEngine

    engines = [await ScriptedEngine().start() for _ in range(3)]
    try:
        pool = EngineConfig(
            kind="external", upstreams=tuple(e.ws_url for e in engines), health_interval=0.2
        )
        proxy = await sidecar(
            engine=pool, client_resume_grace=GRACE, playback_ack="off", close_timeout=1.0
        )
        router = proxy.sidecar.router
        await wait_until(lambda: router.states == ["ready"] * 3, what="three replicas ready")
        # A token another sidecar of the fleet issued (no API keys: key id "").
        tokens = proxy.sidecar.state.resume_tokens
        request = {
            "type": "session.resume",
            "session_id": "duplex-elsewhere",
            "resume_token": tokens.issue("duplex-elsewhere", "", "engine-token", 0),
            "last_received_server_event_seq": 4,
        }
        async with connect(_url(proxy)) as client:
            await client.send(request)

            async def asked(engine: ScriptedEngine) -> Any:
                conn = await engine.next_connection()
                asked = await conn.receive_event()
                assert asked["type"] == "session.resume"
                assert asked["resume_token"] == "engine-token", "the engine's own"
                return conn

            # No replica answers before all three were asked (one after the other,
            # the second would wait for the first's answer, or its timeout).
            conns = await asyncio.gather(*(asked(engine) for engine in engines))
            if answer == "nobody_holds_it":
                for conn in conns:
                    await conn.send(_engine_refusal())
                refusal = await client.recv()
                assert refusal["type"] == "error"
                assert refusal["error"]["code"] == "session_resume_expired"
            else:  # replica 2 holds it; replicas 0 and 1 never answer
                await conns[2].send(_engine_resumed(request["session_id"]))
                resumed = await client.recv()
                assert resumed["type"] == "session.resumed"
                for conn in conns[:2]:
                    await conn.wait_closed()  # let go, not waited for
                (relay,) = proxy.sidecar.state.registry.relays.values()
                assert proxy.sidecar.state.registry.detail(relay.key)["engine"] == 2
    finally:
        for engine in engines:
            await engine.aclose()
    assert proxy.metric("omni_sidecar_resumes_total", {"result": "passed_upstream"}) == 1


def _engine_refusal() -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": "session_resume_expired",
            "message": "unknown or expired session",
        },
    }


def _engine_resumed(session_id: str) -> dict[str, Any]:
    return {
        "type": "session.resumed",
        "session_id": session_id,
        "attachment_generation": 2,
        "resume_token": "engine-token-2",
        "session": {"id": session_id, "capabilities": {"supports_session_resume": True}},
    }
