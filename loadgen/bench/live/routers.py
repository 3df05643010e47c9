"""`gorgo bench routers`: one router process against several behind the same Envoy.

Each round starts the stack (Envoy, zero-delay engines without WAN links, KV events on)
with 1 router, then with N, and drives it with `concurrency` clients sending 1k-token
chats for `duration_s`: requests/s, errors, and each router process's CPU seconds per
1,000 requests it decided. Rounds alternate (1, N, 1, N) so drift hits both; on this
2-core machine Envoy, the engines and the clients share the cores with the routers.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass

from emulator.stack.settings import StackPorts, StackSettings
from emulator.stack.stack import Stack
from loadgen.bench.live import load as bench_load
from loadgen.bench.live import overhead as bench_overhead
from loadgen.client.stream import chat_body, closed_loop
from loadgen.progress import timed

TARGET_RATIO = 1.3


@dataclass
class Round:
    routers: int
    requests: int
    errors: int
    rate: float
    # Per router process: CPU seconds per 1,000 requests it decided.
    cpu_s_per_1k: list[float]


async def _drive(url: str, concurrency: int, duration_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + duration_s
    body = chat_body(bench_overhead._prompt(1024), 16)
    sent = await closed_loop(
        url, concurrency, lambda _i, _n: body, lambda: time.monotonic() < deadline, 600.0
    )
    return len(sent), sum(not r.ok for _, r in sent)


def _decisions(admin_url: str) -> int:
    with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as r:
        return int(json.load(r)["decisions"])


def one_round(routers: int, concurrency: int, duration_s: float) -> Round:
    stack = Stack(
        StackSettings(
            policy="gorgo",
            regions=bench_overhead.REGIONS,
            ports=StackPorts.ephemeral(len(bench_overhead.REGIONS)),
            engine_args=("--zero-delay",),
            wan_links=False,
            kv_events=True,
            routers=routers,
        )
    )
    stack.start()
    try:
        names = ["gorgo-serve", *(f"{c.bus.router_id}-gorgo-serve" for c in stack.extra_routers)]
        admins = [stack.admin_url, *(f"http://{c.listen.admin}" for c in stack.extra_routers)]
        asyncio.run(_drive(stack.front_door_url, concurrency, 2.0))  # warm
        pids = [stack.procs[n].pid for n in names]
        cpu0 = [bench_load.proc_cpu_s(p) for p in pids]
        dec0 = [_decisions(a) for a in admins]
        t0 = time.monotonic()
        with timed(duration_s, f"{routers} router(s)"):
            done, errors = asyncio.run(_drive(stack.front_door_url, concurrency, duration_s))
        elapsed = time.monotonic() - t0
        cpu = [bench_load.proc_cpu_s(p) - c for p, c in zip(pids, cpu0, strict=True)]
        dec = [_decisions(a) - d for a, d in zip(admins, dec0, strict=True)]
    finally:
        stack.stop()
    per_1k = [c * 1000 / max(1, d) for c, d in zip(cpu, dec, strict=True)]
    return Round(routers, done, errors, done / elapsed, per_1k)


def run_routers_bench(routers: int = 2, concurrency: int = 32, duration_s: float = 20.0) -> int:
    rounds = []
    for n in (1, routers, 1, routers):
        print(f"  {n} router(s), {concurrency} clients, {duration_s:.0f} s...", file=sys.stderr)
        rounds.append(one_round(n, concurrency, duration_s))
    lines = []
    for r in rounds:
        cpu = ", ".join(f"{v:.2f}" for v in r.cpu_s_per_1k)
        lines.append(
            f"{r.routers} router(s): {r.rate:.1f} requests/s ({r.requests} requests, "
            f"{r.errors} errors); CPU s per 1,000 decided, per process: {cpu}"
        )
    one = sum(r.rate for r in rounds if r.routers == 1) / 2
    many = sum(r.rate for r in rounds if r.routers == routers) / 2
    ratio = many / one
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    lines.append(
        f"{routers} routers / 1: x{ratio:.3f} requests/s at concurrency {concurrency} "
        f"(target >= {TARGET_RATIO}): {verdict}"
    )
    print("\n".join(lines))
    return 0 if not any(r.errors for r in rounds) else 1
