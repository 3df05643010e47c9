"""`gorgo bench page`: what the operator's page costs the router, and how fast it draws.

1. Render: a router core with 64 backends and 1,000 decisions in its log (closed, with
   their outcomes) serves its admin app; headless Chromium loads /ui. Reported: the time
   from navigation to the first full draw (64 fleet rows, 1,000 decision rows), the
   feed's size and the router's time to build it (whole, and one poll's increment).
2. Decide: `gorgo bench decide`'s 128k-token decision with the log at 1,000 decisions
   against 8 (what /state showed before the page), in the same run.
3. Overhead: `gorgo bench overhead`'s pairing (Envoy alone against Envoy + gorgo, 1k-token
   prompts, one at a time) with the page closed and open, alternating.
4. Load: 200 concurrent streams through Envoy and one router (`gorgo bench load`'s stack)
   in phases, page closed and open alternating: TTFT p50/p99 and router CPU per request.

Every comparison is between phases of the same run; the machine's noise hits both.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from emulator.stack.ports import free_ports
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.admin.operator_page import feed
from ext_proc.vocab.types import RouteRequest, Status
from loadgen.bench.live import load as bench_load
from loadgen.bench.live import overhead as bench_overhead
from loadgen.bench.router import decide as bench_decide
from loadgen.client.chromium import open_page
from loadgen.client.stream import chat_body, closed_loop, percentile
from loadgen.progress import timed

TARGET_RENDER_MS = 1000.0
ROWS = (
    "document.querySelectorAll('#fleet tbody tr').length === {backends} && "
    "document.querySelectorAll('#decision-rows .drow').length === {decisions}"
)


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr)


# How the page is "open" in a phase: not at all, polled by a plain HTTP client as the page
# polls (the router's side of the cost alone), or in headless Chromium (the browser's CPU
# too: on this 2-core machine it competes with the router, Envoy and the engines).
CLOSED, POLLED, BROWSER = "closed", "polled", "browser"


@contextlib.asynccontextmanager
async def _page(admin_url: str, how: str, cpu: list[float]) -> AsyncIterator[None]:
    """The page open at `admin_url` as `how` says; appends the browser's CPU seconds."""
    if how == POLLED:
        task = asyncio.create_task(_poll(admin_url))
        try:
            yield
        finally:
            task.cancel()
        return
    if how == CLOSED:
        yield
        return
    async with open_page() as b:
        await b.page.goto(f"{admin_url}/ui")
        await b.page.wait_for_function("document.body.dataset.firstDrawMs")
        cpu0 = b.cpu_s()
        yield
        cpu.append(b.cpu_s() - cpu0)


async def _poll(admin_url: str) -> None:
    """What the page asks for, once a second."""
    since, steps = 0, ""
    async with aiohttp.ClientSession() as s:
        while True:
            params = {"since": str(since), "steps": steps}
            async with s.get(f"{admin_url}/ui/feed", params=params) as r:
                f = await r.json()
            since = f["seq"]
            steps = f["tuner"]["steps_key"] if f["tuner"] else ""
            await asyncio.sleep(1.0)


# -- 1. render ----------------------------------------------------------------------------


def _filled_router(backends: int, decisions: int) -> Any:
    router = bench_decide._router(backends, recent_decisions=decisions)
    rng = random.Random(0)
    for i in range(decisions):
        body = bench_decide._body(bench_decide._text(rng.randrange(200, 2000), i))
        d = router.decide(RouteRequest(f"req-{i:05d}", parse_body(CHAT, body), None))
        router.first_byte(d.request_id)
        router.close(d.request_id, Status.OK)
    return router


async def render(backends: int = 64, decisions: int = 1000) -> list[str]:
    router = _filled_router(backends, decisions)
    t0 = time.perf_counter()
    whole = feed(router, 0, "", "")
    whole_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    feed(router, router.recent.seq - 20, whole["tuner"]["steps_key"] if whole["tuner"] else "", "")
    poll_ms = (time.perf_counter() - t0) * 1e3
    size_kb = len(web.json_response(whole).body or b"") / 1024  # type: ignore[arg-type]
    runner = web.AppRunner(make_admin_app(router, None, dict), access_log=None)  # type: ignore[arg-type]
    await runner.setup()
    (port,) = free_ports(1)
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        draws = []
        for _ in range(3):
            async with open_page() as b:
                await b.page.goto(f"http://127.0.0.1:{port}/ui")
                await b.page.wait_for_function(
                    ROWS.format(backends=backends, decisions=decisions), timeout=30_000
                )
                draws.append(float(await b.page.evaluate("document.body.dataset.firstDrawMs")))
    finally:
        await runner.cleanup()
    return [
        f"render, {backends} backends and {decisions} decisions: first full draw "
        f"{', '.join(f'{v:.0f}' for v in draws)} ms after navigation (3 browsers; "
        f"target <= {TARGET_RENDER_MS:.0f})",
        f"feed: {size_kb:.0f} KB whole, built in {whole_ms:.1f} ms; a poll with 20 changes "
        f"{poll_ms:.2f} ms",
    ]


# -- 2. decide ----------------------------------------------------------------------------


def decide(iterations: int) -> list[str]:
    lines = []
    for backends in (3, 64):
        p99: dict[int, list[float]] = {}
        for size in (8, 1000, 8, 1000):  # alternating: drift hits both
            ms, _ = bench_decide.measure(backends, 131_072, iterations, recent_decisions=size)
            p99.setdefault(size, []).append(percentile(ms, 99))
        a, b = (sum(p99[s]) / 2 for s in (8, 1000))
        lines.append(
            f"decide p99, 128k tokens, {backends} backends: log of 8 {a:.3f} ms, of 1000 "
            f"{b:.3f} ms (x{b / a:.3f})"
        )
    return lines


# -- 3. overhead --------------------------------------------------------------------------


def overhead(requests: int) -> list[str]:
    stack, urls = bench_overhead.paired_stack("gorgo")
    added: dict[bool, list[float]] = {False: [], True: []}
    try:
        body = chat_body(bench_overhead._prompt(1024), 1)
        asyncio.run(bench_overhead._alternate(urls, body, 10))

        async def phase(open_page: bool) -> bench_overhead.Pair:
            async with _page(stack.admin_url, BROWSER if open_page else CLOSED, []):
                return await bench_overhead._alternate(urls, body, requests)

        for open_page in (False, True, False, True):
            _say(f"overhead, page {'open' if open_page else 'closed'}: {requests} pairs...")
            pair = asyncio.run(phase(open_page))
            e, g = bench_overhead._ttfts(pair.envoy), bench_overhead._ttfts(pair.gorgo)
            added[open_page].append(percentile(g, 99) - percentile(e, 99))
            added[open_page].append(percentile(g, 50) - percentile(e, 50))
    finally:
        stack.stop()

    def figures(values: list[float]) -> str:
        return "/".join(f"{v:.2f}" for v in values)

    closed_p99, closed_p50 = added[False][0::2], added[False][1::2]
    open_p99, open_p50 = added[True][0::2], added[True][1::2]
    ratio = sum(open_p99) / max(1e-9, sum(closed_p99))
    return [
        f"overhead, 1k-token prompt, added TTFT p50: page closed {figures(closed_p50)} ms, "
        f"open {figures(open_p50)} ms",
        f"overhead, 1k-token prompt, added TTFT p99: page closed {figures(closed_p99)} ms, "
        f"open {figures(open_p99)} ms (x{ratio:.3f})",
    ]


# -- 4. load ------------------------------------------------------------------------------


# Each state at each position once: drift over the run hits all three alike.
ORDER = (CLOSED, POLLED, BROWSER, BROWSER, CLOSED, POLLED, POLLED, BROWSER, CLOSED)
# The stack's first half minute under 200 streams settles (TTFT falls several-fold).
WARMUP_S = 30.0


async def _phases(
    admin_url: str, url: str, streams: int, phase_s: float, pid: int
) -> tuple[list[tuple[str, list[float], float]], list[float], int]:
    """One closed loop of `streams` clients for the whole run while the page's state
    changes every `phase_s` (ORDER); each request counts in the phase it started in.
    Returns per phase (state, TTFTs, router CPU ms per request), the browser's CPU share
    per browser phase, and the errors."""
    windows: list[tuple[float, float, str, float]] = []  # start, end, state, router CPU s
    stop = asyncio.Event()

    def body_of(i: int, n: int) -> dict[str, Any]:
        return chat_body(f"client {i} turn {n} " * 200, 200)

    loop = asyncio.create_task(closed_loop(url, streams, body_of, lambda: not stop.is_set()))
    with timed(WARMUP_S, "warm-up"):
        await asyncio.sleep(WARMUP_S)
    browser_share: list[float] = []
    for how in ORDER:
        _say(f"load, page {how}: {phase_s:.0f} s...")
        cpu: list[float] = []
        async with _page(admin_url, how, cpu):
            t0, cpu0 = time.monotonic(), bench_load.proc_cpu_s(pid)
            with timed(phase_s, f"page {how}"):
                await asyncio.sleep(phase_s)
            windows.append((t0, time.monotonic(), how, bench_load.proc_cpu_s(pid) - cpu0))
        browser_share += [c / phase_s for c in cpu]
    stop.set()
    results = await loop
    phases = []
    for t0, t1, how, cpu_s in windows:
        rs = [r for t, r in results if t0 <= t < t1]
        ttfts = [r.ttft_ms for r in rs if r.ok and r.ttft_ms is not None]
        phases.append((how, ttfts, cpu_s * 1e3 / max(1, len(rs))))
    return phases, browser_share, sum(not r.ok for _, r in results)


def load(streams: int, phase_s: float) -> list[str]:
    stack = bench_load.load_stack()
    stack.start()
    try:
        pid = stack.procs["gorgo-serve"].pid
        _say(f"load: {streams} streams, {len(ORDER)} phases of {phase_s:.0f} s...")
        phases, browser_share, errors = asyncio.run(
            _phases(stack.admin_url, stack.front_door_url, streams, phase_s, pid)
        )
    finally:
        stack.stop()
    rows = [f"load, {streams} streams: {errors} errors over the run"]
    for how in (CLOSED, POLLED, BROWSER):
        mine = [(t, c) for h, t, c in phases if h == how]
        p99 = [percentile(t, 99) for t, _ in mine]
        p50 = [percentile(t, 50) for t, _ in mine]
        extra = ""
        if how == BROWSER:
            extra = f", browser {'/'.join(f'{v:.0%}' for v in browser_share)} of a core"
        rows.append(
            f"load, page {how:<7}: TTFT p50 {'/'.join(f'{v:.0f}' for v in p50)} ms, "
            f"p99 {'/'.join(f'{v:.0f}' for v in p99)} ms, router CPU "
            f"{'/'.join(f'{c:.2f}' for _, c in mine)} ms per request{extra}"
        )
    return rows


def run_page_bench(streams: int = 200, phase_s: float = 20.0, requests: int = 200) -> int:
    lines: list[str] = []
    _say("render: 64 backends, 1,000 decisions, headless Chromium...")
    lines += asyncio.run(render())
    _say("decide: 128k-token prompts, the log at 8 and at 1,000...")
    lines += decide(150)
    lines += overhead(requests)
    lines += load(streams, phase_s)
    print("\n".join(lines))
    return 0
