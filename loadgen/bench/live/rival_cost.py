"""`gorgo bench overhead --peers`: what each router costs a request, side by side in one run.

In front of the same 3 zero-delay engines (every millisecond is then the router's, not the
engines'): the engines reached directly (the client takes them in turn), Envoy alone (no
ext_proc: the fallback route), Envoy + gorgo (shipped default policy), SMG `cache_aware`
and vllm-router `cache_aware` (their defaults, emulator/rivals/fronts.py). Requests rotate
over the fronts one at a time, the order turning each round, so machine drift hits all
alike. Per front: TTFT p50/p99 at concurrency 1 (1k-token prompts) and what it adds to
the engines reached directly, the CPU its processes spent per request (gorgo: the router
and its Envoy), their RSS after the run, and requests/s at concurrency 16 against the
direct figure (each front in turn, twice).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from emulator.rivals.fronts import front
from emulator.rivals.process import RivalProcess, start_rival
from emulator.stack.ports import free_ports
from loadgen.bench.live.load import proc_cpu_s
from loadgen.bench.live.overhead import _prompt, paired_stack
from loadgen.client.stream import Result, chat_body, percentile, send_chat
from loadgen.progress import bar

RIVALS = ("smg:cache_aware", "vllm-router:cache_aware")
DIRECT, ALONE, GORGO = "engines direct", "envoy alone", "envoy+gorgo"
WARM_REQUESTS = 10
CONCURRENCY = 16


@dataclass
class Front:
    """One way to the engines: the URLs a request takes in turn and the router processes
    whose CPU and memory are its cost (none for the engines reached directly)."""

    name: str
    urls: list[str]
    pids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next = itertools.cycle(self.urls)

    def url(self) -> str:
        return next(self._next)

    def cpu_s(self) -> float:
        return sum(proc_cpu_s(p) for p in self.pids)

    def rss_mb(self) -> float:
        return sum(psutil.Process(p).memory_info().rss for p in self.pids) / 2**20


async def rotate(fronts: Sequence[Front], body: dict[str, object], n: int) -> list[list[Result]]:
    """n requests through each front, one at a time, the order turned each round."""
    out: list[list[Result]] = [[] for _ in fronts]
    with bar(n, "rounds", unit="round", leave=False) as rounds:
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                for k in range(len(fronts)):
                    j = (i + k) % len(fronts)
                    out[j].append(await send_chat(s, fronts[j].url(), body, f"c{i}"))
                rounds.update()
    return out


async def rate(f: Front, body: dict[str, object], n: int, concurrency: int) -> float:
    """Requests/s through `f` with `concurrency` clients; raises if any failed."""
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> Result:
            async with sem:
                return await send_chat(s, f.url(), body, f"t{i}")

        t0 = loop.time()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = loop.time() - t0
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{f.name}: {len(failed)} of {n} failed, first: {failed[0].error}")
    return n / elapsed


@dataclass(frozen=True)
class Row:
    name: str
    ttft_p50_ms: float
    ttft_p99_ms: float
    cpu_ms_per_request: float | None
    rss_mb: float | None
    rate_per_s: float


def ttfts(f: Front, rs: list[Result]) -> list[float]:
    bad = [r for r in rs if not r.ok or r.ttft_ms is None]
    if bad:
        raise RuntimeError(f"{f.name}: {len(bad)} requests failed, first: {bad[0].error}")
    return [r.ttft_ms for r in rs if r.ttft_ms is not None]


async def measure(fronts: Sequence[Front], n: int) -> list[Row]:
    body = chat_body(_prompt(1024), 1)
    await rotate(fronts, body, WARM_REQUESTS)
    cpu0 = [f.cpu_s() for f in fronts]
    print(f"  concurrency 1, 1k-token prompts, {n} requests each...", file=sys.stderr)
    results = await rotate(fronts, body, n)
    for f, rs in zip(fronts, results, strict=True):
        ttfts(f, rs)  # fail now, not after the long phase
    cpu_ms = [(f.cpu_s() - c0) * 1e3 / n for f, c0 in zip(fronts, cpu0, strict=True)]
    print(f"  concurrency {CONCURRENCY}, each front in turn, twice...", file=sys.stderr)
    rates: list[list[float]] = [[] for _ in fronts]
    body16 = chat_body(_prompt(1024), 16)
    for _ in range(2):
        for i, f in enumerate(fronts):
            rates[i].append(await rate(f, body16, 2 * n, CONCURRENCY))
    rows = []
    for f, rs, cpu, rr in zip(fronts, results, cpu_ms, rates, strict=True):
        t = ttfts(f, rs)
        rows.append(
            Row(
                f.name,
                percentile(t, 50),
                percentile(t, 99),
                cpu if f.pids else None,
                f.rss_mb() if f.pids else None,
                sum(rr) / len(rr),
            )
        )
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """The side-by-side table; `added` and the rate ratio are against the first row (the
    engines reached directly)."""
    base = rows[0]
    lines = [
        f"{'front':<24} {'TTFT p50':>9} {'added':>7} {'TTFT p99':>9} {'added':>7} "
        f"{'CPU ms/req':>10} {'RSS MiB':>8} {'req/s @16':>10} {'vs direct':>9}",
    ]
    for r in rows:
        cpu = f"{r.cpu_ms_per_request:.2f}" if r.cpu_ms_per_request is not None else "-"
        rss = f"{r.rss_mb:.0f}" if r.rss_mb is not None else "-"
        lines.append(
            f"{r.name:<24} {r.ttft_p50_ms:>9.2f} {r.ttft_p50_ms - base.ttft_p50_ms:>+7.2f} "
            f"{r.ttft_p99_ms:>9.2f} {r.ttft_p99_ms - base.ttft_p99_ms:>+7.2f} {cpu:>10} "
            f"{rss:>8} {r.rate_per_s:>10.1f} {f'x{r.rate_per_s / base.rate_per_s:.3f}':>9}"
        )
    return lines


async def served_model(engine_url: str) -> str:
    """The model name the engine serves (its /v1/models' first id)."""
    async with aiohttp.ClientSession() as s, s.get(f"{engine_url}/v1/models") as r:
        r.raise_for_status()
        body = await r.json()
    return str(body["data"][0]["id"])


async def _start_rivals(engines: list[str], workdir: Path) -> list[RivalProcess]:
    rivals: list[RivalProcess] = []
    served = await served_model(engines[0])
    try:
        for name in RIVALS:
            port, metrics_port = free_ports(2)
            rivals.append(
                await start_rival(
                    front(name),
                    engines,
                    "default",
                    port=port,
                    metrics_port=metrics_port,
                    log_path=workdir / f"{name.replace(':', '-')}.log",
                    env={"SMG_CACHE_TRACE": "0"},  # its decision log is not part of its cost
                    served_model=served,
                )
            )
    except BaseException:
        for p in rivals:
            await p.stop()
        raise
    return rivals


def run_rival_cost_bench(requests: int = 200) -> int:
    print(
        "starting 3 zero-delay engines, Envoy alone, Envoy + gorgo, " + ", ".join(RIVALS) + "...",
        file=sys.stderr,
    )
    stack, (alone_url, gorgo_url) = paired_stack(policy="gorgo")
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-rival-cost-"))
    try:
        engines = [stack.engine_url(i) for i in range(3)]
        rivals = asyncio.run(_start_rivals(engines, workdir))
        try:
            fronts = [
                Front(DIRECT, engines),
                Front(ALONE, [alone_url], [stack.procs["envoy-alone"].pid]),
                Front(GORGO, [gorgo_url], [stack.procs[n].pid for n in ("gorgo-serve", "envoy")]),
                *(Front(p.front.name, [p.url], [p.pid]) for p in rivals),
            ]
            rows = asyncio.run(measure(fronts, requests))
        finally:
            for p in rivals:
                asyncio.run(p.stop())
    finally:
        stack.stop()
    print("\n".join(table(rows)))
    print(
        f"(logs in {workdir}; CPU per request: each front's processes over the concurrency-1 "
        "phase, their idle work included; gorgo's is the router and its Envoy)"
    )
    return 0
