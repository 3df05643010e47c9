"""What the router adds to a request cannot grow unseen: Envoy + gorgo against Envoy alone
in the same run (`gorgo bench overhead`'s stack, zero-delay engines), one request at a
time, alternating. The margin is generous (the machine is noisy and CI's more so): the
added TTFT p50 was 3.7-6.1 ms here in December 2026 (docs/benchmarks.md), 12 ms fails;
`gorgo bench overhead` gives the real figures."""

from __future__ import annotations

import asyncio

import pytest

from loadgen.bench.live import overhead as bench_overhead
from loadgen.client.stream import chat_body, percentile

pytestmark = pytest.mark.e2e

GUARD_ADDED_P50_MS = 12.0
REQUESTS = 80


def test_the_router_adds_at_most_a_few_milliseconds_to_the_first_token() -> None:
    stack, urls = bench_overhead.paired_stack("gorgo")
    try:
        body = chat_body(bench_overhead._prompt(1024), 1)
        asyncio.run(bench_overhead._alternate(urls, body, 10))
        pair = asyncio.run(bench_overhead._alternate(urls, body, REQUESTS))
    finally:
        stack.stop()
    e, g = bench_overhead._ttfts(pair.envoy), bench_overhead._ttfts(pair.gorgo)
    added = percentile(g, 50) - percentile(e, 50)
    print(f"Envoy alone p50 {percentile(e, 50):.2f} ms, Envoy + gorgo {percentile(g, 50):.2f} ms")
    assert all(r.backend for r in pair.gorgo)  # every request was routed, none failed open
    assert added <= GUARD_ADDED_P50_MS, f"the router adds {added:.2f} ms at p50"
