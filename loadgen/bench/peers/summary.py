"""What `gorgo bench peers` keeps of a front's runs (FrontRun) and how the repeats reduce to
one summary (the shared result schema's, with the spread), the failures counted against
the 1 % bar, and gorgo's ratios against the best peer (per protocol with --pd)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from emulator.rivals.fronts import GORGO
from loadgen.results import RequestResult, summarize

# Figures of a SUMMARY whose repeats are reduced to a median and a spread.
SPREAD_KEYS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p95"),
    ("ttft_ms", "p99"),
    ("e2e_ms", "p50"),
    ("e2e_ms", "p95"),
    ("e2e_ms", "p99"),
)


@dataclass
class FrontRun:
    """One front door's run of the window: its results and what its processes cost."""

    front: str
    results: list[RequestResult]
    cpu_s: float
    peak_rss_mb: float
    wall_s: float
    # Requests each engine completed (which backends it used).
    spread: dict[str, int] = field(default_factory=dict)
    # What shows it read the engines' loads, for the report.
    evidence: str = ""
    # SMG's priority scheduler's non-zero series at the end (with --classes).
    scheduler: dict[str, float] = field(default_factory=dict)
    # With --pd: where its legs went (pd_legs).
    legs: dict[str, Any] = field(default_factory=dict)


def median_summary(runs: Sequence[FrontRun]) -> dict[str, Any]:
    """The shared result schema's SUMMARY over a front's repeats: the run with the median
    p95 TTFT as the base, its percentiles replaced by the repeats' medians, and their
    spread (min, max) beside them; plus the router's cost."""
    sums = [summarize(r.results) for r in runs]
    ranked = sorted(range(len(runs)), key=lambda i: sums[i]["ttft_ms"]["p95"] or 0.0)
    base: dict[str, Any] = json.loads(json.dumps(sums[ranked[len(ranked) // 2]]))
    spread: dict[str, dict[str, list[float]]] = {}
    for metric, q in SPREAD_KEYS:
        values = [s[metric][q] for s in sums if s[metric][q] is not None]
        if values:
            base[metric][q] = round(statistics.median(values), 3)
            spread.setdefault(metric, {})[q] = [min(values), max(values)]
    ok = sum(s["ok"] for s in sums)
    base["spread"] = spread
    base["runs"] = len(runs)
    base["errors_total"] = sum(s["errors"] for s in sums)
    base["requests_total"] = sum(s["requests"] for s in sums)
    base["router_cpu_ms_per_request"] = round(
        sum(r.cpu_s for r in runs) * 1e3 / max(1, sum(len(r.results) for r in runs)), 3
    )
    base["router_peak_rss_mb"] = round(max(r.peak_rss_mb for r in runs), 1)
    base["failures"] = dict(
        Counter(x.error[:120] for r in runs for x in r.results if x.status != "ok")
    )
    base["ok_total"] = ok
    return base


def failures(runs: Sequence[FrontRun], refusals_allowed: bool = False) -> int:
    """Requests that failed (with `refusals_allowed`, 429s are not counted)."""
    return sum(
        1
        for run in runs
        for r in run.results
        if r.status != "ok" and not (refusals_allowed and r.error.startswith("HTTP 429"))
    )


def pd_ratios(
    fronts: Mapping[str, Mapping[str, Any]], protocol: Mapping[str, str | None]
) -> dict[str, Any]:
    """With --pd: on each protocol, gorgo's p95 TTFT and E2E over the best rival's there
    (`ratios`); the headline figures are the largest of them (gorgo against the rival it
    beats least, each on its own protocol)."""
    by: dict[str, dict[str, Mapping[str, Any]]] = {}
    for key, s in fronts.items():
        p = protocol.get(key)
        if p is not None:
            by.setdefault(p, {})[GORGO if key.split("@")[0] == GORGO else key] = s
    per = {p: r for p, fs in sorted(by.items()) if (r := ratios(fs))}
    if not per:
        return {}
    out: dict[str, Any] = {k: max(r[k] for r in per.values()) for k in next(iter(per.values()))}
    out["by_protocol"] = per
    return out


def ratios(fronts: Mapping[str, Mapping[str, Any]], us: str = GORGO) -> dict[str, float]:
    """gorgo's p95 TTFT and E2E over the best rival's (the lowest of each)."""
    rivals = {k: v for k, v in fronts.items() if k != us}
    if us not in fronts or not rivals:
        return {}
    out = {}
    for metric in ("ttft_ms", "e2e_ms"):
        best = min(v[metric]["p95"] for v in rivals.values())
        out[f"{metric}_p95_vs_best_peer"] = round(fronts[us][metric]["p95"] / best, 3)
    return out
