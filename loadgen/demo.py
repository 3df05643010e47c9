"""`make demo`: start the local stack, send streaming chats through Envoy, print a table."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.request
from collections import defaultdict

import aiohttp

from emulator.stack.processes import StackError
from emulator.stack.settings import StackSettings
from emulator.stack.stack import Stack
from loadgen.client.stream import Result, chat_body, percentile, send_chat
from loadgen.progress import bar

# Prompt sizes (tokens) cycle through short chat turns and long documents.
PROMPT_TOKENS = (64, 512, 2048, 8192)
OUTPUT_TOKENS = 32


def _prompt(tokens: int, rng: random.Random) -> str:
    # 4 bytes per token under the project's tokenizer approximation.
    return "".join(f"{rng.randrange(1000):03d} " for _ in range(tokens))


async def _drive(url: str, n: int, concurrency: int, seed: int) -> list[Result]:
    rng = random.Random(seed)
    bodies = [
        chat_body(_prompt(PROMPT_TOKENS[i % len(PROMPT_TOKENS)], rng), OUTPUT_TOKENS)
        for i in range(n)
    ]
    sem = asyncio.Semaphore(concurrency)
    with bar(n, "demo", unit="req") as done:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> Result:
                async with sem:
                    r = await send_chat(session, url, bodies[i], f"demo-{i}")
                done.update()
                return r

            return await asyncio.gather(*(one(i) for i in range(n)))


def format_table(results: list[Result]) -> str:
    by_backend: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_backend[r.backend or "(none)"].append(r)
    lines = [
        f"{'backend':<14} {'requests':>8} {'errors':>6} {'TTFT p50 ms':>12} "
        f"{'TTFT p95 ms':>12} {'E2E p50 ms':>11}"
    ]
    for backend in sorted(by_backend):
        rs = by_backend[backend]
        ttft = [r.ttft_ms for r in rs if r.ok and r.ttft_ms is not None]
        e2e = [r.e2e_ms for r in rs if r.ok and r.e2e_ms is not None]
        lines.append(
            f"{backend:<14} {len(rs):>8} {sum(not r.ok for r in rs):>6} "
            f"{percentile(ttft, 50):>12.1f} {percentile(ttft, 95):>12.1f} "
            f"{percentile(e2e, 50):>11.1f}"
        )
    return "\n".join(lines)


def run_demo(requests: int, concurrency: int, policy: str, seed: int = 0) -> int:
    stack = Stack(StackSettings(policy=policy, rtt_profile="network"))
    try:
        print("starting the local stack (Envoy, gorgo serve, 3 engines, 3 WAN links)...")
        stack.start()
    except StackError as e:
        print(f"gorgo demo: {e}", file=sys.stderr)
        return 1
    try:
        print(stack.ready_line())
        print(f"sending {requests} streaming chat requests, concurrency {concurrency}...")
        t0 = time.perf_counter()
        results = asyncio.run(_drive(stack.front_door_url, requests, concurrency, seed))
        wall_s = time.perf_counter() - t0
        with urllib.request.urlopen(f"{stack.admin_url}/state", timeout=5) as r:
            state = json.load(r)
    finally:
        stack.stop()
    print()
    print(f"policy {policy}: {requests} requests in {wall_s:.1f} s")
    print(format_table(results))
    routed = {b: s["completed"] + s["errors"] for b, s in state["backends"].items()}
    print(f"router /state: decisions {state['decisions']}, completed per backend {routed}")
    failed = sum(not r.ok for r in results)
    return 1 if failed else 0
