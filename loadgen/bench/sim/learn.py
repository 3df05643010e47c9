"""Does the learned speed cost anything on the fleet the profile was written for? `gorgo`
with `routing.learn_latency` on (the default) against off, in every cell of `gorgo bench
target` (uniform fleet, the shipped profile true for every engine), same seed, same run.

    gorgo bench learn [--jobs 2] [--seeds 0] [--out out/bench-learn.md]
                      [--ttft-model profile|replay]

Prints per cell the two p95 TTFTs and E2Es and their ratios (on / off), then how many
cells are within 1.05x and the worst; `--seeds 0 1 2` repeats every cell to show the
seed-to-seed spread, by which "within noise" is judged. `--ttft-model replay` compares the
scheduler replay with its step model fitted (on) against the profile's coefficients (off).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np

from loadgen.bench.sim.target import CONVERSATION, SYNTHETIC, Cell, cells_for, windows_for
from loadgen.progress import say, tracked
from loadgen.results import print_report, summarize
from loadgen.sim.simulate import simulate
from loadgen.traces.readers import CONVERSATION_TRACE

WITHIN = 1.05


def _run(cell: Cell, learn: bool, seed: int, ttft_model: str) -> tuple[float, float]:
    routing = {"learn_latency": learn, "ttft_model": ttft_model}
    s = replace(cell.settings("gorgo", seed), router={"routing": routing})
    res = simulate(cell.window.requests, s)
    summary = summarize(res.requests, res.itl_ms)
    return summary["ttft_ms"]["p95"], summary["e2e_ms"]["p95"]


def run_learn_bench(
    trace: str = CONVERSATION_TRACE,
    jobs: int = 1,
    seeds: Sequence[int] = (0,),
    out_path: str = "out/bench-learn.md",
    ttft_model: str = "profile",
) -> int:
    windows = windows_for([CONVERSATION, SYNTHETIC], trace, None, 1200.0)
    cells = cells_for(windows, ["network", "paper"], ["open", "paper"], None)
    runs = [(c, learn, seed) for c in cells for seed in seeds for learn in (True, False)]
    print(f"bench learn: {len(cells)} cells, {len(runs)} runs", file=sys.stderr, flush=True)
    out: dict[tuple[str, bool, int], tuple[float, float]] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_run, *r, ttft_model) for r in runs]
        done = tracked(zip(runs, futures, strict=True), len(runs), "bench learn")
        for i, (r, f) in enumerate(done, 1):
            out[(r[0].key, r[1], r[2])] = f.result()
            say(f"  [{i}/{len(runs)}] {r[0].key} learn={r[1]} seed={r[2]}")
    lines = [
        "| cell | seed | p95 TTFT on / off ms | ratio | p95 E2E on / off ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    ratios: list[tuple[float, float, str]] = []
    for c in cells:
        for seed in seeds:
            (t1, e1), (t0, e0) = out[(c.key, True, seed)], out[(c.key, False, seed)]
            ratios.append((t1 / t0, e1 / e0, f"{c.key} seed {seed}"))
            lines.append(
                f"| {c.key} | {seed} | {t1:,.0f} / {t0:,.0f} | {t1 / t0:.3f} "
                f"| {e1:,.0f} / {e0:,.0f} | {e1 / e0:.3f} |"
            )
    tt = np.array([r[0] for r in ratios])
    ee = np.array([r[1] for r in ratios])
    both = int(np.sum((tt <= WITHIN) & (ee <= WITHIN)))
    worst = max(ratios, key=lambda r: max(r[0], r[1]))
    lines += [
        "",
        f"within {WITHIN}x on both: {both} / {len(ratios)}; geometric mean ratio TTFT "
        f"{np.exp(np.mean(np.log(tt))):.3f}, E2E {np.exp(np.mean(np.log(ee))):.3f}; worst "
        f"{worst[2]}: TTFT {worst[0]:.3f}, E2E {worst[1]:.3f}",
    ]
    text = "\n".join(lines)
    print_report(text, out_path)
    return 0
