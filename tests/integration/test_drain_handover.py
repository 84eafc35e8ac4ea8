"""A SIGTERMed sidecar hands its calls over (docs/design.md, Start-up and shutdown).

Two real ``omni-sidecar serve`` children in front of one simulator (the same
engine). A call whose engine session resumes and whose client resumes (its
URL has ``autostart=0``, as vLLM-Omni's ``DuplexClient`` always sends) is not
waited for: on SIGTERM its client gets close 1012 at once, the engine is left
without ``session.close`` (it keeps the session for its grace), and the
sidecar exits 0 within 5 s; the client resumes on the other sidecar, which
passes the resume to the engine, and gets every event once. A session held
for a resume when the drain begins is handed over too. A call that cannot
resume drains as before, and the drain's log line says why it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from tests.aiohttp_private import abort
from tests.conftest import DEADLINE, wait_until
from tests.integration.helpers import (
    SILENCE_100MS,
    Client,
    SimulatorChild,
    connect,
    module_simulator,
)
from tests.integration.served import Served

pytestmark = pytest.mark.timeout(90)

AUDIO: Final = "response.output_audio.delta"
#: 200 ms chunks in real time, 2 s responses: 10 audio deltas each.
CHUNKS: Final = 10
#: SIGTERM to exit with every live call handed over (the issue's bound).
EXIT_WITHIN: Final = 5.0


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatorChild]:
    args = ("--chunk-ms", "200", "--realtime-factor", "1", "--response-seconds", "2")
    with module_simulator(*args, "--late-audio-chunks", "3") as sim:
        yield sim


@contextlib.asynccontextmanager
async def sidecar(tmp_path: Path, engine: SimulatorChild, *flags: str) -> AsyncIterator[Served]:
    """A sidecar in front of ``engine``; those of one test share a resume secret."""
    secret = tmp_path / "resume-secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(32))
    served = Served(
        tmp_path,
        "--upstream", engine.ws_url, "--drain-timeout", "20", "--playback-ack", "off",
        "--resume-secret-file", str(secret), "--log-level", "info", *flags,
        sim=engine, env={},
    )  # fmt: skip
    served.start()
    try:
        await served.ready()
        yield served
    finally:
        await served.astop()


def _resumes(url: str) -> str:
    return url + "?duplex=1&autostart=0"


async def _open(client: Client) -> dict[str, Any]:
    await client.send({"type": "session.update", "session": {"modalities": ["audio", "text"]}})
    return await client.recv_until("session.created")


async def _ask(client: Client) -> None:
    await client.send({"type": "input_audio_buffer.append", "audio": SILENCE_100MS})
    await client.send({"type": "input_audio_buffer.commit"})
    await client.send({"type": "response.create"})


async def _recv_acking(client: Client, match: str, *, timeout: float = DEADLINE) -> dict[str, Any]:
    """Read until ``match``, acknowledging every numbered event (as DuplexClient does)."""

    def acked(event: dict[str, Any]) -> bool:
        seq = event.get("server_event_seq")
        if isinstance(seq, int):
            pending.append(seq)
        return bool(event.get("type") == match)

    pending: list[int] = []
    async with asyncio.timeout(timeout):
        while True:
            event = await client.recv()
            matched = acked(event)
            for seq in pending:
                await client.send({"type": "session.event_ack", "server_event_seq": seq})
            pending.clear()
            if matched:
                return event


def _seqs(*clients: Client) -> list[int]:
    return [e["server_event_seq"] for c in clients for e in c.events if "server_event_seq" in e]


def _resume(created: dict[str, Any], token: str, cursor: int) -> dict[str, Any]:
    return {
        "type": "session.resume",
        "session_id": created["session"]["id"],
        "resume_token": token,
        "last_received_server_event_seq": cursor,
    }


async def test_a_sigtermed_sidecar_hands_a_live_call_over_and_exits_at_once(
    tmp_path: Path, engine: SimulatorChild
) -> None:
    async with sidecar(tmp_path, engine) as s1, sidecar(tmp_path, engine) as s2:
        async with connect(_resumes(s1.ws)) as first:
            created = await _open(first)
            await _ask(first)
            for _ in range(3):
                await _recv_acking(first, AUDIO)
            s1.proc.send_signal(signal.SIGTERM)
            terminated = time.monotonic()
            await first.recv_until_closed()
            told_ms = (time.monotonic() - terminated) * 1000
        # Told to reconnect, not that the session ended.
        assert first.close_code == 1012, first.types()
        assert "session.closed" not in first.types()
        assert await s1.exited(EXIT_WITHIN) == 0, s1.log_tail(3000)
        exit_s = time.monotonic() - terminated

        cursor = max(_seqs(first))
        async with connect(_resumes(s2.ws)) as second:
            await second.send(_resume(created, created["resume_token"], cursor))
            resumed = await second.recv()
            assert resumed["type"] == "session.resumed", resumed
            done = await _recv_acking(second, "response.done")
            assert done["response"]["status"] == "completed"
            # Every event once: one run of server_event_seq over both connections.
            seqs = _seqs(first, second)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
            deltas = [e for c in (first, second) for e in c.events if e["type"] == AUDIO]
            assert len(deltas) == CHUNKS
            # The call goes on there: the next turn, then a normal close.
            await _ask(second)
            assert (await _recv_acking(second, "response.done"))["response"]["status"] == (
                "completed"
            )
            await second.send({"type": "session.close"})
            await second.recv_until_closed()
        assert (await s2.metric('omni_sidecar_resumes_total{result="passed_upstream"}')) == 1
    log = s1.log()
    assert "shutting down: draining 1 sessions: 1 handed over, none to wait for" in log
    assert "handed over: the client resumes on another sidecar" in log
    assert "outcome=handed_over" in log and "close_code=1012" in log, log[-2000:]
    print(f"\nhand-over: 1012 {told_ms:.0f} ms after SIGTERM, exit 0 after {exit_s:.2f} s")


async def test_a_session_held_for_a_resume_when_the_drain_begins_is_handed_over(
    tmp_path: Path, engine: SimulatorChild
) -> None:
    async with sidecar(tmp_path, engine) as s1, sidecar(tmp_path, engine) as s2:
        async with connect(_resumes(s1.ws)) as first:
            created = await _open(first)
            await _ask(first)
            await _recv_acking(first, AUDIO)
            abort(first.ws)  # dropped: s1 holds the session
            await wait_until(
                lambda: _metric_is(s1, "omni_sidecar_sessions_detached", 1), what="held"
            )
        s1.proc.send_signal(signal.SIGTERM)
        assert await s1.exited(EXIT_WITHIN) == 0, s1.log_tail(3000)
        # Held sessions used to end with session.close: the engine would refuse this.
        async with connect(_resumes(s2.ws)) as second:
            await second.send(_resume(created, created["resume_token"], max(_seqs(first))))
            assert (await second.recv())["type"] == "session.resumed"
            done = await _recv_acking(second, "response.done")
            assert done["response"]["status"] == "completed"
            seqs = _seqs(first, second)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


async def test_a_call_that_cannot_resume_drains_and_the_log_says_why(
    tmp_path: Path, engine: SimulatorChild
) -> None:
    async with sidecar(tmp_path, engine) as s1:
        async with connect(_resumes(s1.ws)) as moving, connect(s1.ws) as staying:
            await _open(moving)
            await _open(staying)  # no autostart=0: nothing says it would resume
            await _ask(staying)
            await staying.recv_until(AUDIO)
            s1.proc.send_signal(signal.SIGTERM)
            await moving.recv_until_closed()
            assert moving.close_code == 1012
            # The other call goes on: its response completes, then it leaves itself.
            done = await staying.recv_until("response.done")
            assert done["response"]["status"] == "completed"
            assert s1.proc.poll() is None, "it waits for the call that cannot move"
            assert (
                await s1.metric('omni_sidecar_drain_sessions_total{outcome="handed_over"}')
            ) == 1
            await staying.send({"type": "session.close"})
            await staying.recv_until_closed()
            assert staying.close_code == 1000
        assert await s1.exited(DEADLINE) == 0, s1.log_tail(3000)
    log = s1.log()
    assert (
        "shutting down: draining 2 sessions: 1 handed over, "
        "waiting up to 20 s for 1 (1 client cannot resume)"
    ) in log, log[-3000:]
    assert "1 handed over, 1 ended by themselves, 0 to cut" in log


async def _metric_is(served: Served, name: str, value: float) -> bool:
    return await served.metric(name) == value


async def test_without_a_shared_resume_secret_calls_drain(
    tmp_path: Path, engine: SimulatorChild
) -> None:
    # No other sidecar could verify the client's token: handing over would cut the call.
    served = Served(
        tmp_path, "--upstream", engine.ws_url, "--drain-timeout", "20", "--log-level", "info",
        sim=engine, env={},
    )  # fmt: skip
    served.start()
    try:
        await served.ready()
        async with connect(_resumes(served.ws)) as client:
            await _open(client)
            served.proc.send_signal(signal.SIGTERM)
            await wait_until(
                lambda: _logged(served, "1 no shared resume secret"), what="the drain's line"
            )
            assert served.proc.poll() is None, "the call is waited for"
            await client.send({"type": "session.close"})
            await client.recv_until_closed()
            assert client.close_code == 1000
        assert await served.exited(DEADLINE) == 0
    finally:
        await served.astop()


async def _logged(served: Served, text: str) -> bool:
    return text in served.log()
