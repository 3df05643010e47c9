"""The tuner bench's report: the markdown of loadgen.bench.tuner.study's and
loadgen.bench.tuner.regime's studies, the convergence figure (the paper's Figure 3, drawn by
loadgen.sim.figures), and the sections `make bench` and `gorgo bench tuner` print."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ext_proc.learn.settings import TunerSettings
from ext_proc.vocab.types import Weights
from loadgen.bench.tuner.regime import (
    PAPER_REGIME_VENUES,
    REGIME_TARGET,
    RegimeChange,
    RegimeStudy,
    regime_study,
)
from loadgen.bench.tuner.study import (
    CHECKPOINTS,
    EVAL_SEEDS,
    GRID_SEEDS,
    OPEN_LOOP,
    PAPER_WINDOW_TS,
    RESOLUTION_ARMS,
    SEEDS,
    STARTS,
    WITHIN,
    GridPoint,
    Resolution,
    Trajectory,
    TunerStudy,
    tuner_study,
)
from loadgen.client.protocol import PAPER
from loadgen.sim.figures import convergence_plot
from loadgen.sim.settings import SimSettings
from loadgen.traces.request import TraceRequest


def convergence_figure(t: Trajectory, path: Path) -> None:
    convergence_plot(t.history, f"{t.mode} mode, seed {t.seed}", path)


def _grid_table(points: Sequence[GridPoint], value: str) -> list[str]:
    qs = sorted({p.queue for p in points})
    lines = [
        "| w_rtt \\ w_queue | " + " | ".join(f"{q:.3g}" for q in qs) + " |",
        "|---|" + "---|" * len(qs),
    ]
    for r in sorted({p.rtt for p in points}):
        row = sorted((p for p in points if p.rtt == r), key=lambda p: p.queue)
        lines.append(f"| {r:.3g} | " + " | ".join(f"{getattr(p, value):.0f}" for p in row) + " |")
    return [*lines, ""]


def tuner_markdown(s: TunerStudy, figure: str) -> str:
    """The grid, the optimum, the resolution (if measured) and the convergence table."""
    b = TunerSettings()
    paper = TunerSettings.paper()
    prhi, pqhi = paper.rtt_bounds[1], paper.queue_bounds[1]
    best, best_eval, defaults, corner = s.best, s.best_eval, s.defaults, s.corner
    seeds_txt = ", ".join(map(str, s.grid_seeds))
    eval_txt = ", ".join(map(str, s.eval_seeds))
    lines = [
        f"## Tuning the weights ({s.label}, time_scale {s.ts:g})\n",
        f"Bounds w_rtt [{b.rtt_bounds[0]:g}, {b.rtt_bounds[1]:g}], w_queue "
        f"[{b.queue_bounds[0]:g}, {b.queue_bounds[1]:g}] (docs/tuner.md says why). Each cell is "
        f"the mean p95 TTFT (ms) of {len(s.grid_seeds)} run(s) (simulator seeds {seeds_txt}) of "
        f"static weights, log-spaced over the bounds:\n",
        *_grid_table(s.points, "ttft_p95_ms"),
        "Mean p95 E2E (ms) of the same runs:\n",
        *_grid_table(s.points, "e2e_p95_ms"),
        f"Grid optimum: w_rtt {best.rtt:.3g}, w_queue {best.queue:.3g} (mean p95 TTFT "
        f"{best.ttft_p95_ms:.0f} ms on the grid's seeds). Measured again on fresh seeds "
        f"({eval_txt}): p95 TTFT {best_eval.ttft_p95_ms:.0f} ms, p95 E2E "
        f"{best_eval.e2e_p95_ms:.0f} ms; the target, within {WITHIN:.0%}: {s.target_ms:.0f} ms. "
        f"The defaults (1, 1) on the same seeds: {defaults.ttft_p95_ms:.0f} ms "
        f"({defaults.ttft_p95_ms / best_eval.ttft_p95_ms:.2f} x the optimum), p95 E2E "
        f"{defaults.e2e_p95_ms:.0f} ms.",
    ]
    if s.best_paper is not None:
        gap = s.best_paper.ttft_p95_ms / best.ttft_p95_ms
        lines.append(
            f" The best grid point inside the paper's bounds (w_rtt <= {prhi:g}, w_queue <= "
            f"{pqhi:g}) has {s.best_paper.ttft_p95_ms:.0f} ms on the grid's seeds ({gap:.2f} x "
            "the optimum's)"
            + (": the paper's mode cannot reach the target." if gap > 1 + WITHIN else ".")
            + " The convergence runs are the paired mode's."
        )
    if s.resolution is not None:
        lines += ["\n", resolution_markdown(s.resolution).rstrip()]
    lines += [
        "\n",
        "Convergence: the paired tuner (config defaults) tunes online on this window from a "
        f"start; the parent it holds after N completed requests is then run static on the "
        f"fresh seeds ({eval_txt}); cells: the weights, their mean p95 TTFT / the optimum's "
        f"on those seeds, 'ok' when within {WITHIN:.0%}. The worst corner of the grid is "
        f"w = ({corner.rtt:.3g}, {corner.queue:.3g}).\n",
        "| start | seed | " + " | ".join(f"after {c}" for c in CHECKPOINTS) + " | end of window |",
        "|---|---|" + "---|" * len(CHECKPOINTS) + "---|",
    ]
    for run in s.runs:
        cells = [
            "-"
            if c is None
            else f"({c.weights[0]:.3g}, {c.weights[1]:.3g}) {c.ratio:.2f}{' ok' if c.ok else ''}"
            for c in run.at
        ]
        lines.append(
            f"| {run.start} | {run.seed} | "
            + " | ".join(cells)
            + f" | ({run.final[0]:.3g}, {run.final[1]:.3g}) |"
        )
    lines.append("")
    for name in STARTS:
        counts = ", ".join(f"{n} by {c}" for n, c in zip(s.reached(name), CHECKPOINTS, strict=True))
        lines.append(
            f"From the {name}: within {WITHIN:.0%} of the grid optimum in {counts} "
            f"(of {len(SEEDS)} seeds).\n"
        )
    lines.append(f"![Tuner convergence](img/{figure})\n")
    return "\n".join(lines)


def tuner_section(
    trace: Sequence[TraceRequest],
    ts: float,
    img_dir: Path,
    label: str,
    base: SimSettings = OPEN_LOOP,
    grid_seeds: Sequence[int] = GRID_SEEDS,
    eval_seeds: Sequence[int] = EVAL_SEEDS,
    figure: str = "results-tuner-convergence.png",
    resolution: bool = False,
) -> tuple[str, Weights]:
    """tuner_study, its figure and its markdown; returns the markdown and the weights
    tuned from the defaults (seed 0)."""
    s = tuner_study(trace, ts, label, base, grid_seeds, eval_seeds, resolution)
    img_dir.mkdir(parents=True, exist_ok=True)
    convergence_figure(s.figure, img_dir / figure)
    return tuner_markdown(s, figure), s.tuned


def resolution_markdown(r: Resolution) -> str:
    best = r.best
    lines = [
        "What a paired comparison can tell apart on this window: the grid optimum "
        f"({best.rtt:.3g}, {best.queue:.3g}) and each grid point within {r.ceiling:g} x its "
        f"p95 TTFT, each run static (seed {r.seed}); a draw takes 2n consecutive arrivals, "
        "splits them at random into two arms of n, gives one arm the "
        "optimum's TTFTs and the other the point's, and compares the arms' p95 (2,000 "
        "draws). Cells: how often the point is ranked better. Kinder than the tuner's "
        "rounds, where the arms share one fleet.\n",
        "| w | its p95 / the optimum's (whole run) | "
        + " | ".join(f"ranked better, n = {n}" for n in RESOLUTION_ARMS)
        + " |",
        "|---|---|" + "---|" * len(RESOLUTION_ARMS),
    ]
    for row in r.rows:
        p, cells = row.point, " | ".join(f"{x:.2f}" for x in row.misranked)
        lines.append(f"| ({p.rtt:.3g}, {p.queue:.3g}) | {row.ratio:.3f} | {cells} |")
    return "\n".join([*lines, ""])


def paper_tuner_section(img_dir: Path) -> str:
    """The grid, the resolution table and the convergence runs on the paper-shaped tuning
    window (`paper-synthetic:0`, the paper's protocol, time_scale 1): markdown (~13 min,
    3 of them the resolution table)."""
    from loadgen.traces.synthetic import paper_synthetic

    md, _ = tuner_section(
        paper_synthetic(0),
        PAPER_WINDOW_TS,
        img_dir,
        "the paper-shaped tuning window paper-synthetic:0, the paper's protocol",
        base=SimSettings(protocol=PAPER),
        grid_seeds=(0,),
        eval_seeds=(10, 11),
        figure="results-paper-window-convergence.png",
        resolution=True,
    )
    return md


def regime_markdown(s: RegimeStudy, label: str = "") -> str:
    """The tuned and frozen runs per seed, the room (if measured) and the false accepts
    (if measured)."""
    v, change, ts = s.venue, s.change, s.ts
    d0 = v.defaults
    lines = [
        f"## The tuner through a regime change ({label or f'time_scale {ts:g}'})\n",
        f"Policy `{v.policy}`, defaults ({d0[0]:g}, {d0[1]:g}). At {change.at_s:g} s of "
        f"trace time the RTT to {change.region} is multiplied by {change.rtt_factor:g} and "
        f"the request rate by {change.rate_factor:g}. Scored on the first 600 completions of "
        "requests sent after the change; `paired` tunes online from the defaults (from the "
        "start of the run, config defaults), `off` keeps the defaults. Target: tuned / "
        f"frozen <= {REGIME_TARGET:.2f} with p95 E2E no worse.\n",
        "| seed | frozen p95 TTFT | tuned p95 TTFT | tuned / frozen | frozen p95 E2E | "
        "tuned p95 E2E | tuned weights at the change | after the 600 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s.seeds:
        off, on = r.off, r.on
        lines.append(
            f"| {r.seed} | {off.ttft_p95_ms:.0f} | {on.ttft_p95_ms:.0f} | {r.ratio:.2f}"
            f"{' ok' if r.ok else ''} | {off.e2e_p95_ms:.0f} | {on.e2e_p95_ms:.0f} | "
            f"({on.at_change[0]:.3g}, {on.at_change[1]:.3g}) | "
            f"({on.final[0]:.3g}, {on.final[1]:.3g}) |"
        )
    lines.append(
        f"\nTarget met in {s.met} of {len(s.seeds)} seeds; tuned / frozen p95 TTFT, mean "
        f"{np.mean(s.ratios):.2f}, median {np.median(s.ratios):.2f}.\n"
    )
    if s.room:
        best, d = s.room_best, s.room_defaults
        lines += [
            "Static weights through the same change (the whole run; mean p95 TTFT of the "
            f"first 600 after it over seeds {', '.join(map(str, s.room_seeds))}):\n",
            *_grid_table(s.room, "ttft_p95_ms"),
            f"The best of them, w = ({best.rtt:g}, {best.queue:g}): {best.ttft_p95_ms:.0f} ms "
            f"(p95 E2E {best.e2e_p95_ms:.0f} ms) against the defaults' {d.ttft_p95_ms:.0f} ms "
            f"(p95 E2E {d.e2e_p95_ms:.0f} ms): {best.ttft_p95_ms / d.ttft_p95_ms:.2f} x, the "
            "room a tuner has.\n",
        ]
    if s.false_accept_paired is None or s.false_accept_paper is None:
        return "\n".join(lines)
    cfg = TunerSettings()
    lines += [
        "False accepts on pure noise (both arms drawn from the same pool of this window's "
        "(TTFT, E2E) pairs, 1,000 rounds): "
        + ", ".join(
            f"{name} {rate:.1%}"
            for name, rate in (
                (
                    f"paired (arm {cfg.arm_size}, {cfg.score} score, confidence "
                    f"{cfg.confidence:g}, E2E guard {cfg.e2e_guard:.0%})",
                    s.false_accept_paired,
                ),
                ("paper", s.false_accept_paper),
            )
        )
        + ".\n"
    ]
    return "\n".join(lines)


def regime_section(*args: Any, label: str = "", **kwargs: Any) -> str:
    """Markdown of regime_study(*args, **kwargs)."""
    return regime_markdown(regime_study(*args, **kwargs), label)


def paper_regime_sections(seeds: Sequence[int] = SEEDS) -> str:
    """The regime change on `paper-synthetic:0` (change at 600 s of its 30 minutes) under
    the paper's protocol, for each cost form: markdown (~2 min on 2 cores)."""
    from loadgen.traces.synthetic import paper_synthetic

    trace = paper_synthetic(0)
    return "\n".join(
        regime_section(
            trace,
            PAPER_WINDOW_TS,
            RegimeChange(at_s=600.0),
            seeds,
            venue=v,
            label=f"`{v.policy}`, paper-synthetic:0, the paper's protocol, `paper` RTT profile",
            false_accepts=False,
        )
        for v in PAPER_REGIME_VENUES
    )


def run_tuner_bench(
    trace_path: str,
    ts: float,
    at_s: float,
    seeds: Sequence[int],
    convergence: bool = False,
    paper_regime: bool = False,
) -> int:
    """The tuner's three targets, per seed with pass/fail (loadgen.bench.tuner.targets,
    ~10 min on 2 cores); with `convergence`, then the grid and the convergence runs on the
    paper-shaped tuning window and on the trace's tuning window (first 10 minutes at
    time_scale 3), as `make bench`, and the trace's regime change with its room and the
    false accepts (~50 min more); with `paper_regime`, then the regime change on the
    paper-shaped window under the paper's protocol (~2 min more)."""
    from loadgen.bench.tuner.targets import run_targets
    from loadgen.traces.readers import read_trace
    from loadgen.traces.windows import window

    print(run_targets(seeds), flush=True)
    if convergence:
        trace = read_trace(trace_path)
        img = Path("out/bench-tuner")
        print(paper_tuner_section(img))
        md, _ = tuner_section(window(trace, 0, 600), 3.0, img, "first 10 minutes")
        print(md)
        print(regime_section(window(trace, 0, 1200), ts, RegimeChange(at_s), seeds))
    if paper_regime:
        print(paper_regime_sections(seeds))
    return 0
