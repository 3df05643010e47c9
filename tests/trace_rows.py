"""Trace rows the loadgen tests replay and simulate."""

from __future__ import annotations

from loadgen.traces.request import TraceRequest


def rows(short: int, long: int = 0) -> list[TraceRequest]:
    """`short` 600-token prompts at 0 s, then `long` 30,000-token ones at 10 ms; 300
    tokens out; each its own session and blocks."""
    specs = [(600, 0.0)] * short + [(30_000, 0.01)] * long
    return [
        TraceRequest(i, t, n, 300, tuple(range(i * 100, i * 100 - (-n // 512))), 512, f"s{i}")
        for i, (n, t) in enumerate(specs)
    ]
