"""The operator's page in a real browser: headless Chromium (Playwright driving Debian's
chromium) loads /ui from a running stack (real Envoy, `gorgo serve`, emulated engines) and
its rendered DOM names every backend, a request sent with its own x-request-id, where it
went and its candidates' cost terms; a later request appears without a reload. Every page
test fails on a page error (an uncaught exception, or a console.error): the `browser`
fixture raises them at teardown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Page

from emulator.stack.stack import Stack
from loadgen.client.chromium import MISSING, PageError, find_chromium, open_page
from loadgen.client.stream import chat_body, send_chat
from tests.e2e.conftest import fast_settings

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(find_chromium() is None, reason=MISSING),
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Page]:
    """A page in a fresh headless Chromium; the test fails (at teardown) on any error the
    page raised or logged while it was open."""
    async with open_page() as chromium:
        yield chromium.page


async def test_a_page_error_fails_the_page_test() -> None:
    """What the fixture relies on: an exception nobody catches in the page, a rejected
    promise and a console.error each fail the page on leaving; a clean page does not."""
    with pytest.raises(PageError, match="3 page error") as caught:
        async with open_page() as chromium:
            await chromium.page.set_content("<p>page</p>")
            await chromium.page.evaluate(
                "setTimeout(() => { throw new Error('drawn wrong') });"
                "void Promise.reject(new Error('no feed'));"
                "console.error('poll failed: HTTP 500')"
            )
            async with asyncio.timeout(10):  # the events' way back from the browser
                while len(chromium.errors) < 3:
                    await asyncio.sleep(0.01)
            assert chromium.cpu_s() > 0  # the browser's processes, renderer included
    for said in ("Error: drawn wrong", "Error: no feed", "console.error: poll failed: HTTP 500"):
        assert said in str(caught.value)
    async with open_page() as chromium:
        await chromium.page.set_content("<p>page</p>")
        await chromium.page.evaluate("console.log('fine'); console.warn('also fine')")
        await chromium.page.wait_for_timeout(100)
    assert chromium.errors == []


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
    stack: Stack, browser: Page
) -> None:
    await send(stack, "page-X")
    await browser.goto(f"{stack.admin_url}/ui")
    # the row drawn (its text laid out: under load the first paint can lag the insert)
    await browser.wait_for_function(ROW.format("page-X") + "?.innerText.includes('page-X')")
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
    await browser.wait_for_function("document.getElementById('detail-id')")
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
    await browser.wait_for_function(ROW.format("page-Y"), timeout=2000)
    print(f"page-Y on the page {time.monotonic() - sent:.2f} s after its response ended")
    assert await browser.evaluate("window.notReloaded === true")


async def test_a_disaggregated_decision_shows_its_prefill_engine_and_transfer(
    browser: Page,
) -> None:
    """The page over a router deciding for a P/D fleet (no stack needed: its admin app
    in-process): the detail names the prefill engine beside the decode one, with the KV
    and the transfer predicted."""
    from unittest.mock import MagicMock

    from aiohttp.test_utils import TestServer

    from ext_proc.service.admin.api import make_admin_app
    from tests.builders import chat
    from tests.unit.core.test_pairs import LONG, pd_router

    router, _ = pd_router()
    d = router.decide(chat(LONG, rid="pd-1"))
    assert d.prefill is not None
    async with TestServer(make_admin_app(router, MagicMock(), dict)) as server:
        await browser.goto(str(server.make_url("/ui")))
        await browser.wait_for_function(ROW.format("pd-1"))
        await browser.evaluate(
            "(() => { const s = document.getElementById('search'); s.value = 'pd-1';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        await browser.wait_for_function("document.getElementById('detail-prefill')")
        shown = await browser.evaluate("document.getElementById('detail').innerText")
    assert await browser.evaluate("document.getElementById('detail-backend').textContent") == "da"
    assert f"prefilled on {d.prefill.backend}" in shown
    assert f"KV {d.prefill.kv_bytes / 1e6:.1f} MB" in shown and "transfer" in shown
