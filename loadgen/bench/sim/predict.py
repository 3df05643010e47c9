"""`gorgo bench predict`: which TTFT model should be the default? The profile against the
scheduler replay (`routing.ttft_model`), learning on (the default), on every fleet and load
of issue 53's matrix, in the simulator.

Per fleet (uniform, then loadgen/data/fleets/), window (the shared conversation trace's
three 20-minute windows, two paper-shaped ones, as `gorgo bench fleets`) and time_scale:
one gorgo run per model. Prints per cell the worst backend's TTFT and E2E MAPE (after
the first 20 % of requests) and p95 TTFT and E2E of each model, the ratios replay /
profile, then the worst MAPEs and the geometric means of the ratios over all cells.
`--request-max-tokens none`: the requests carry no `max_tokens`, the router learns the
output lengths. `--json` keeps every cell for docs/results.md.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from emulator.stack.fleet import NO_FLEET, load_fleet
from loadgen.bench.sim.fleets import FLEETS, FLEETS_DIR, WINDOWS, _trace
from loadgen.client.protocol import OPEN
from loadgen.progress import say, tracked
from loadgen.results import prediction_summary, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate

UNIFORM = "uniform"
ALL_FLEETS = (UNIFORM, *FLEETS)
TIME_SCALES = (2.0, 3.0, 4.0, 6.0)
MODELS = ("profile", "replay")


@dataclass(frozen=True)
class Run:
    fleet: str
    window: str
    time_scale: float
    model: str
    ttft_p95_ms: float
    e2e_p95_ms: float
    # the worst backend's MAPE (issue 53 bounds every backend's)
    ttft_worst_mape: float | None
    e2e_worst_mape: float | None


def _worst(by_backend: dict[str, Any]) -> float | None:
    mapes = [v["mape"] for v in by_backend.values() if v.get("mape") is not None]
    return max(mapes) if mapes else None


def _run(job: tuple[str, str, float, float, str, str]) -> Run:
    fleet_name, kind, at, ts, model, max_tokens = job
    fleet = NO_FLEET
    if fleet_name != UNIFORM:
        fleet = load_fleet(FLEETS_DIR / f"{fleet_name}.yaml", SimSettings().regions)
    settings = SimSettings(
        time_scale=ts,
        fleet=fleet,
        router={"routing": {"ttft_model": model}},
        protocol=replace(OPEN, request_max_tokens=max_tokens),
    )
    res = simulate(_trace(kind, at), settings)
    s: dict[str, Any] = {**summarize(res.requests), **prediction_summary(res.requests)}
    return Run(
        fleet_name,
        f"{kind} {at:g}",
        ts,
        model,
        s["ttft_ms"]["p95"],
        s["e2e_ms"]["p95"],
        _worst(s.get("ttft_prediction_by_backend") or {}),
        _worst(s.get("e2e_prediction_by_backend") or {}),
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(runs: Sequence[Run]) -> str:
    """One row per cell: MAPEs and p95s of profile / replay, their ratios; then a total."""
    at = {(r.fleet, r.window, r.time_scale, r.model): r for r in runs}
    lines = [
        "| fleet | window | ts | worst TTFT MAPE profile / replay | worst E2E MAPE profile / "
        "replay | p95 TTFT replay / profile | p95 E2E replay / profile |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: list[tuple[float, float]] = []
    for f, w, ts in dict.fromkeys((r.fleet, r.window, r.time_scale) for r in runs):
        p, q = at.get((f, w, ts, "profile")), at.get((f, w, ts, "replay"))
        if p is None or q is None:
            continue
        rt, re = q.ttft_p95_ms / p.ttft_p95_ms, q.e2e_p95_ms / p.e2e_p95_ms
        ratios.append((rt, re))
        lines.append(
            f"| {f} | {w} | {ts:g} | {_pct(p.ttft_worst_mape)} / {_pct(q.ttft_worst_mape)} | "
            f"{_pct(p.e2e_worst_mape)} / {_pct(q.e2e_worst_mape)} | {rt:.3f} | {re:.3f} |"
        )
    if ratios:
        for model in MODELS:
            mine = [r for r in runs if r.model == model]
            worst_t = max((r.ttft_worst_mape or 0.0 for r in mine), default=0.0)
            worst_e = max((r.e2e_worst_mape or 0.0 for r in mine), default=0.0)
            lines.append(f"\n{model}: worst backend TTFT MAPE {worst_t:.1%}, E2E {worst_e:.1%}")
        gt = math.exp(sum(math.log(t) for t, _ in ratios) / len(ratios))
        ge = math.exp(sum(math.log(e) for _, e in ratios) / len(ratios))
        lines.append(
            f"replay / profile over {len(ratios)} cells: p95 TTFT geomean {gt:.3f} "
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
) -> int:
    jobs = [
        (f, kind, at, ts, m, request_max_tokens)
        for f in fleets
        for kind, at in WINDOWS
        for ts in time_scales
        for m in MODELS
    ]
    print(f"bench predict: {len(jobs)} simulations...", file=sys.stderr)
    runs: list[Run] = []
    with ProcessPoolExecutor(workers) as pool:
        for i, r in enumerate(tracked(pool.map(_run, jobs), len(jobs), "bench predict"), 1):
            runs.append(r)
            say(f"  [{i}/{len(jobs)}] {r.fleet} {r.window} ts{r.time_scale:g} {r.model}")
    print(table(runs))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)
    return 0
