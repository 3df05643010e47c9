"""`gorgo bench load`: many concurrent streams through Envoy and one router process for a
while; reports errors and timeouts, the router's CPU time and memory per request, and
whether its memory stays flat (bounded prefix index and in-flight table).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass

import aiohttp

from emulator.stack import DEFAULT_REGIONS, Region, Stack, StackPorts, StackSettings
from loadgen.client import chat_body, send_chat

# Engines that stream for a few seconds per request: 200 streams stay open at once.
ENGINE_ARGS = tuple(
    arg
    for setting in ("prefill_base_ms=5", "prefill_tokens_per_s=1000000", "decode_base_ms=10")
    for arg in ("--set", setting)
)
REGIONS = tuple(Region(r.id, 1.0 + 2 * i) for i, r in enumerate(DEFAULT_REGIONS))


@dataclass
class LoadReport:
    streams: int
    duration_s: float
    requests: int
    errors: int
    timeouts: int
    cpu_ms_per_request: float
    rss_start_mb: float
    rss_end_mb: float
    rss_samples_mb: list[float]

    def lines(self) -> list[str]:
        return [
            f"{self.streams} concurrent streams for {self.duration_s:.0f} s: {self.requests} "
            f"requests, {self.errors} errors ({self.timeouts} timeouts)",
            f"router CPU per request: {self.cpu_ms_per_request:.3f} ms",
            f"router RSS: {self.rss_start_mb:.1f} MB at start, {self.rss_end_mb:.1f} MB at end "
            f"(samples: {', '.join(f'{v:.1f}' for v in self.rss_samples_mb)})",
        ]


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _closed_loop(
    url: str, streams: int, duration_s: float, pid: int
) -> tuple[int, int, int, list[float]]:
    deadline = time.monotonic() + duration_s
    requests = errors = timeouts = 0
    samples: list[float] = []
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=streams)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def client(i: int) -> None:
            nonlocal requests, errors, timeouts
            n = 0
            while time.monotonic() < deadline:
                body = chat_body(f"client {i} turn {n} " * 40, 200)
                r = await send_chat(s, url, body, f"c{i}-{n}", timeout_s=60)
                requests += 1
                if not r.ok:
                    errors += 1
                    timeouts += "Timeout" in r.error
                n += 1

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append(_proc_rss_mb(pid))
                await asyncio.sleep(max(1.0, duration_s / 10))

        await asyncio.gather(sampler(), *(client(i) for i in range(streams)))
    return requests, errors, timeouts, samples


def run_load(streams: int = 200, duration_s: float = 60.0) -> LoadReport:
    stack = Stack(
        StackSettings(
            policy="gorgo",
            regions=REGIONS,
            ports=StackPorts.ephemeral(len(REGIONS)),
            engine_args=ENGINE_ARGS,
            envoy_concurrency=1,
        )
    )
    stack.start()
    try:
        pid = stack.procs["gorgo-serve"].pid
        cpu0, rss0 = _proc_cpu_s(pid), _proc_rss_mb(pid)
        requests, errors, timeouts, samples = asyncio.run(
            _closed_loop(stack.front_door_url, streams, duration_s, pid)
        )
        cpu_s, rss1 = _proc_cpu_s(pid) - cpu0, _proc_rss_mb(pid)
    finally:
        stack.stop()
    return LoadReport(
        streams,
        duration_s,
        requests,
        errors,
        timeouts,
        cpu_s * 1000 / max(1, requests),
        rss0,
        rss1,
        samples,
    )


def run_load_bench(streams: int, duration_s: float) -> int:
    print(
        f"{streams} streams for {duration_s:.0f} s through Envoy and one router...", file=sys.stderr
    )
    report = run_load(streams, duration_s)
    print("\n".join(report.lines()))
    return 1 if report.errors else 0
