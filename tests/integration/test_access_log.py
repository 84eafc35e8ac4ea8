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
    proxy = await sidecar(upstream=sim.ws_url)
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
