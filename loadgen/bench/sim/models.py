"""`gorgo bench models`: many models in the simulator (routing by model).

The `two-models` trace (the Mooncake conversation trace, each conversation asking for
`alpha` or `beta`, loadgen/traces/models.py) on the fleet of loadgen/data/fleets/
two-models.yaml: us-ashburn serves both (beta a LoRA adapter on its alpha engine),
eu-frankfurt only alpha, ap-seoul only beta. `gorgo` and every baseline, each given only
the backends serving the request's model (the router core's candidate set; the simulator
tells the router what each engine serves as discovery would), on the conversation windows
of `gorgo bench target` at time_scale 3 and 4, `network` RTTs, the same seed.

    gorgo bench models [--windows 0 1200 2400] [--time-scales 3 4] [--workers 2]

Prints per cell each policy's p95 TTFT and p95 E2E (and any request refused or sent to a
backend not serving its model: none expected), then gorgo's ratios to the best baseline
(the lowest p95 of any baseline, each measure on its own) and whether it meets the target:
beats every baseline on p95 TTFT (ratio < 1) and is within 1.0x on p95 E2E.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from emulator.stack.fleet import load_fleet
from loadgen.bench.sim.policies import BASELINES
from loadgen.progress import say, tracked
from loadgen.results import print_report, summarize
from loadgen.sim.models import served_models
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.models import two_models
from loadgen.traces.readers import CONVERSATION_TRACE
from loadgen.traces.windows import window

FLEET = Path(__file__).resolve().parents[2] / "data" / "fleets" / "two-models.yaml"
POLICIES = ("gorgo", *BASELINES)
WINDOWS = (0.0, 1200.0, 2400.0)
WINDOW_S = 1200.0
TIME_SCALES = (3.0, 4.0)


@dataclass(frozen=True)
class Run:
    window_s: float
    time_scale: float
    policy: str
    requests: int
    ttft_p95_ms: float
    e2e_p95_ms: float
    refused: int
    # Requests sent to a backend whose engine does not serve their model.
    misrouted: int


def _run(job: tuple[str, float, float, str, int]) -> Run:
    trace_path, at, ts, policy, seed = job
    fleet = load_fleet(FLEET, SimSettings().regions)
    trace = window(two_models(trace_path), at, WINDOW_S)
    res = simulate(trace, SimSettings(policy=policy, time_scale=ts, seed=seed, fleet=fleet))
    s = summarize(res.requests, res.itl_ms)
    serves = {r: served_models(fleet, r) for r in res.settings.regions}
    misrouted = sum(
        1
        for req, out in zip(trace, res.requests, strict=True)
        if out.backend and req.model is not None and not serves[out.backend].serves(req.model)
    )
    return Run(
        at,
        ts,
        policy,
        len(trace),
        s["ttft_ms"]["p95"],
        s["e2e_ms"]["p95"],
        sum(res.refused.values()),
        misrouted,
    )


def report(runs: list[Run]) -> str:
    """Per cell: every policy's p95s, then gorgo against the best baseline."""
    cells = dict.fromkeys((r.window_s, r.time_scale) for r in runs)
    lines = [
        "| window | ts | policy | p95 TTFT ms | p95 E2E ms | refused | misrouted |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = [
        "| window | ts | gorgo p95 TTFT / best baseline | ratio | gorgo p95 E2E / best "
        "baseline | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    met = 0
    for at, ts in cells:
        by = {r.policy: r for r in runs if (r.window_s, r.time_scale) == (at, ts)}
        label = f"{at:g}-{at + WINDOW_S:g} s"
        for p in POLICIES:
            if (r := by.get(p)) is not None:
                lines.append(
                    f"| {label} | {ts:g} | {p} | {r.ttft_p95_ms:,.0f} | {r.e2e_p95_ms:,.0f} "
                    f"| {r.refused} | {r.misrouted} |"
                )
        base = [by[p] for p in BASELINES if p in by]
        g = by.get("gorgo")
        if g is None or not base:
            continue
        bt = min(base, key=lambda r: r.ttft_p95_ms)
        be = min(base, key=lambda r: r.e2e_p95_ms)
        rt, re_ = g.ttft_p95_ms / bt.ttft_p95_ms, g.e2e_p95_ms / be.e2e_p95_ms
        ok = rt < 1.0 and re_ <= 1.0
        met += ok
        summary.append(
            f"| {label} | {ts:g} | {g.ttft_p95_ms:,.0f} / {bt.ttft_p95_ms:,.0f} "
            f"({bt.policy}) | {rt:.2f} | {g.e2e_p95_ms:,.0f} / {be.e2e_p95_ms:,.0f} "
            f"({be.policy}) | {re_:.2f} | {'PASS' if ok else 'FAIL'} |"
        )
    total = len(summary) - 2
    return "\n".join(
        [*lines, "", *summary, "", f"target (TTFT < 1.0x, E2E <= 1.0x): {met} / {total} cells"]
    )


def run_models_bench(
    trace: str = CONVERSATION_TRACE,
    windows: Sequence[float] = WINDOWS,
    time_scales: Sequence[float] = TIME_SCALES,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    workers: int = 2,
    out_path: str = "out/bench-models.md",
) -> int:
    jobs = [(trace, at, ts, pol, seed) for at in windows for ts in time_scales for pol in policies]
    print(f"bench models: {len(jobs)} simulations...", file=sys.stderr, flush=True)
    runs: list[Run] = []
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for i, run in enumerate(tracked(pool.map(_run, jobs), len(jobs), "bench models"), 1):
            runs.append(run)
            say(
                f"  [{i}/{len(jobs)}] {run.window_s:g} ts {run.time_scale:g} {run.policy}: "
                f"p95 TTFT {run.ttft_p95_ms:,.0f} E2E {run.e2e_p95_ms:,.0f} ms"
            )
    text = report(runs)
    print_report(text, out_path)
    return 0
