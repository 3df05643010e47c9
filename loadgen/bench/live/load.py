"""`gorgo bench load`: many concurrent streams through Envoy and one router process for a
while; reports errors and timeouts, the router's CPU time and memory per request, and
whether its memory stays flat (bounded prefix index and in-flight table).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import psutil

from emulator.stack.settings import DEFAULT_REGIONS, Region, StackPorts, StackSettings
from emulator.stack.stack import Stack
from ext_proc.estimate.profile import load_profile
from loadgen.client.stream import chat_body, closed_loop
from loadgen.progress import timed

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
    # From the router's /state at the end: prompt tokens its prefix index holds, against
    # what the backends' KV pools can hold, and requests still in flight.
    index_tokens: int = 0
    index_capacity_tokens: int = 0
    in_flight_end: int = 0

    def lines(self) -> list[str]:
        return [
            f"{self.streams} concurrent streams for {self.duration_s:.0f} s: {self.requests} "
            f"requests, {self.errors} errors ({self.timeouts} timeouts)",
            f"router CPU per request: {self.cpu_ms_per_request:.3f} ms",
            f"router RSS: {self.rss_start_mb:.1f} MB at start, {self.rss_end_mb:.1f} MB at end "
            f"(samples: {', '.join(f'{v:.1f}' for v in self.rss_samples_mb)})",
            f"prefix index at the end: {self.index_tokens} tokens (capacity "
            f"{self.index_capacity_tokens}); {self.in_flight_end} requests in flight",
        ]


def proc_cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system, all its threads), in seconds."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _proc_rss_mb(pid: int) -> float:
    """A process's resident set (its VmRSS), in MiB."""
    return psutil.Process(pid).memory_info().rss / 2**20


async def _closed_loop(
    url: str, streams: int, duration_s: float, pid: int
) -> tuple[int, int, int, list[float]]:
    deadline = time.monotonic() + duration_s
    samples: list[float] = []

    def body_of(i: int, n: int) -> dict[str, Any]:
        # ~900 tokens, unique per request: 3 new prefix blocks each, so the router's prefix
        # index fills up and must stay bounded.
        return chat_body(f"client {i} turn {n} " * 200, 200)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            samples.append(_proc_rss_mb(pid))
            await asyncio.sleep(max(1.0, duration_s / 10))

    _, sent = await asyncio.gather(
        sampler(), closed_loop(url, streams, body_of, lambda: time.monotonic() < deadline)
    )
    failed = [r for _, r in sent if not r.ok]
    return len(sent), len(failed), sum("Timeout" in r.error for r in failed), samples


def _settled_state(admin_url: str, wait_s: float = 5.0) -> dict[str, Any]:
    """The router's /state once the last completions (access log) have arrived."""
    deadline = time.monotonic() + wait_s
    while True:
        with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as r:
            state: dict[str, Any] = json.load(r)
        if state["in_flight"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def load_stack() -> Stack:
    """The load benchmarks' stack (not started): gorgo, engines that stream for seconds."""
    return Stack(
        StackSettings(
            policy="gorgo",
            regions=REGIONS,
            ports=StackPorts.ephemeral(len(REGIONS)),
            engine_args=ENGINE_ARGS,
            envoy_concurrency=1,
        )
    )


def run_load(streams: int = 200, duration_s: float = 60.0) -> LoadReport:
    stack = load_stack()
    stack.start()
    try:
        pid = stack.procs["gorgo-serve"].pid
        cpu0, rss0 = proc_cpu_s(pid), _proc_rss_mb(pid)
        with timed(duration_s, f"{streams} streams"):
            requests, errors, timeouts, samples = asyncio.run(
                _closed_loop(stack.front_door_url, streams, duration_s, pid)
            )
        cpu_s, rss1 = proc_cpu_s(pid) - cpu0, _proc_rss_mb(pid)
        state = _settled_state(stack.admin_url)
    finally:
        stack.stop()
    capacity = sum(
        b.kv_capacity_tokens or load_profile(b.engine_profile).kv_capacity_tokens
        for b in stack.config.backends
    )
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
        sum(b["cached_tokens"] for b in state["backends"].values()),
        capacity,
        state["in_flight"],
    )


def run_load_bench(streams: int, duration_s: float) -> int:
    print(
        f"{streams} streams for {duration_s:.0f} s through Envoy and one router...", file=sys.stderr
    )
    report = run_load(streams, duration_s)
    print("\n".join(report.lines()))
    return 1 if report.errors else 0
