"""Headless Chromium driven over the Chrome DevTools Protocol (its JSON-over-WebSocket
wire format: {"id", "method", "params"} answered by {"id", "result"}), for the operator
page's browser tests and its screenshot. Debian's `chromium` package provides the binary.

    async with Browser.launch() as b:
        await b.goto("http://127.0.0.1:9180/ui")
        await b.wait_for("document.querySelectorAll('#fleet tbody tr').length > 0")
        rows = await b.evaluate("document.querySelectorAll('#fleet tbody tr').length")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    """The browser binary (GORGO_CHROMIUM, else the first of CANDIDATES on PATH)."""
    explicit = os.environ.get("GORGO_CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / ticks
    total = 0.0
    for pid, t in times.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += t
    return total


class Browser:
    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        session: aiohttp.ClientSession,
        proc: subprocess.Popen[bytes],
    ):
        self._ws = ws
        self._session = session
        self._proc = proc
        self._ids = itertools.count(1)

    def cpu_s(self) -> float:
        """CPU seconds the browser's processes have used (renderers included)."""
        return _tree_cpu_s(self._proc.pid)

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls, width: int = 1400, height: int = 1000, timeout_s: float = 30.0
    ) -> AsyncIterator[Browser]:
        binary = find_chromium()
        if binary is None:
            raise BrowserError("no chromium on PATH (Debian: apt-get install chromium)")
        profile = tempfile.mkdtemp(prefix="gorgo-chromium-")
        proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port = await _devtools_port(Path(profile), proc, timeout_s)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                    targets = await r.json()
                page = next(t for t in targets if t["type"] == "page")
                async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    b = cls(ws, session, proc)
                    await b.send("Page.enable")
                    await b.send("Runtime.enable")
                    await b.send(
                        "Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                    )
                    yield b
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            shutil.rmtree(profile, ignore_errors=True)

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.send_str(
            json.dumps({"id": msg_id, "method": method, "params": params or {}})
        )
        while True:  # events arrive between answers; only ours matters
            msg = await self._ws.receive(timeout=60)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise BrowserError(f"DevTools connection closed during {method}")
            data = json.loads(msg.data)
            if data.get("id") == msg_id:
                if "error" in data:
                    raise BrowserError(f"{method}: {data['error']}")
                result: dict[str, Any] = data.get("result", {})
                return result

    async def evaluate(self, expression: str) -> Any:
        """A JavaScript expression's value in the page (promises awaited)."""
        r = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in r:
            details = r["exceptionDetails"]
            why = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression[:80]}: {why}")
        return r["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete'")

    async def wait_for(self, condition: str, timeout_s: float = 10.0) -> float:
        """Seconds until a JavaScript condition holds (BrowserError after timeout_s)."""
        t0 = time.monotonic()
        while True:
            if await self.evaluate(f"Boolean({condition})"):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise BrowserError(f"not within {timeout_s} s: {condition}")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: Path, full_page: bool = True) -> None:
        """The page as PNG: whole, or what the window shows."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = await self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            clip = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
            params.update(captureBeyondViewport=True, clip=clip)
        shot = await self.send("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(shot["data"]))


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Chromium writes the port it chose into DevToolsActivePort in its profile."""
    marker = profile / "DevToolsActivePort"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise BrowserError(f"chromium exited with {proc.returncode} before DevTools came up")
        if marker.exists():
            first = marker.read_text().splitlines()[:1]
            if first and first[0].isdigit():
                return int(first[0])
        await asyncio.sleep(0.05)
    raise BrowserError(f"chromium's DevTools did not come up within {timeout_s} s")
