"""A headless Chromium driven over the Chrome DevTools Protocol, for the console tests.

No Playwright and no browser download: Debian's ``chromium`` is started as a
:class:`tests.children.ChromiumChild` (``--remote-debugging-port=0``; ready
once its ``DevToolsActivePort`` file names the endpoint) and one WebSocket (aiohttp's client) carries the
protocol. Each test gets its own tab (a CDP target, attached in flat mode) and
sees what a person's browser would: console messages, uncaught exceptions,
every request the page makes, JavaScript dialogs (an ``alert`` from injected
markup would show up here), and screenshots.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.children import ChromiumChild
from tests.conftest import DEADLINE, MS

__all__ = ["Browser", "Page", "chromium_path", "open_page", "start_browser"]

_FLAGS = (
    "--headless",
    "--no-sandbox",  # tests may run as root in a container
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
    "--window-size=1400,1000",
)


def chromium_path() -> str | None:
    """The system Chromium, or None when it is not installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


#: The Chromium child; its ``ws_url`` is the browser's DevTools endpoint.
Browser = ChromiumChild


def start_browser(executable: str, profile: Path) -> Browser:
    """Start Chromium with a fresh profile; ready once its DevTools endpoint is known."""
    browser = Browser(
        executable, profile, flags=_FLAGS, ready_timeout=DEADLINE * 2, stop_grace=DEADLINE
    )
    return browser.start_ready()


@dataclass
class Page:
    """One tab. ``events`` holds every CDP event of this tab, in order."""

    ws: aiohttp.ClientWebSocketResponse
    session_id: str
    _calls: dict[int, asyncio.Future[dict[str, Any]]]
    _next: list[int]
    events: list[dict[str, Any]] = field(default_factory=list)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a command to this tab and return its result (raise on a CDP error)."""
        return await _call(self.ws, self._calls, self._next, method, params, self.session_id)

    async def navigate(self, url: str) -> None:
        seen = len(self.events)
        await self.call("Page.navigate", {"url": url})
        await self.wait_event("Page.loadEventFired", after=seen)

    async def wait_event(self, method: str, *, after: int = 0) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + DEADLINE
        while True:
            for event in self.events[after:]:
                if event["method"] == method:
                    return event
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"no {method} within {DEADLINE:.0f} s")
            await asyncio.sleep(5 * MS)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (promises awaited)."""
        result = await self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout: float = DEADLINE, what: str = "") -> Any:
        """Poll ``expression`` until truthy; return its value or fail after ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out after {timeout:.1f} s: {what or expression}")
            await asyncio.sleep(20 * MS)

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser-logged errors (CSP included)."""
        out = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                out.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                )
            elif method == "Runtime.exceptionThrown":
                out.append(str(params["exceptionDetails"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                out.append(f"{params['entry'].get('url', '')}: {params['entry']['text']}")
        return out

    def requested_urls(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e["method"] == "Network.requestWillBeSent"
        ]

    def dialogs(self) -> list[str]:
        return [
            e["params"].get("message", "")
            for e in self.events
            if e["method"] == "Page.javascriptDialogOpening"
        ]

    async def screenshot(self, path: Path, *, full_page: bool = False) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = (await self.call("Page.getLayoutMetrics"))["cssContentSize"]
            params["captureBeyondViewport"] = True
            params["clip"] = {
                "x": 0,
                "y": 0,
                "width": size["width"],
                "height": size["height"],
                "scale": 1,
            }
        result = await self.call("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(result["data"]))


async def _call(
    ws: aiohttp.ClientWebSocketResponse,
    calls: dict[int, asyncio.Future[dict[str, Any]]],
    counter: list[int],
    method: str,
    params: dict[str, Any] | None,
    session_id: str | None,
) -> dict[str, Any]:
    counter[0] += 1
    message: dict[str, Any] = {"id": counter[0], "method": method, "params": params or {}}
    if session_id is not None:
        message["sessionId"] = session_id
    future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    calls[counter[0]] = future
    await ws.send_str(orjson.dumps(message).decode())
    async with asyncio.timeout(DEADLINE):
        reply = await future
    if "error" in reply:
        raise RuntimeError(f"{method}: {reply['error']}")
    result: dict[str, Any] = reply.get("result", {})
    return result


@contextlib.asynccontextmanager
async def open_page(browser: Browser) -> AsyncIterator[Page]:
    """A fresh tab with Page, Runtime, Log and Network events on; closed afterwards."""
    calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
    counter = [0]
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(browser.ws_url, max_msg_size=0) as ws,
    ):
        pages: dict[str, Page] = {}

        async def read() -> None:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                data = orjson.loads(msg.data)
                if "id" in data:
                    future = calls.pop(data["id"], None)
                    if future is not None and not future.done():
                        future.set_result(data)
                elif data.get("sessionId") in pages:
                    pages[data["sessionId"]].events.append(data)
                    if data["method"] == "Page.javascriptDialogOpening":
                        # Never leave a dialog open: it would block the page.
                        await ws.send_str(
                            orjson.dumps(
                                {
                                    "id": 0,
                                    "sessionId": data["sessionId"],
                                    "method": "Page.handleJavaScriptDialog",
                                    "params": {"accept": False},
                                }
                            ).decode()
                        )

        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(read())
            try:
                target = await _call(
                    ws, calls, counter, "Target.createTarget", {"url": "about:blank"}, None
                )
                attached = await _call(
                    ws,
                    calls,
                    counter,
                    "Target.attachToTarget",
                    {"targetId": target["targetId"], "flatten": True},
                    None,
                )
                page = Page(ws, attached["sessionId"], calls, counter)
                pages[page.session_id] = page
                for domain in ("Page", "Runtime", "Log", "Network"):
                    await page.call(f"{domain}.enable")
                try:
                    yield page
                finally:
                    with contextlib.suppress(Exception):
                        await _call(
                            ws,
                            calls,
                            counter,
                            "Target.closeTarget",
                            {"targetId": target["targetId"]},
                            None,
                        )
            finally:
                reader.cancel()
