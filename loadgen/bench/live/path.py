"""`gorgo bench path`: where one request's time goes in the router.

`gorgo bench overhead`'s stack (Envoy + gorgo in front of zero-delay engines, no WAN
links) runs twice: once plain, to measure the router process's CPU per request (from
/proc) and the TTFT Envoy + gorgo adds over Envoy alone; once with `gorgo serve --profile`
(cProfile, which slows everything alike), to split that CPU by step of the request's
path. Each step's share of the profiled busy time, times the plain CPU per request, is
its estimated cost. Prompts of 1k and 32k tokens, one request at a time, streamed.

What cProfile cannot see: gRPC's C core (HTTP/2 framing, the completion queue) runs
outside Python frames, and what it calls back into Python counts under "gRPC and
asyncio" (everything not in a named step, the event loop's idle wait excluded).
"""

from __future__ import annotations

import asyncio
import pstats
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadgen.bench.live import load as bench_load
from loadgen.bench.live import overhead as bench_overhead
from loadgen.client.stream import chat_body, percentile

# (label, file suffix, function name): the steps, outermost first. A step's time includes
# what it calls, so nested steps are shown indented beneath and not summed twice.
STEPS = (
    ("ext_proc stream: a message in, a reply out", "envoy/server.py", "process", 0),
    ("decode a message (protobuf -> phase)", "envoy/codec.py", "decode", 1),
    ("request headers", "envoy/sessions.py", "on_request_headers", 1),
    ("request body: read, decide, reply", "envoy/sessions.py", "on_request_body", 1),
    ("JSON body -> request", "prompt/parse.py", "parse_body", 2),
    ("the recipe: resolve, admit, schedule", "core/pipeline.py", "handle", 2),
    ("decide", "core/router.py", "decide", 3),
    ("prompt -> prefix blocks", "core/features.py", "prompt_blocks", 4),
    ("candidates and their cost terms", "core/features.py", "candidates", 4),
    ("telemetry: span and metrics", "service/telemetry/listener.py", "on_dispatch", 4),
    ("encode the decision", "envoy/encoders.py", "encode", 2),
    ("first response chunk (TTFT)", "envoy/sessions.py", "on_response_body", 1),
    ("access log: completions read", "envoy/access_log.py", "stream_access_logs", 0),
    # called a moment later from the event loop (access_log.COMPLETION_GRACE_S)
    ("close: learners, telemetry", "core/router.py", "close", 0),
    (
        "engine load reports (periodic scrapes)",
        "feeds/engine_metrics.py",
        "parse_engine_metrics",
        0,
    ),
)
IDLE = ("select.epoll", "poll")  # the event loop waiting: not the router's work


@dataclass
class Plain:
    cpu_ms: float  # router process CPU per request
    added_p50_ms: float
    added_p99_ms: float


def plain(tokens: int, requests: int) -> Plain:
    stack, urls = bench_overhead.paired_stack("gorgo")
    try:
        body = chat_body(bench_overhead._prompt(tokens), 1)
        asyncio.run(bench_overhead._alternate(urls, body, 10))
        pid = stack.procs["gorgo-serve"].pid
        cpu0 = bench_load.proc_cpu_s(pid)
        pair = asyncio.run(bench_overhead._alternate(urls, body, requests))
        cpu_ms = (bench_load.proc_cpu_s(pid) - cpu0) * 1e3 / requests
    finally:
        stack.stop()
    e, g = bench_overhead._ttfts(pair.envoy), bench_overhead._ttfts(pair.gorgo)
    return Plain(
        cpu_ms,
        percentile(g, 50) - percentile(e, 50),
        percentile(g, 99) - percentile(e, 99),
    )


def profiled(tokens: int, requests: int, out: Path) -> pstats.Stats:
    stack, urls = bench_overhead.paired_stack("gorgo", ("--profile", str(out)))
    try:
        body = chat_body(bench_overhead._prompt(tokens), 1)
        asyncio.run(bench_overhead._alternate(urls, body, requests))
        router = stack.procs["gorgo-serve"]
        router.terminate()  # SIGTERM: the router stops and writes its profile
        router.wait(30)
    finally:
        stack.stop()
    return pstats.Stats(str(out))


def split(stats: pstats.Stats) -> tuple[dict[str, float], float]:
    """Each step's cumulative seconds, and the profile's busy seconds (idle excluded)."""
    raw = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in raw.values())
    idle = sum(
        tt for (_, _, name), (_, _, tt, _, _) in raw.items() if IDLE[0] in name and IDLE[1] in name
    )
    steps = {}
    for label, suffix, func, _ in STEPS:
        steps[label] = sum(
            ct
            for (file, _, name), (_, _, _, ct, _) in raw.items()
            if file.endswith(suffix) and name == func
        )
    return steps, total - idle


def report(tokens: int, p: Plain, steps: dict[str, float], busy_s: float) -> list[str]:
    lines = [
        f"{tokens // 1024}k-token prompt: router CPU {p.cpu_ms:.3f} ms per request; TTFT added "
        f"over Envoy alone p50 {p.added_p50_ms:.2f} ms, p99 {p.added_p99_ms:.2f} ms",
        f"  {'step':<52} {'share':>6} {'~us/request':>12}",
    ]
    top = 0.0
    for label, _, _, depth in STEPS:
        share = steps[label] / busy_s if busy_s else 0.0
        if depth == 0:
            top += share
        lines.append(f"  {'  ' * depth + label:<52} {share:>6.1%} {share * p.cpu_ms * 1e3:>12.0f}")
    rest = max(0.0, 1.0 - top)
    lines.append(
        f"  {'gRPC and asyncio (the rest of the busy time)':<52} {rest:>6.1%} "
        f"{rest * p.cpu_ms * 1e3:>12.0f}"
    )
    return lines


def run_path_bench(requests: int = 300) -> int:
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gorgo-path-") as tmp:
        for tokens in (1024, 32768):
            print(f"  {tokens}-token prompts: plain run...", file=sys.stderr)
            p = plain(tokens, requests)
            print(f"  {tokens}-token prompts: profiled run...", file=sys.stderr)
            stats = profiled(tokens, requests, Path(tmp) / f"router-{tokens}.prof")
            steps, busy = split(stats)
            lines += report(tokens, p, steps, busy)
    print("\n".join(lines))
    return 0
