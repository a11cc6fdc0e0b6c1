"""Headless Chromium driven over the Chrome DevTools Protocol, with aiohttp's websocket client.

No driver and no extra Python package: Debian's `chromium` alone (make setup installs it where
apt-get runs as root) and aiohttp, a dependency of radixserve already. The page's console errors,
uncaught exceptions and failed loads are collected in `Page.errors`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

START_TIMEOUT_S = 60.0
# What a timed-out wait reports besides the errors: the dashboard's status line, if any.
STATUS_JS = "(document.getElementById('status') || {}).textContent"


def find_chromium() -> str | None:
    """The browser binary: $CHROMIUM, else chromium / chromium-browser on PATH."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.errors: list[str] = []
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self._on_event(data.get("method", ""), data.get("params", {}))
        for future in self._pending.values():
            future.set_exception(ConnectionError("the browser closed the DevTools connection"))

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exc = details.get("exception", {})
            self.errors.append(f"uncaught: {exc.get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip()
            )

    async def send(self, method: str, **params: Any) -> dict[str, Any]:  # noqa: ANN401 - CDP values
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self.ws.send_str(json.dumps({"id": self._next_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str) -> Any:  # noqa: ANN401 - any JSON value
        """The value of a JavaScript expression (a promise is awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:  # noqa: ANN401
        """Poll a JavaScript expression until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what} ({expression}); "
                    f"page errors: {self.errors}; status: {await self.evaluate(STATUS_JS)!r}"
                )
            await asyncio.sleep(0.2)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", 30, f"{url} to load")

    async def screenshot(self, path: str, selector: str | None = None) -> None:
        """The whole page (beyond the viewport), or the element `selector` names, as a PNG."""
        target = f"document.querySelector({selector!r})" if selector else "document.documentElement"
        box = await self.evaluate(
            f"(() => {{ const r = {target}.getBoundingClientRect();"
            " return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })()"
        )
        shot = await self.send(
            "Page.captureScreenshot", format="png", captureBeyondViewport=True, clip={**box, "scale": 1}
        )
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page(
    binary: str, profile_dir: str, width: int = 1400, height: int = 1000
) -> AsyncIterator[Page]:
    """A headless browser with one blank page; the browser is stopped on exit."""
    cmd = [
        binary,
        "--headless=new",
        "--no-sandbox",  # root in a container: the setuid sandbox is unavailable
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile_dir}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = await _devtools_port(proc, os.path.join(profile_dir, "DevToolsActivePort"))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
            async with session.ws_connect(page_url, max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Page", "Runtime", "Log"):
                    await page.send(f"{domain}.enable")
                yield page
                page._reader.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _devtools_port(proc: subprocess.Popen, port_file: str) -> int:
    """Chromium writes the port it chose (--remote-debugging-port=0) into the profile."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with status {proc.returncode} during start-up")
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            with open(port_file) as f:
                return int(f.read().split()[0])
        await asyncio.sleep(0.1)
    raise TimeoutError("chromium did not open its DevTools port")
