"""Headless Chromium through Playwright (PyPI `playwright`), for the operator page's
browser tests, its bench and its screenshot. Playwright drives the system's browser
(Debian's `chromium` package, given as `executable_path`): it never downloads one of
its own (`playwright install` is not needed).

    async with open_page() as chromium:
        await chromium.page.goto("http://127.0.0.1:9180/ui")
        await chromium.page.wait_for_function("document.querySelector('#fleet tbody tr')")

Every page error fails: an uncaught exception or an unhandled promise rejection in the
page (`pageerror`), and a console.error, which is where the page reports what it caught
(a failed feed poll, a drawing error) and where Chromium reports a resource that failed to
load. They are collected while the page is open and raised as PageError when it closes
(`check=False` keeps them in `errors` only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import psutil
from playwright.async_api import ConsoleMessage, Error, Page, async_playwright

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
# What this machine and CI need: no GPU, no sandbox as root (CI runs as root), and none of
# the browser's own traffic (updates, sync, first-run pages) beside the page's.
ARGS = (
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
MISSING = "no chromium on PATH (Debian: apt-get install chromium)"


class PageError(AssertionError):
    """The page raised, or logged an error, while it was open."""


def _listed(errors: list[str]) -> str:
    return f"{len(errors)} page error(s):\n" + "\n".join(errors)


def find_chromium() -> str | None:
    """The browser binary (GORGO_CHROMIUM, else the first of CANDIDATES on PATH)."""
    explicit = os.environ.get("GORGO_CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def _descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


@dataclass
class Chromium:
    """One open page; `errors` holds what the page raised or logged as an error so far."""

    page: Page
    # The browser's own process (its renderers and helpers are its descendants).
    roots: list[psutil.Process]
    errors: list[str] = field(default_factory=list)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the browser's live processes have used, renderers
        included."""
        total = 0.0
        for root in self.roots:
            with contextlib.suppress(psutil.Error):
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):  # gone meanwhile
                        t = proc.cpu_times()
                        total += t.user + t.system
        return total

    def check(self) -> None:
        """PageError naming every error so far."""
        if self.errors:
            raise PageError(_listed(self.errors))

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            where = message.location.get("url", "")
            self.errors.append(f"console.error: {message.text}" + (f" ({where})" if where else ""))

    def _on_page_error(self, error: Error) -> None:
        self.errors.append(f"uncaught: {error.stack or error.message}")


@contextlib.asynccontextmanager
async def open_page(
    width: int = 1400, height: int = 1000, *, check: bool = True
) -> AsyncIterator[Chromium]:
    """A page in a fresh headless Chromium (its own new profile directory); on leaving,
    PageError if the page had errors (`check`), unless the body is raising already."""
    binary = find_chromium()
    if binary is None:
        raise RuntimeError(MISSING)
    profile = tempfile.mkdtemp(prefix="gorgo-chromium-")
    try:
        async with async_playwright() as pw:
            before = _descendants()
            context = await pw.chromium.launch_persistent_context(
                profile,
                executable_path=binary,
                headless=True,
                chromium_sandbox=os.geteuid() != 0,  # root: no sandbox (Chromium refuses)
                args=list(ARGS),
                viewport={"width": width, "height": height},
                device_scale_factor=1,
            )
            try:
                new = {pid: p for pid, p in _descendants().items() if pid not in before}
                roots = [p for p in new.values() if p.ppid() not in new]
                page = context.pages[0] if context.pages else await context.new_page()
                chromium = Chromium(page, roots)
                page.on("console", chromium._on_console)
                page.on("pageerror", chromium._on_page_error)
                try:
                    yield chromium
                except BaseException as e:  # what the page said may be why
                    if chromium.errors:
                        e.add_note(_listed(chromium.errors))
                    raise
                seen = list(chromium.errors)  # before closing: a closing page may log
            finally:
                await context.close()
            if check and seen:
                raise PageError(_listed(seen))
    finally:
        shutil.rmtree(profile, ignore_errors=True)
