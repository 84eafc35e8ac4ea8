"""One access line per session end, with what an operator needs to find it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.aiohttp_private import abort
from tests.conftest import wait_until
from tests.integration.helpers import connect, request_response


async def test_a_session_ends_with_one_access_line(
    simulator: Any, sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url)
    caplog.set_level(logging.INFO, logger="omni_sidecar.access")
    async with connect(proxy.url) as client:
        await request_response(client, open_session=True)
        await client.send({"type": "session.close"})
        await client.recv_until_closed()
    await wait_until(
        lambda: any(r.name == "omni_sidecar.access" for r in caplog.records),
        what="the access line",
    )
    (record,) = [r for r in caplog.records if r.name == "omni_sidecar.access"]
    fields: dict[str, Any] = vars(record)
    assert record.getMessage() == "session end"
    assert len(fields["session"]) == 12
    assert fields["engine_session"].startswith("duplex-")
    assert fields["client"] == "127.0.0.1"
    assert fields["duration_s"] > 0
    assert fields["events_in"] >= 4 and fields["bytes_in"] > 0
    assert fields["events_out"] == len(client.events) and fields["bytes_out"] > 0
    assert fields["outcome"] == "client_closed"
    assert fields["close_code"] == client.close_code == 1000
    assert fields["drops"] == "none"


async def test_a_close_frame_that_never_reached_the_client_is_logged_as_such(
    simulator: Any, sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url, client_resume_grace=0)  # not held for a resume
    caplog.set_level(logging.INFO, logger="omni_sidecar.access")
    async with connect(proxy.url) as client:
        await request_response(client, open_session=True)
        abort(client.ws)  # the client vanishes
    await wait_until(
        lambda: any(r.name == "omni_sidecar.access" for r in caplog.records),
        what="the access line",
    )
    (record,) = [r for r in caplog.records if r.name == "omni_sidecar.access"]
    assert vars(record)["close_code"] == "not_sent"
    assert vars(record)["outcome"] == "client_closed"


async def test_each_attachment_of_a_resumed_session_has_its_line(
    simulator: Any, sidecar: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A session whose client dropped and resumed: one ``session resumed`` line for
    the second connection (naming the first, what it was written and how long it
    lasted), then one ``session end`` counting both connections' output."""
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url, client_resume_grace=30.0)
    caplog.set_level(logging.INFO, logger="omni_sidecar.access")
    url = proxy.url + "?duplex=1&autostart=0"
    async with connect(url) as first:
        await first.send({"type": "session.update", "session": {"modalities": ["audio"]}})
        created = await first.recv_until("session.created")
        await request_response(first)
        await first.recv_until("response.done")
        cursor = max(e["server_event_seq"] for e in first.events if "server_event_seq" in e)
        abort(first.ws)
    registry = proxy.sidecar.state.registry
    await wait_until(lambda: registry.detached() == 1, what="the session held")
    async with connect(url) as second:
        resume = {
            "type": "session.resume",
            "session_id": created["session"]["id"],
            "resume_token": created["resume_token"],
            "last_received_server_event_seq": cursor,
        }
        await second.send(resume)
        await second.recv_until("session.resumed")
        await second.send({"type": "session.close"})
        await second.recv_until_closed()
    await wait_until(
        lambda: any(r.getMessage() == "session end" for r in caplog.records),
        what="the session end line",
    )
    lines = [r for r in caplog.records if r.name == "omni_sidecar.access"]
    assert [r.getMessage() for r in lines] == ["session resumed", "session end"]
    resumed, end = (vars(r) for r in lines)
    assert resumed["session"] == end["session"]
    assert resumed["attachment"] == 2 and resumed["cursor"] == cursor
    assert resumed["previous_events_out"] >= len(first.events)  # it read what came in time
    assert resumed["previous_duration_s"] > 0
    assert end["attachments"] == 2
    assert end["events_out"] == resumed["previous_events_out"] + len(second.events)
    assert end["outcome"] == "client_closed"
