"""`gorgo bench fleets`: the learned latency model on heterogeneous fleets, in the simulator,
against the shipped and the true profiles.

Per fleet (loadgen/data/fleets/), window (the shared conversation trace's three 20-minute
windows, two paper-shaped ones) and time_scale: gorgo, static weights, three routers on
the same engines: the shipped profile as a user configures it with learning off
("shipped"), the same with the per-backend speed learned online ("learned", the default),
and learning off but told each engine's true profile ("true", the reference). Prints a
markdown table of p95 TTFT and E2E, the ratios learned / true and learned / shipped, and
the learned router's worst per-backend TTFT MAPE (after the first 20 % of requests).
Runs in two worker processes; about 12 s a run here. `--ttft-model replay`: the three routers
use the scheduler replay (learned: its step model fitted online).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulator.stack.fleet import load_fleet
from loadgen.progress import tracked
from loadgen.results import prediction_summary, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.load import load_trace
from loadgen.traces.readers import CONVERSATION_TRACE
from loadgen.traces.request import TraceRequest
from loadgen.traces.synthetic import paper_synthetic
from loadgen.traces.windows import window

FLEETS_DIR = Path(__file__).resolve().parents[2] / "data" / "fleets"
FLEETS = ("fast-far", "slow-near", "mixed-gpus")
WINDOWS = (("trace", 0.0), ("trace", 1200.0), ("trace", 2400.0), ("paper", 1), ("paper", 2))
TIME_SCALES = (3.0, 4.0, 6.0)
WINDOW_S = 1200.0
ROUTERS = ("shipped", "learned", "true")


@dataclass(frozen=True)
class Cell:
    fleet: str
    window: str
    time_scale: float
    router: str
    ttft_p95_ms: float
    e2e_p95_ms: float
    # The worst backend's TTFT MAPE (the learned router's is what the issue bounds).
    worst_mape: float | None


def window_requests(kind: str, at: float) -> list[TraceRequest]:
    """One of WINDOWS' requests: a paper-shaped window's seed, or the trace from `at` s."""
    if kind == "paper":
        return list(paper_synthetic(int(at)))
    return window(load_trace(CONVERSATION_TRACE), at, WINDOW_S, None)


def _run(job: tuple[str, str, float, float, str, str]) -> Cell:
    fleet_name, kind, at, ts, router, ttft_model = job
    trace = window_requests(kind, at)
    routing: dict[str, Any] = {"ttft_model": ttft_model}
    if router != "learned":
        routing["learn_latency"] = False
    settings = SimSettings(
        time_scale=ts,
        fleet=load_fleet(FLEETS_DIR / f"{fleet_name}.yaml", SimSettings().regions),
        router_knows_fleet=router == "true",
        router={"routing": routing},
    )
    res = simulate(trace, settings)
    s: dict[str, Any] = {**summarize(res.requests), **prediction_summary(res.requests)}
    label = f"{kind} {at:g}"
    return Cell(
        fleet_name,
        label,
        ts,
        router,
        s["ttft_ms"]["p95"],
        s["e2e_ms"]["p95"],
        worst_mape(s.get("ttft_prediction_by_backend") or {}),
    )


def worst_mape(by_backend: dict[str, Any]) -> float | None:
    """The worst backend's MAPE in a summary's `*_prediction_by_backend` (None: none)."""
    mapes = [v["mape"] for v in by_backend.values() if v.get("mape") is not None]
    return max(mapes) if mapes else None


def table(cells: list[Cell]) -> str:
    rows = {(c.fleet, c.window, c.time_scale, c.router): c for c in cells}
    lines = [
        "| fleet | window | ts | p95 TTFT ms shipped / learned / true | p95 E2E ms shipped / "
        "learned / true | learned / true TTFT, E2E | learned / shipped TTFT, E2E | worst "
        "backend TTFT MAPE learned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f, w, ts in dict.fromkeys((c.fleet, c.window, c.time_scale) for c in cells):
        sh, le, tr = (rows.get((f, w, ts, r)) for r in ROUTERS)
        if sh is None or le is None or tr is None:
            continue
        lines.append(
            f"| {f} | {w} | {ts:g} | {sh.ttft_p95_ms:,.0f} / {le.ttft_p95_ms:,.0f} / "
            f"{tr.ttft_p95_ms:,.0f} | {sh.e2e_p95_ms:,.0f} / {le.e2e_p95_ms:,.0f} / "
            f"{tr.e2e_p95_ms:,.0f} | {le.ttft_p95_ms / tr.ttft_p95_ms:.2f}, "
            f"{le.e2e_p95_ms / tr.e2e_p95_ms:.2f} | {le.ttft_p95_ms / sh.ttft_p95_ms:.2f}, "
            f"{le.e2e_p95_ms / sh.e2e_p95_ms:.2f} | "
            + ("-" if le.worst_mape is None else f"{le.worst_mape:.1%}")
            + " |"
        )
    return "\n".join(lines)


def run_fleets_bench(
    fleets: Sequence[str] = FLEETS,
    time_scales: Sequence[float] = TIME_SCALES,
    workers: int = 2,
    ttft_model: str = "profile",
) -> int:
    jobs = [
        (f, kind, at, ts, r, ttft_model)
        for f in fleets
        for kind, at in WINDOWS
        for ts in time_scales
        for r in ROUTERS
    ]
    print(f"bench fleets: {len(jobs)} simulations...", file=sys.stderr)
    with ProcessPoolExecutor(workers) as pool:
        cells = list(tracked(pool.map(_run, jobs), len(jobs), "bench fleets"))
    print(table(cells))
    return 0
