"""`gorgo bench predict`: the router's prediction and routing as configured by default
against the defaults before the scheduler replay was (`routing.ttft_model: profile`, the
newcomer's decode not priced), learning on, on every fleet and load below,
in the simulator.

Per fleet (uniform, then loadgen/data/fleets/), window (the shared conversation trace's
three 20-minute windows, two paper-shaped ones, as `gorgo bench fleets`) and time_scale:
one gorgo run per arm. Prints per cell the worst backend's TTFT and E2E MAPE (after
the first 20 % of requests) and p95 TTFT and E2E of each arm, the ratios default /
before, then the worst MAPEs and the geometric means of the ratios over all cells.
`--default JSON`: router overrides for the default arm (to try a change before making it).
`--request-max-tokens none`: the requests carry no `max_tokens`, the router learns the
output lengths. `--json` keeps every cell for docs/results.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from statistics import geometric_mean
from typing import Any

from emulator.stack.fleet import NO_FLEET, load_fleet
from loadgen.bench.sim.fleets import FLEETS, FLEETS_DIR, WINDOWS, window_requests, worst_mape
from loadgen.client.protocol import OPEN
from loadgen.progress import say, tracked
from loadgen.results import prediction_summary, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate

UNIFORM = "uniform"
ALL_FLEETS = (UNIFORM, *FLEETS)
TIME_SCALES = (2.0, 3.0, 4.0, 6.0)
# The arms: the router's config overrides.
BEFORE: dict[str, Any] = {
    "routing": {"ttft_model": "profile"},
    "policies": {"gorgo": {"decode_weight": 0.0}},
}
ARMS = ("before", "default")


@dataclass(frozen=True)
class Run:
    fleet: str
    window: str
    time_scale: float
    arm: str
    ttft_p95_ms: float
    e2e_p95_ms: float
    # the worst backend's MAPE (the bound is on every backend's)
    ttft_worst_mape: float | None
    e2e_worst_mape: float | None


def _run(job: tuple[str, str, float, float, str, dict[str, Any], str]) -> Run:
    fleet_name, kind, at, ts, arm, router, max_tokens = job
    fleet = NO_FLEET
    if fleet_name != UNIFORM:
        fleet = load_fleet(FLEETS_DIR / f"{fleet_name}.yaml", SimSettings().regions)
    settings = SimSettings(
        time_scale=ts,
        fleet=fleet,
        router=router,
        protocol=replace(OPEN, request_max_tokens=max_tokens),
    )
    res = simulate(window_requests(kind, at), settings)
    s: dict[str, Any] = {**summarize(res.requests), **prediction_summary(res.requests)}
    return Run(
        fleet_name,
        f"{kind} {at:g}",
        ts,
        arm,
        s["ttft_ms"]["p95"],
        s["e2e_ms"]["p95"],
        worst_mape(s.get("ttft_prediction_by_backend") or {}),
        worst_mape(s.get("e2e_prediction_by_backend") or {}),
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(runs: Sequence[Run]) -> str:
    """One row per cell: MAPEs and p95s before / default, their ratios; then a total."""
    at = {(r.fleet, r.window, r.time_scale, r.arm): r for r in runs}
    lines = [
        "| fleet | window | ts | worst TTFT MAPE before / default | worst E2E MAPE before / "
        "default | p95 TTFT default / before | p95 E2E default / before |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: list[tuple[float, float]] = []
    for f, w, ts in dict.fromkeys((r.fleet, r.window, r.time_scale) for r in runs):
        p, q = at.get((f, w, ts, "before")), at.get((f, w, ts, "default"))
        if p is None or q is None:
            continue
        rt, re = q.ttft_p95_ms / p.ttft_p95_ms, q.e2e_p95_ms / p.e2e_p95_ms
        ratios.append((rt, re))
        lines.append(
            f"| {f} | {w} | {ts:g} | {_pct(p.ttft_worst_mape)} / {_pct(q.ttft_worst_mape)} | "
            f"{_pct(p.e2e_worst_mape)} / {_pct(q.e2e_worst_mape)} | {rt:.3f} | {re:.3f} |"
        )
    if ratios:
        for arm in ARMS:
            mine = [r for r in runs if r.arm == arm]
            worst_t = max((r.ttft_worst_mape or 0.0 for r in mine), default=0.0)
            worst_e = max((r.e2e_worst_mape or 0.0 for r in mine), default=0.0)
            lines.append(f"\n{arm}: worst backend TTFT MAPE {worst_t:.1%}, E2E {worst_e:.1%}")
        gt = geometric_mean(t for t, _ in ratios)
        ge = geometric_mean(e for _, e in ratios)
        lines.append(
            f"default / before over {len(ratios)} cells: p95 TTFT geomean {gt:.3f} "
            f"(worst {max(t for t, _ in ratios):.3f}), p95 E2E geomean {ge:.3f} "
            f"(worst {max(e for _, e in ratios):.3f})"
        )
    return "\n".join(lines)


def run_predict_bench(
    fleets: Sequence[str] = ALL_FLEETS,
    time_scales: Sequence[float] = TIME_SCALES,
    workers: int = 2,
    request_max_tokens: str = "output",
    json_path: str | None = None,
    default: dict[str, Any] | None = None,
    arms: Sequence[str] = ARMS,
) -> int:
    """`arms`: one of them alone writes its runs (to --json) for a table made later."""
    routers = {"before": BEFORE, "default": default or {}}
    jobs = [
        (f, kind, at, ts, arm, routers[arm], request_max_tokens)
        for f in fleets
        for kind, at in WINDOWS
        for ts in time_scales
        for arm in arms
    ]
    print(f"bench predict: {len(jobs)} simulations...", file=sys.stderr)
    runs: list[Run] = []
    with ProcessPoolExecutor(workers) as pool:
        for i, r in enumerate(tracked(pool.map(_run, jobs), len(jobs), "bench predict"), 1):
            runs.append(r)
            say(f"  [{i}/{len(jobs)}] {r.fleet} {r.window} ts{r.time_scale:g} {r.arm}")
    print(table(runs))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)
    return 0
