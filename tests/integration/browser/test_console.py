"""The operator console in a real headless Chromium (tests/integration/browser/cdp.py).

What a person at the page would see: it loads with no console error and asks
nothing of any other origin; a session appears in the table within 2 s and
leaves when it ends; engine-controlled strings (session and response ids) are
shown literally and run nothing; an overflowed session shows its drops;
``admin_token`` keeps the page and its JSON behind a 401 until the browser
sends it. The first test writes a screenshot of the page under load to its
tmp dir (and to ``$OMNI_SIDECAR_TESTS_CONSOLE_SCREENSHOT`` when set, which is
how ``docs/console.png`` is made).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import DEADLINE, MS, RunningSidecar
from tests.fakes.scripted_engine import ScriptedEngine
from tests.integration.browser.cdp import Browser, Page, chromium_path, open_page, start_browser
from tests.integration.test_metrics import RawClient

pytestmark = pytest.mark.skipif(
    chromium_path() is None,
    reason="no chromium on this host (apt-get install --no-install-recommends chromium; "
    ".ci/run installs it): the console's browser tests need a real browser",
)

#: A row appears within this long after its session opened (the page polls every 1 s).
APPEAR = 2000 * MS
XSS_SESSION = "<img src=x onerror=alert(1)>"
XSS_RESPONSE = '"><svg onload=alert(2)><script>window.pwned=1</script>'


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = chromium_path()
    assert executable is not None
    started = start_browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield started
    started.stop()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    async with open_page(browser) as tab:
        yield tab


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = await ScriptedEngine().start()
    yield scripted
    await scripted.aclose()


async def open_console(page: Page, proxy: RunningSidecar) -> None:
    await page.navigate(proxy.admin_url + "/")
    await page.wait_for(
        "document.querySelector('#engines tbody tr') !== null", what="the engine row"
    )


def rows_with(text: str) -> str:
    """JS: the session rows whose engine-session cell reads exactly ``text``."""
    literal = orjson.dumps(text).decode()
    return (
        "[...document.querySelectorAll('#sessions tbody tr')]"
        f".filter(tr => tr.children[1].textContent === {literal})"
    )


@contextlib.asynccontextmanager
async def keyed_session(
    simulator: Any, sidecar: Any, page: Page, tmp_path: Path, key_line: str
) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    """A sidecar whose only key is ``key_line``, its console open, and a session under that key.

    Args:
        simulator: The simulator fixture (started with realtime factor 0).
        sidecar: The sidecar fixture.
        page: The browser page that opens the console.
        tmp_path: Where the key file is written.
        key_line: One key-file line: the secret, then its attributes.

    Returns:
        The session's client WebSocket, closed on exit.
    """
    keys = tmp_path / "keys"
    keys.write_text(key_line + "\n")
    secret = key_line.split()[0]
    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url, api_keys_file=str(keys))
    await open_console(page, proxy)
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(
            proxy.url, headers={"Authorization": f"Bearer {secret}"}, max_msg_size=0
        )
        try:
            yield ws
        finally:
            await ws.close()


class Client:
    """A client session through the sidecar, its engine side scripted."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.http = http
        self.ws = ws

    @classmethod
    async def open(cls, proxy: RunningSidecar, engine: ScriptedEngine, session_id: str) -> Client:
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(proxy.url)
        conn = await engine.next_connection()
        await conn.send({"type": "session.created", "session": {"id": session_id}})
        assert orjson.loads((await ws.receive(timeout=DEADLINE)).data)["type"] == (
            "session.created"
        )
        client = cls(http, ws)
        client.conn = conn  # type: ignore[attr-defined]
        return client

    async def close(self) -> None:
        await self.ws.close()
        await self.http.close()


async def test_page_loads_clean_and_asks_only_the_admin_listener(
    simulator: Any, sidecar: Any, page: Page, tmp_path: Path
) -> None:
    sim = await simulator("--chunk-ms", "100", "--response-seconds", "60")
    proxy = await sidecar(upstream=sim.ws_url)
    sessions = []
    for _ in range(3):  # some load: three sessions streaming a response
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(proxy.url, max_msg_size=0)
        for event in (
            {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
            {"type": "input_audio_buffer.append", "audio": "AAAAAAAAAAAAAAAA"},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            await ws.send_str(orjson.dumps(event).decode())
        sessions.append((http, ws))

    try:
        await open_console(page, proxy)
        await page.wait_for(
            "document.querySelectorAll('#sessions tbody tr').length === 3", what="three rows"
        )
        # A refresh with all three sessions in it reaches the chart.
        await page.wait_for(
            "document.querySelector('#legend').textContent.includes('sessions (max 3)')",
            what="the chart's legend",
        )
        assert await page.evaluate("document.querySelector('#status').textContent") == "ready"
        # Rates need two refreshes: engine → client events/s goes above 0 as audio streams.
        await page.wait_for(
            "parseFloat([...document.querySelectorAll('#totals dt')]"
            ".find(dt => dt.textContent === 'events/s engine → client')"
            ".nextElementSibling.textContent) > 0",
            what="a non-zero engine → client event rate",
        )
        assert "simulator" not in await page.evaluate("document.title")  # sanity: our page
        engine_row = await page.evaluate(
            "[...document.querySelectorAll('#engines tbody td')].map(td => td.textContent)"
        )
        assert engine_row[:2] == ["external", "ready"]
        # docs/design.md, Engine capabilities: an external engine of no known release.
        behaviour = await page.evaluate(
            "[...document.querySelectorAll('#totals dt')]"
            ".find(dt => dt.textContent === 'engine behaviour').nextElementSibling.textContent"
        )
        assert behaviour == "unknown (as 0.30) (unknown)"

        shot = tmp_path / "console.png"
        await page.screenshot(shot, full_page=True)
        assert shot.stat().st_size > 10_000
        target = os.environ.get("OMNI_SIDECAR_TESTS_CONSOLE_SCREENSHOT")
        if target:
            shutil.copyfile(shot, target)

        assert page.console_errors() == []
        requested = page.requested_urls()
        assert any(url.endswith("/debug/summary") for url in requested)
        assert any(url.endswith("/console/console.js") for url in requested)
        outside = [u for u in requested if not u.startswith(proxy.admin_url + "/")]
        assert outside == [], "the page asked something of another origin"
    finally:
        for http, ws in sessions:
            await ws.close()
            await http.close()


async def test_a_session_appears_within_2s_and_leaves_when_it_ends(
    sidecar: Any, engine: ScriptedEngine, page: Page
) -> None:
    proxy = await sidecar(upstream=engine.ws_url)
    await open_console(page, proxy)
    client = await Client.open(proxy, engine, "sess_visible")
    await page.wait_for(
        f"{rows_with('sess_visible')}.length === 1", timeout=APPEAR, what="the new session's row"
    )
    cells = await page.evaluate(
        f"[...{rows_with('sess_visible')}[0].children].map(td => td.textContent)"
    )
    (key,) = list(proxy.sidecar.sessions.relays)
    assert cells[0] == key
    assert cells[2] == "127.0.0.1"
    assert cells[4] == "open"
    await client.close()
    await page.wait_for(
        f"{rows_with('sess_visible')}.length === 0",
        timeout=APPEAR,
        what="the row to go once the session ended",
    )
    assert page.console_errors() == []


async def test_engine_strings_are_shown_literally_and_run_nothing(
    sidecar: Any, engine: ScriptedEngine, page: Page
) -> None:
    proxy = await sidecar(upstream=engine.ws_url)
    await open_console(page, proxy)
    client = await Client.open(proxy, engine, XSS_SESSION)
    await client.conn.send(  # type: ignore[attr-defined]
        {"type": "response.created", "response": {"id": XSS_RESPONSE}}
    )
    await page.wait_for(
        f"{rows_with(XSS_SESSION)}.length === 1",
        timeout=APPEAR,
        what="the crafted session's row, text intact",
    )
    await page.wait_for(
        f"{rows_with(XSS_SESSION)}[0].children[5].textContent === "
        f"{orjson.dumps(XSS_RESPONSE).decode()}",
        what="the crafted response id, text intact",
    )
    # The detail view shows the same strings, also as text.
    await page.evaluate(f"{rows_with(XSS_SESSION)}[0].click()")
    await page.wait_for(
        "[...document.querySelectorAll('#detail-events td')]"
        f".some(td => td.textContent === {orjson.dumps(XSS_SESSION).decode()})",
        what="the engine_session lifecycle event with the literal id",
    )
    assert (
        await page.evaluate("document.querySelectorAll('main img, main svg, main script').length")
        == 0
    )
    assert await page.evaluate("typeof window.pwned") == "undefined"
    assert page.dialogs() == []
    assert not [u for u in page.requested_urls() if u.rstrip("/").endswith("/x")]
    assert page.console_errors() == []
    await client.close()


async def test_an_overflowed_session_shows_its_drops(
    sidecar: Any, engine: ScriptedEngine, page: Page
) -> None:
    proxy = await sidecar(
        upstream=engine.ws_url,
        overflow_policy="fail_response",
        max_pending_output_bytes=64 * 1024,
        client_write_buffer_bytes=16 * 1024,
        close_timeout=0.5,
        drain_timeout=0.0,
    )
    await open_console(page, proxy)
    host, port = proxy.sidecar.bound["listen"]
    client = await RawClient.connect(host, port)  # reads nothing from here on
    conn = await engine.next_connection()
    await conn.send({"type": "session.created", "session": {"id": "sess_stalled"}})
    await conn.send({"type": "response.created", "response": {"id": "resp_big"}})
    chunk = "A" * 8000
    for _ in range(150):  # ~1.2 MB of audio for a client that reads nothing
        await conn.send(
            {"type": "response.output_audio.delta", "response_id": "resp_big", "delta": chunk}
        )
    drops = await page.wait_for(
        f"(r => r.length === 1 && r[0].querySelector('td.drops').textContent)"
        f"({rows_with('sess_stalled')})",
        timeout=APPEAR + 1000 * MS,
        what="the stalled session's drops",
    )
    # fail_response: the response is failed and its later audio dropped, by reason.
    assert "failed_response: " in drops, drops
    count = int(drops.split("failed_response: ")[1].split(",")[0])
    assert count >= 1
    await page.evaluate(f"{rows_with('sess_stalled')}[0].click()")
    await page.wait_for(
        "[...document.querySelectorAll('#detail-events td')]"
        ".some(td => td.textContent === 'overflow')",
        what="the overflow in the session's lifecycle",
    )
    totals = await page.evaluate(
        "[...document.querySelectorAll('#totals dt')].map(dt => [dt.textContent, "
        "dt.nextElementSibling.textContent])"
    )
    assert ["overflows", "1"] in totals
    assert page.console_errors() == []
    client.writer.close()


async def test_admin_token_keeps_the_page_and_json_behind_401(
    sidecar: Any, engine: ScriptedEngine, page: Page
) -> None:
    token = "console-test-token"
    proxy = await sidecar(upstream=engine.ws_url, admin_token=token)
    for path in ("/", "/debug/summary", "/console/console.js"):
        seen = len(page.events)
        await page.navigate(proxy.admin_url + path)
        responses = [
            e["params"]["response"]
            for e in page.events[seen:]
            if e["method"] == "Network.responseReceived"
        ]
        assert responses and responses[0]["status"] == 401, path
        assert "omni-sidecar console" not in await page.evaluate("document.title")

    # With the token (what a browser sends after the Basic prompt), it all works.
    await page.call(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {token}"}}
    )
    seen = len(page.events)
    await open_console(page, proxy)
    await page.wait_for(
        "document.querySelector('#status').textContent === 'ready'",
        what="data from the token-protected JSON",
    )
    statuses = {
        e["params"]["response"]["url"]: e["params"]["response"]["status"]
        for e in page.events[seen:]
        if e["method"] == "Network.responseReceived"
    }
    assert statuses and set(statuses.values()) == {200}, statuses


async def test_usage_is_shown_per_key_name_never_the_key(
    simulator: Any, sidecar: Any, page: Page, tmp_path: Path
) -> None:
    """docs/design.md, Usage: one row per key name, with its sessions and audio."""
    secret = "sk-console-USAGE-6e1f"
    async with keyed_session(simulator, sidecar, page, tmp_path, f"{secret} name=team-a") as ws:
        for event in (
            {"type": "session.update", "session": {"modalities": ["audio", "text"]}},
            {"type": "input_audio_buffer.append", "audio": "AAAA" * 3200},
            {"type": "input_audio_buffer.commit"},
            {"type": "response.create"},
        ):
            await ws.send_str(orjson.dumps(event).decode())
        while orjson.loads((await ws.receive(timeout=DEADLINE)).data)["type"] != "response.done":
            pass
    await page.wait_for(
        "[...document.querySelectorAll('#usage tbody tr')]"
        ".some(tr => tr.children[0].textContent === 'team-a')",
        timeout=APPEAR,
        what="the key name's usage row",
    )
    row = await page.evaluate(
        "[...document.querySelectorAll('#usage tbody tr')]"
        ".find(tr => tr.children[0].textContent === 'team-a')"
        ".innerText"
    )
    cells = row.split("\t")
    assert cells[1] == "1"  # one session
    assert cells[3] == "0.3 s"  # 9600 bytes of pcm16 at 16 kHz
    assert cells[7] == "1"  # one response
    assert secret not in await page.evaluate("document.body.innerText")
    assert page.console_errors() == []


async def test_quota_headroom_is_shown_per_key_name(
    simulator: Any, sidecar: Any, page: Page, tmp_path: Path
) -> None:
    """docs/design.md, Quotas: limits and this sidecar's use per key name, never the key."""
    secret = "sk-console-QUOTA-2b7d"
    key_line = f"{secret} name=team-q max_sessions=3 audio_seconds_per_day=60"
    async with keyed_session(simulator, sidecar, page, tmp_path, key_line):
        await page.wait_for(
            "[...document.querySelectorAll('#quota tbody tr')]"
            ".some(tr => tr.children[0].textContent === 'team-q'"
            " && tr.children[1].textContent === '1 / 3')",
            timeout=APPEAR,
            what="the key's quota row with one session open",
        )
        row = await page.evaluate(
            "[...document.querySelectorAll('#quota tbody tr')]"
            ".find(tr => tr.children[0].textContent === 'team-q').innerText"
        )
    cells = row.split("\t")
    assert cells[2] == "1 / ∞"  # no sessions_per_minute
    assert cells[3] == "0.0 s / 60 s"
    assert cells[4] == "60.0 s"
    assert "own counts" in await page.evaluate(
        "document.querySelector('#quota-backend').textContent"
    )
    assert secret not in await page.evaluate("document.body.innerText")
    assert page.console_errors() == []


async def test_a_session_held_for_a_resume_shows_its_grace(
    simulator: Any, sidecar: Any, page: Page
) -> None:
    """A client that dropped: its row says held and the grace left, and the session's
    detail says the connection dropped and how long it may still resume."""
    from tests.aiohttp_private import abort

    sim = await simulator("--realtime-factor", "0")
    proxy = await sidecar(upstream=sim.ws_url, client_resume_grace=60.0)
    await open_console(page, proxy)
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(proxy.url + "?duplex=1&autostart=0")
        await ws.send_str('{"type":"session.update","session":{"modalities":["audio"]}}')
        created = orjson.loads((await ws.receive(timeout=DEADLINE)).data)
        assert created["type"] == "session.created"
        abort(ws)
        engine_session = created["session"]["id"]
        held = (
            f"{rows_with(engine_session)}.filter(tr => tr.children[4].textContent.includes('held'))"
        )
        await page.wait_for(f"{held}.length === 1", timeout=APPEAR, what="the held row")
        state = await page.evaluate(f"{rows_with(engine_session)}[0].children[4].textContent")
        left = int(state.split("held, ")[1].split(" s left")[0])
        assert state.startswith("open (held, ") and 50 <= left <= 60, state
        await page.evaluate(f"{rows_with(engine_session)}[0].click()")
        await page.wait_for(
            "document.querySelector('#detail-fields').textContent.includes('held for a resume')",
            timeout=APPEAR,
            what="the detail's client connection",
        )
    assert page.console_errors() == []
