"""Cutting and stretching a trace: a window of it, its arrivals scaled or spread. Each
returns new rows (`TraceRequest`s are frozen)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace

from loadgen.traces.request import TraceRequest


def window(
    trace: Sequence[TraceRequest],
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s) (trace time), at most limit,
    with arrivals shifted so the window starts at 0."""
    out = [
        r
        for r in trace
        if r.arrival_s >= start_s and (duration_s is None or r.arrival_s < start_s + duration_s)
    ]
    if limit is not None:
        out = out[:limit]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in out]


def spread_arrivals(trace: Sequence[TraceRequest], seconds: float) -> list[TraceRequest]:
    """Spread each request's arrival over [t, t + seconds), deterministically (a crc32 of
    its id), in arrival order. The Mooncake conversation trace stamps arrivals in 3 s
    steps, ~10 requests at the very same instant: replayed as is, several routers decide
    each burst blind to one another, however fast they share (0: unchanged)."""
    if seconds <= 0:
        return list(trace)
    spread = [
        replace(r, arrival_s=r.arrival_s + seconds * zlib.crc32(r.id.encode()) / 2**32)
        for r in trace
    ]
    return sorted(spread, key=lambda r: r.arrival_s)


def scaled(trace: Sequence[TraceRequest], time_scale: float) -> list[TraceRequest]:
    """Stretch arrivals by time_scale (2 = half the rate), as the paper's client did."""
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in trace]
