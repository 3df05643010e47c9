"""`gorgo bench path`: where one request's time goes in the router.

`gorgo bench overhead`'s stack (Envoy + gorgo in front of zero-delay engines, no WAN
links) runs, per prompt size (1k and 32k tokens, one request at a time, streamed):
- with the floor in the router's place (loadgen/bench/live/floor.py: the least a Python
  ext_proc service does behind the same Envoy config): the price of the streams the
  design opens per request, measured the same way;
- with `gorgo serve`, tracing off and then on (an OTLP endpoint set: its spans exported
  to a receiver the bench runs, the phase's CPU read once they have all arrived): the
  router process's CPU per request (psutil) and the TTFT added over Envoy alone;
- with `gorgo serve --profile` (cProfile, which slows everything alike; tracing off), to
  split the tracing-off CPU by step of the request's path: each step's share of the
  profiled busy time (the event loop's idle wait excluded) times that CPU.

What cProfile cannot see: gRPC's C core (HTTP/2 framing, the completion queue) runs
outside Python frames, and what it calls back into Python counts under "gRPC and
asyncio" (everything not in a named step); the span exporter's thread is not profiled
(tracing on minus off is its cost).
"""

from __future__ import annotations

import asyncio
import pstats
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from emulator.stack.ports import free_ports
from loadgen.bench.live import overhead as bench_overhead
from loadgen.bench.live.otlp_sink import OtlpSink
from loadgen.client.stream import chat_body, percentile

# (label, file suffix, function name, depth): the steps, outermost first. A step's time
# includes what it calls, so nested steps are shown indented beneath and not summed twice.
STEPS = (
    ("ext_proc stream: a message in, a reply out", "envoy/server.py", "process", 0),
    ("decode a message (protobuf -> phase)", "envoy/codec.py", "decode", 1),
    ("request headers", "envoy/sessions.py", "on_request_headers", 1),
    ("request body: read, decide, reply", "envoy/sessions.py", "on_request_body", 1),
    ("JSON body -> request", "prompt/parse.py", "parse_body", 2),
    ("the recipe: resolve, admit, schedule", "director/recipe.py", "handle", 2),
    ("decide", "core/router.py", "decide", 3),
    ("prompt -> prefix blocks", "core/features.py", "prompt_blocks", 4),
    ("candidates and their cost terms", "core/features.py", "candidates", 4),
    ("encode the decision", "envoy/encoders.py", "encode", 2),
    ("first response chunk (TTFT)", "envoy/session_base.py", "on_response_body", 1),
    # the loop's next turn after the reply (Telemetry.on_dispatch)
    (
        "telemetry: the dispatch recorded (metrics, span ids)",
        "service/telemetry/listener.py",
        "_record_dispatches",
        0,
    ),
    ("access log: completions read", "envoy/access_log.py", "stream_access_logs", 0),
    # called a moment later from the event loop (access_log.COMPLETION_GRACE_S)
    ("close: learners, telemetry", "core/lifecycle.py", "close", 0),
    ("learners (speed, prefix, tuner)", "core/learners.py", "on_close", 1),
    ("telemetry: metrics, the span built", "service/telemetry/listener.py", "on_close", 1),
    (
        "engine load reports (periodic scrapes)",
        "feeds/engine_metrics.py",
        "parse_engine_metrics",
        0,
    ),
)
IDLE = ("select.epoll", "poll")  # the event loop waiting: not the router's work
FLOOR_ARGV = (sys.executable, "-m", "loadgen.bench.live.floor")


@dataclass
class Plain:
    cpu_ms: float  # router process CPU per request
    added_p50_ms: float
    added_p99_ms: float


def plain(tokens: int, requests: int, otlp: bool = False, floor: bool = False) -> Plain:
    """One phase of `requests` at `tokens`: the router's CPU per request (spans exported
    first with `otlp`) and the TTFT added over Envoy alone; `floor`: the floor routes."""
    port = free_ports(1)[0] if otlp else 0
    stack, urls = bench_overhead.paired_stack(
        "gorgo",
        otlp_endpoint=f"127.0.0.1:{port}" if otlp else "",
        router_argv=FLOOR_ARGV if floor else (),
    )
    sink = None
    try:
        sink = OtlpSink(port) if otlp else None  # after the stack's processes forked
        body = chat_body(bench_overhead._prompt(tokens), 1)
        pid = stack.procs["gorgo-serve"].pid
        pair, cpu_ms = bench_overhead.cpu_phase(urls, body, requests, pid, sink)
    finally:
        stack.stop()
        if sink is not None:
            sink.stop()
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


def _row(label: str, p: Plain) -> str:
    return (
        f"  {label:<44} CPU {p.cpu_ms:6.3f} ms/request; TTFT added p50 "
        f"{p.added_p50_ms:5.2f} ms, p99 {p.added_p99_ms:5.2f} ms"
    )


def report(
    tokens: int, runs: dict[str, Plain], steps: dict[str, float], busy_s: float
) -> list[str]:
    p = runs["tracing off"]
    lines = [f"{tokens // 1024}k-token prompt:"]
    lines += [_row(label, r) for label, r in runs.items()]
    export = runs["tracing on"].cpu_ms - p.cpu_ms
    lines += [
        f"  span export (tracing on minus off): {export:.3f} ms/request",
        f"  tracing off, by step: {'share':>6} {'~us/request':>12}",
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
            runs: dict[str, Plain] = {}
            for label, otlp, floor in (
                ("floor (the same streams, nothing done)", False, True),
                ("tracing off", False, False),
                ("tracing on", True, False),
            ):
                print(f"  {tokens}-token prompts: {label}...", file=sys.stderr)
                runs[label] = plain(tokens, requests, otlp, floor)
            print(f"  {tokens}-token prompts: profiled run...", file=sys.stderr)
            stats = profiled(tokens, requests, Path(tmp) / f"router-{tokens}.prof")
            steps, busy = split(stats)
            lines += report(tokens, runs, steps, busy)
    print("\n".join(lines))
    return 0
