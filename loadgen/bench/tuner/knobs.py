"""`gorgo bench tuner --pd-knobs`: the tuner of a disaggregated fleet's two knobs
(estimate.transfer.PairKnobs: the local-prefill threshold and the remote margin) in the
simulator, against the best fixed pair a sweep finds (docs/tuner.md, "The P/D knobs").

- The sweep: gorgo on `gorgo simulate --pd` with every fixed pair of GRID, tuning off,
  scored by p95 TTFT on GRID_SEEDS; the best point measured again on EVAL_SEEDS, so its
  figure carries no winner's curse.
- The tuned runs: from each bad start (the knobs' two corners) and each of TUNE_SEEDS, the
  paired tuner moves the knobs online; the weights stay at the policy's (their own tuner
  frozen), so that the knobs alone move. Each run's final pair is measured fixed on
  EVAL_SEEDS, and must be within WITHIN of the best.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ext_proc.core.router import Router
from ext_proc.estimate.transfer import KNOB_BOUNDS
from loadgen.progress import bar
from loadgen.results import RequestResult, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.request import TraceRequest

# (local_threshold_tokens, remote_margin_ms): from no threshold to 32k tokens, from no
# margin to 10 s (the tuner's bounds, KNOB_BOUNDS, are the grid's corners).
GRID_THRESHOLDS = (KNOB_BOUNDS[0][0], 1000.0, 4000.0, 16000.0, KNOB_BOUNDS[0][1])
GRID_MARGINS = (KNOB_BOUNDS[1][0], 300.0, 3000.0, KNOB_BOUNDS[1][1])
# The bad starts: every remote prefill allowed, and none.
STARTS = ((KNOB_BOUNDS[0][0], KNOB_BOUNDS[1][0]), (KNOB_BOUNDS[0][1], KNOB_BOUNDS[1][1]))
GRID_SEEDS = (0,)
EVAL_SEEDS = (1,)
TUNE_SEEDS = (1, 2)
WITHIN = 0.10

Knobs = tuple[float, float]


@dataclass(frozen=True)
class KnobPoint:
    knobs: Knobs
    ttft_p95_ms: float
    e2e_p95_ms: float
    remote_share: float  # of the prefills sent apart


@dataclass(frozen=True)
class TunedRun:
    start: Knobs
    seed: int
    final: KnobPoint  # its last parent, measured fixed on EVAL_SEEDS
    steps: int
    accepted: int

    def ratio(self, best: KnobPoint) -> float:
        return self.final.ttft_p95_ms / best.ttft_p95_ms


@dataclass(frozen=True)
class KnobStudy:
    grid: list[KnobPoint]
    best: KnobPoint  # the grid's best, measured again on EVAL_SEEDS
    runs: list[TunedRun]

    def passed(self) -> bool:
        return all(r.ratio(self.best) <= 1 + WITHIN for r in self.runs)


def _with(base: SimSettings, knobs: Knobs, seed: int, tune: str = "off") -> SimSettings:
    gorgo = {"local_threshold_tokens": round(knobs[0]), "remote_margin_ms": knobs[1]}
    return replace(
        base, policy="gorgo", seed=seed, tune=tune, router={"policies": {"gorgo": gorgo}}
    )


def fixed(
    trace: Sequence[TraceRequest], base: SimSettings, knobs: Knobs, seeds: Sequence[int]
) -> KnobPoint:
    """The pair's figures, each the mean over the seeds."""
    ttft, e2e, share = [], [], []
    for seed in seeds:
        res = simulate(trace, _with(base, knobs, seed))
        s = summarize(res.requests)
        ttft.append(s["ttft_ms"]["p95"])
        e2e.append(s["e2e_ms"]["p95"])
        share.append(res.kv.as_json()["remote_share"] if res.kv is not None else 0.0)
    return KnobPoint(knobs, statistics.mean(ttft), statistics.mean(e2e), statistics.mean(share))


def _freeze_weights(_result: RequestResult, router: Router) -> None:
    if router.tuner is not None and not router.tuner.state.frozen:
        router.tuner.freeze()


def tuned(trace: Sequence[TraceRequest], base: SimSettings, start: Knobs, seed: int) -> Router:
    """One run with the knobs' tuner from `start`; the weights' tuner frozen at the policy's
    weights from the first completion on (the few requests before it split as usual)."""
    return simulate(trace, _with(base, start, seed, tune="paired"), hook=_freeze_weights).router


def study(trace: Sequence[TraceRequest], base: SimSettings) -> KnobStudy:
    grid_knobs = [(t, m) for t in GRID_THRESHOLDS for m in GRID_MARGINS]
    runs = len(grid_knobs) * len(GRID_SEEDS) + len(STARTS) * len(TUNE_SEEDS) * 2 + 1
    with bar(runs, "P/D knobs", unit="run") as done:
        grid = []
        for k in grid_knobs:
            grid.append(fixed(trace, base, k, GRID_SEEDS))
            done.update(len(GRID_SEEDS))
        top = min(grid, key=lambda p: p.ttft_p95_ms)
        best = fixed(trace, base, top.knobs, EVAL_SEEDS)
        done.update(1)
        out = []
        for start in STARTS:
            for seed in TUNE_SEEDS:
                t = tuned(trace, base, start, seed).pair_tuner
                if t is None:
                    raise RuntimeError("the simulated router has no P/D knob tuner")
                done.update(1)
                final = fixed(trace, base, t.state.parent, EVAL_SEEDS)
                done.update(1)
                accepted = sum(1 for s in t.state.history if s["accepted"])
                out.append(TunedRun(start, seed, final, len(t.state.history), accepted))
    return KnobStudy(grid, best, out)


def _k(knobs: Knobs) -> str:
    return f"{knobs[0]:.0f} tok, {knobs[1]:.0f} ms"


def report(s: KnobStudy, label: str) -> str:
    lines = [
        f"P/D knobs ({label}): the fixed sweep, p95 TTFT in s (seeds {list(GRID_SEEDS)}); "
        "rows local_threshold_tokens, columns remote_margin_ms",
        "",
        "| threshold \\ margin | " + " | ".join(f"{m:.0f}" for m in GRID_MARGINS) + " |",
        "|---" * (len(GRID_MARGINS) + 1) + "|",
    ]
    by = {p.knobs: p for p in s.grid}
    for t in GRID_THRESHOLDS:
        cells = [
            f"{by[(t, m)].ttft_p95_ms / 1e3:.2f} ({by[(t, m)].remote_share:.0%})"
            for m in GRID_MARGINS
        ]
        lines.append(f"| {t:.0f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Best fixed: {_k(s.best.knobs)}: p95 TTFT {s.best.ttft_p95_ms / 1e3:.2f} s, "
        f"E2E {s.best.e2e_p95_ms / 1e3:.2f} s on seeds {list(EVAL_SEEDS)}; the cells give "
        "the remote share of the prefills sent apart.",
        "",
        "| start | seed | final knobs | steps (accepted) | p95 TTFT (s) | vs best |",
        "|---|---|---|---|---|---|",
    ]
    for r in s.runs:
        ok = "PASS" if r.ratio(s.best) <= 1 + WITHIN else "FAIL"
        lines.append(
            f"| {_k(r.start)} | {r.seed} | {_k(r.final.knobs)} | {r.steps} ({r.accepted}) | "
            f"{r.final.ttft_p95_ms / 1e3:.2f} | {r.ratio(s.best):.3f} {ok} |"
        )
    return "\n".join(lines)


def run_knob_bench(trace: Sequence[TraceRequest], base: SimSettings, label: str) -> int:
    s = study(trace, base)
    print(report(s, label))
    if not s.passed():
        print(
            f"gorgo bench tuner --pd-knobs: a run ended over {WITHIN:.0%} from the best",
            file=sys.stderr,
        )
        return 1
    return 0


def as_json(s: KnobStudy) -> dict[str, Any]:
    return {
        "grid": [vars(p) for p in s.grid],
        "best": vars(s.best),
        "runs": [{**vars(r), "final": vars(r.final), "ratio": r.ratio(s.best)} for r in s.runs],
    }
