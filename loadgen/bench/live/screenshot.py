"""`gorgo bench screenshot` (`make screenshot`): docs/img/operator-page.png, the operator's
page of the local stack (`gorgo up`'s: three regions at network RTTs, emulated SGLang
engines) after a few hundred streamed chats with shared documents, with one decision opened
by its request id.

    gorgo bench screenshot [PATH]
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import aiohttp

from emulator.stack.settings import StackSettings
from emulator.stack.stack import Stack
from loadgen.client.chromium import open_page
from loadgen.client.stream import chat_body, send_chat
from loadgen.progress import bar

OUT = Path(__file__).resolve().parents[3] / "docs" / "img" / "operator-page.png"
REQUESTS = 300
CONCURRENCY = 8
# Shared documents, each asked several questions: the prefix cache shows in the hit ratios.
DOCUMENTS = 12
OPENED = "shot-0290"


async def _traffic(url: str) -> None:
    rng = random.Random(0)
    docs = ["".join(f"{rng.randrange(1000):03d} " for _ in range(1500)) for _ in range(DOCUMENTS)]
    sem = asyncio.Semaphore(CONCURRENCY)
    with bar(REQUESTS, "chats", unit="req") as done:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                body = chat_body(f"{docs[rng.randrange(DOCUMENTS)]} question {i}?", 32)
                rid = f"shot-{i:04d}"
                async with sem:
                    await send_chat(s, url, body, rid, {"x-request-id": rid})
                done.update()

            await asyncio.gather(*(one(i) for i in range(REQUESTS)))


async def _shoot(admin_url: str, out: Path) -> None:
    async with open_page(width=1400, height=1300) as b:
        page = b.page
        await page.goto(f"{admin_url}/ui")
        await page.wait_for_function(
            f"document.querySelector('.drow[data-request-id=\"{OPENED}\"]')"
        )
        await page.evaluate(
            f"(() => {{ const s = document.getElementById('search'); s.value = '{OPENED}';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        await page.wait_for_function("document.getElementById('detail-id')")
        await page.evaluate(
            "(() => { const s = document.getElementById('search'); s.value = '';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        await asyncio.sleep(0.5)
        await page.screenshot(path=out, full_page=False)


def run_screenshot(out: Path = OUT) -> int:
    stack = Stack(StackSettings(policy="gorgo", rtt_profile="network"))
    print("starting the local stack...", file=sys.stderr)
    stack.start()
    try:
        asyncio.run(_traffic(stack.front_door_url))
        asyncio.run(_shoot(stack.admin_url, out))
    finally:
        stack.stop()
    print(f"wrote {out}")
    return 0
