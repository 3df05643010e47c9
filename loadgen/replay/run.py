"""`gorgo replay`: live, open-loop replay of a trace against an OpenAI endpoint.

Open loop on the trace's clock: request i is sent at start + arrival_i * time_scale,
whether or not earlier requests have finished. The one exception is the concurrency cap
(as in the GORGO paper's client): while `max_concurrency` requests are in flight, the next
one waits for a free slot, in arrival order, and how late it went out (its *slip*) is
recorded per request; TTFT and E2E start when it is sent. Slip also catches a client that
cannot keep up (a busy event loop). The client protocol (loadgen.client.protocol: the cap, forced
output lengths, long prompts dropped) is the same as `gorgo simulate`'s.

Here: the command's options, the run and its outputs (the result file of
`loadgen.results`' schema, the CSV, the `--plot` figure drawn by `loadgen.replay.plots`, the
table). The requests a trace row sends are `loadgen.replay.requests`'; the asyncio shell
that sends them (`replay`) is `loadgen.replay.loop`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loadgen.client.protocol import Protocol, protocol_for
from loadgen.client.stream import percentile
from loadgen.replay.loop import DEFAULT_MAX_CONCURRENCY, DEFAULT_TIMEOUT_S, ReplayRun, replay
from loadgen.replay.plots import plot_run
from loadgen.replay.requests import APIS
from loadgen.results import summarize, table, write_csv, write_result
from loadgen.traces.load import load_trace
from loadgen.traces.request import TraceError
from loadgen.traces.windows import scaled, window


def slip_summary(run: ReplayRun) -> dict[str, float | int | None]:
    slips = [s.slip_s * 1e3 for s in run.sent]
    return {
        "p50": round(percentile(slips, 50), 3) if slips else None,
        "p95": round(percentile(slips, 95), 3) if slips else None,
        "max": round(max(slips), 3) if slips else None,
        "throttled": sum(s.dispatch.throttled for s in run.sent),
    }


@dataclass(frozen=True)
class ReplayOptions:
    trace: str
    url: str
    api: str = "completions"
    time_scale: float = 1.0
    # The client protocol: a preset (loadgen.client.protocol), any value given here overriding
    # its own; no concurrency cap means DEFAULT_MAX_CONCURRENCY.
    protocol: str = "open"
    max_concurrency: int | None = None
    max_tokens: int | None = None
    max_input_tokens: int | None = None
    start_s: float = 0.0
    duration_s: float | None = None
    limit: int | None = None
    out: str | None = None
    csv: str | None = None
    plot: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress: bool = True

    def problems(self) -> list[str]:
        out = []
        if not self.url.startswith(("http://", "https://")):
            out.append(f"--url must start with http:// or https://, got {self.url!r}")
        if self.api not in APIS:
            out.append(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            out.append(f"--time-scale must be > 0, got {self.time_scale}")
        try:
            self.client_protocol()
        except ValueError as e:
            out.append(str(e))
        if not self.start_s >= 0:
            out.append(f"--start-s must be >= 0, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            out.append(f"--duration-s must be > 0, got {self.duration_s}")
        if self.limit is not None and self.limit < 1:
            out.append(f"--limit must be >= 1, got {self.limit}")
        if not self.timeout_s > 0:
            out.append(f"--timeout-s must be > 0, got {self.timeout_s}")
        return out

    def client_protocol(self) -> Protocol:
        return protocol_for(
            self.protocol,
            max_concurrency=self.max_concurrency,
            max_tokens=self.max_tokens,
            max_input_tokens=self.max_input_tokens,
        )


def run_replay(opts: ReplayOptions, stdout: TextIO | None = None) -> int:
    """`gorgo replay`. Exit codes: 0 done (some requests may have failed), 1 every request
    failed, 2 bad options or trace, 130 interrupted (partial results are still written)."""
    stdout = stdout or sys.stdout
    problems = opts.problems()
    if problems:
        print(f"gorgo replay: {'; '.join(problems)}", file=sys.stderr)
        return 2
    try:
        trace = load_trace(opts.trace)
    except TraceError as e:
        print(f"gorgo replay: {e}", file=sys.stderr)
        return 2
    chosen = window(trace, opts.start_s, opts.duration_s, opts.limit)
    if not chosen:
        print(
            f"gorgo replay: {opts.trace}: no requests in the window (start {opts.start_s} s, "
            f"duration {opts.duration_s} s)",
            file=sys.stderr,
        )
        return 2
    protocol = opts.client_protocol()
    kept, dropped = protocol.apply(chosen)
    if dropped:
        print(
            f"gorgo replay: dropped {dropped} of {len(chosen)} requests with prompts over "
            f"{protocol.max_input_tokens} tokens (--max-input-tokens)",
            file=sys.stderr,
        )
    if not kept:
        print("gorgo replay: every request in the window was dropped", file=sys.stderr)
        return 2
    max_concurrency = protocol.max_concurrency or DEFAULT_MAX_CONCURRENCY
    schedule = scaled(kept, opts.time_scale)

    async def main() -> ReplayRun:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            return await replay(
                schedule,
                opts.url.rstrip("/"),
                api=opts.api,
                max_concurrency=max_concurrency,
                timeout_s=opts.timeout_s,
                progress=sys.stderr if opts.progress else None,
                stop=stop,
            )
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    run = asyncio.run(main())
    results = run.results
    slip = slip_summary(run)
    meta = {
        "tool": "gorgo replay",
        "trace": str(opts.trace),
        "url": opts.url,
        "api": opts.api,
        "time_scale": opts.time_scale,
        "window": {"start_s": opts.start_s, "duration_s": opts.duration_s, "limit": opts.limit},
        "protocol": protocol.meta(),
        "dropped": dropped,
        "max_concurrency": max_concurrency,
        "started_at": run.started_at,
        "requests_planned": run.planned,
        "requests_sent": len(run.sent),
        "interrupted": run.interrupted,
        "slip_ms": slip,
        "wall_s": round(run.wall_s, 3),
    }
    if opts.out:
        write_result(opts.out, results, meta)
    if opts.csv:
        write_csv(opts.csv, results)
    label = f"{Path(opts.trace).name} x{opts.time_scale:g}"
    if opts.plot:
        plot_run(opts.plot, run, f"{label} -> {opts.url}")
    print(table([(label, summarize(results))]), file=stdout)
    print(
        f"slip p50 {slip['p50']} ms, p95 {slip['p95']} ms, max {slip['max']} ms; "
        f"{slip['throttled']} requests waited for a slot (max concurrency "
        f"{max_concurrency}); {dropped} dropped; {protocol.describe()}; "
        f"wall {run.wall_s:.1f} s",
        file=stdout,
    )
    if run.interrupted:
        print(
            f"gorgo replay: interrupted after {len(run.sent)}/{run.planned} requests",
            file=sys.stderr,
        )
        return 130
    failed = [r for r in results if r.status != "ok"]
    if results and len(failed) == len(results):
        print(
            f"gorgo replay: every request failed, e.g. {failed[0].error} (is {opts.url} up?)",
            file=sys.stderr,
        )
        return 1
    return 0
