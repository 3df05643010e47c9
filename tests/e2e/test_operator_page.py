"""The operator's page in a real browser: headless Chromium loads /ui from a running stack
(real Envoy, `gorgo serve`, emulated engines) and its rendered DOM names every backend,
a request sent with its own x-request-id, where it went and its candidates' cost terms;
a later request appears without a reload."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from emulator.stack.stack import Stack
from loadgen.client.browser import Browser, find_chromium
from loadgen.client.stream import chat_body, send_chat
from tests.e2e.conftest import fast_settings

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        find_chromium() is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
    ),
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with Browser.launch() as b:
        yield b


async def send(stack: Stack, request_id: str) -> None:
    async with aiohttp.ClientSession() as s:
        body = chat_body(f"where does {request_id} go?", 4)
        r = await send_chat(s, stack.front_door_url, body, request_id, {"x-request-id": request_id})
    assert r.ok, r.error


async def decision(stack: Stack, request_id: str) -> Any:
    async with aiohttp.ClientSession() as s:
        url = f"{stack.admin_url}/ui/decision"
        async with s.get(url, params={"request_id": request_id}) as r:
            assert r.status == 200
            return await r.json()


ROW = "document.querySelector('#decision-rows .drow[data-request-id=\"{}\"]')"


async def test_the_page_shows_the_fleet_a_decision_and_its_terms_live(
    stack: Stack, browser: Browser
) -> None:
    await send(stack, "page-X")
    await browser.goto(f"{stack.admin_url}/ui")
    # the row drawn (its text laid out: under load the first paint can lag the insert)
    await browser.wait_for(ROW.format("page-X") + "?.innerText.includes('page-X')")
    fleet = await browser.evaluate(
        "[...document.querySelectorAll('#fleet tbody tr')].map(r => r.dataset.backend)"
    )
    assert fleet == list(stack.config.backend_ids)
    went = (await decision(stack, "page-X"))["backend"]
    row = await browser.evaluate(ROW.format("page-X") + ".innerText")
    assert "page-X" in row and went in row

    # the search opens the decision whole: every candidate with every cost term
    await browser.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = 'page-X';"
        " s.dispatchEvent(new Event('input')); })()"
    )
    await browser.wait_for("document.getElementById('detail-id')")
    assert await browser.evaluate("document.getElementById('detail-backend').textContent") == went
    shown = await browser.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#detail tr[data-candidate]')].map("
        "r => [r.dataset.candidate, Object.fromEntries([...r.querySelectorAll('td[data-term]')]"
        ".map(t => [t.dataset.term, t.textContent]))]))"
    )
    whole = await decision(stack, "page-X")
    names = [t["name"] for t in whole["terms"]]
    assert names[:6] == ["rtt", "queue", "lora_wait", "prefill", "decode_stall", "kv"]
    assert set(shown) == set(stack.config.backend_ids)
    for backend, _score, _cached, _uncached, *values in whole["candidates"]:
        terms = dict(zip(names, values, strict=True))
        assert set(shown[backend]) == set(names)
        for term, value in terms.items():
            assert float(shown[backend][term]) == pytest.approx(value, abs=0.051 + 0.005 * value)
    assert float(shown[went]["rtt"]) > 0

    # a second request appears by itself (the page polls), no reload
    await browser.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = '';"
        " s.dispatchEvent(new Event('input')); window.notReloaded = true; })()"
    )
    await send(stack, "page-Y")
    sent = time.monotonic()
    await browser.wait_for(ROW.format("page-Y"), timeout_s=2.0)
    print(f"page-Y on the page {time.monotonic() - sent:.2f} s after its response ended")
    assert await browser.evaluate("window.notReloaded === true")
