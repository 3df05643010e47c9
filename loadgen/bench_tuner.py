"""The tuner in the simulator: a grid of static weights, convergence of both tuner modes
against the grid's optimum, and the convergence plot (the paper's Figure 3).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ext_proc.cost import Weights
from ext_proc.router import Router
from ext_proc.tuner import PAIRED, PAPER, TunerSettings
from loadgen.results import RequestResult, summarize
from loadgen.simulate import SimSettings, simulate
from loadgen.traces import TraceRequest

GRID_N = 7
CHECKPOINTS = (200, 400, 800)
SEEDS = (0, 1, 2, 3, 4)
WITHIN = 0.05


@dataclass(frozen=True)
class GridPoint:
    rtt: float
    queue: float
    ttft_p95_ms: float
    e2e_p95_ms: float


def static_run(
    trace: Sequence[TraceRequest], ts: float, w: Weights, seed: int = 0
) -> dict[str, Any]:
    s = SimSettings(
        policy="gorgo",
        time_scale=ts,
        seed=seed,
        router={"policies": {"gorgo": {"weights": {"rtt": w.rtt, "queue": w.queue}}}},
    )
    res = simulate(trace, s)
    return summarize(res.requests, res.itl_ms)


def grid(trace: Sequence[TraceRequest], ts: float) -> list[GridPoint]:
    b = TunerSettings()
    rtts = np.geomspace(*b.rtt_bounds, GRID_N)
    queues = np.geomspace(*b.queue_bounds, GRID_N)
    out = []
    for r in rtts:
        for q in queues:
            s = static_run(trace, ts, Weights(float(r), float(q)))
            out.append(GridPoint(float(r), float(q), s["ttft_ms"]["p95"], s["e2e_ms"]["p95"]))
            print(
                f"  grid rtt {r:.3f} queue {q:.3f}: p95 TTFT {s['ttft_ms']['p95']:.0f}",
                file=sys.stderr,
            )
    return out


@dataclass
class Trajectory:
    mode: str
    seed: int
    # parent weights at each checkpoint (completed requests)
    at: dict[int, tuple[float, float]]
    history: list[dict[str, Any]]
    final: tuple[float, float]


def tune(trace: Sequence[TraceRequest], ts: float, mode: str, seed: int) -> Trajectory:
    at: dict[int, tuple[float, float]] = {}
    done = [0]

    def hook(res: RequestResult, router: Router) -> None:
        done[0] += 1
        if done[0] in CHECKPOINTS and router.tuner is not None:
            at[done[0]] = router.tuner.state.parent

    # paper mode runs as published: its rules and its bounds (w_queue <= 0.5)
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=ts, seed=seed, tune=mode), hook)
    assert res.router.tuner is not None
    return Trajectory(mode, seed, at, res.router.tuner.state.history, res.router.tuner.state.parent)


def convergence_figure(t: Trajectory, path: Path) -> None:
    convergence_plot(t.history, f"{t.mode} mode, seed {t.seed}", path)


def convergence_plot(h: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """Weights, sigma and the windowed p95 against completed requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["samples"] for s in h]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a1.plot(xs, [s["parent"][0] for s in h], label="w_rtt")
    a1.plot(xs, [s["parent"][1] for s in h], label="w_queue")
    a1.plot(xs, [s["sigma"] for s in h], label="sigma", linestyle=":")
    a1.set_yscale("log")
    a1.set_ylabel("weight / sigma")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(xs, [(s["parent_p95_ms"] or np.nan) / 1000 for s in h], label="parent p95 TTFT")
    a2.plot(
        xs, [(s["child_p95_ms"] or np.nan) / 1000 for s in h], label="child p95 TTFT", alpha=0.6
    )
    a2.set_ylabel("windowed p95 TTFT (s)")
    a2.set_xlabel("completed requests")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(f"Tuner convergence ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tuner_section(
    trace: Sequence[TraceRequest], ts: float, img_dir: Path, label: str
) -> tuple[str, Weights]:
    """Grid, both modes' convergence, the figure; returns markdown and the tuned weights."""
    print("tuner: 7x7 grid of static weights", file=sys.stderr)
    points = grid(trace, ts)
    best = min(points, key=lambda p: p.ttft_p95_ms)
    target = best.ttft_p95_ms * (1 + WITHIN)
    lines = [
        f"## Tuning the weights ({label}, time_scale {ts:g})\n",
        f"A {GRID_N}x{GRID_N} grid of static weights (log-spaced over the tuner's bounds) gives "
        f"the best static point w_rtt {best.rtt:.3f}, w_queue {best.queue:.3f}: p95 TTFT "
        f"{best.ttft_p95_ms:.0f} ms (p95 E2E {best.e2e_p95_ms:.0f} ms). Target for the "
        f"tuner: within {WITHIN:.0%} ({target:.0f} ms).\n",
        "| w_rtt \\ w_queue | "
        + " | ".join(f"{q:.3f}" for q in sorted({p.queue for p in points}))
        + " |",
        "|---|" + "---|" * GRID_N,
    ]
    for r in sorted({p.rtt for p in points}):
        row = [p for p in points if p.rtt == r]
        lines.append(
            f"| {r:.3f} | "
            + " | ".join(f"{p.ttft_p95_ms:.0f}" for p in sorted(row, key=lambda p: p.queue))
            + " |"
        )
    lines.append("")
    lines.append(
        "Convergence: each mode tunes online from w = (1, 1) on the same window; the parent "
        "weights it holds after N completed requests are then run static on the window; "
        "'ok' = p95 TTFT within 5 % of the grid optimum.\n"
    )
    lines.append(
        "| mode | seed | " + " | ".join(f"after {c}" for c in CHECKPOINTS) + " | final weights |"
    )
    lines.append("|---|---|" + "---|" * len(CHECKPOINTS) + "---|")
    reached: dict[str, list[int | None]] = {PAIRED: [], PAPER: []}
    figure_traj: Trajectory | None = None
    for mode in (PAIRED, PAPER):
        for seed in SEEDS:
            print(f"tuner: {mode} mode, seed {seed}", file=sys.stderr)
            t = tune(trace, ts, mode, seed)
            if mode == PAIRED and seed == 0:
                figure_traj = t
            cells, first_ok = [], None
            for c in CHECKPOINTS:
                w = t.at.get(c)
                if w is None:
                    cells.append("-")
                    continue
                p95 = static_run(trace, ts, Weights(*w))["ttft_ms"]["p95"]
                ok = p95 <= target
                if ok and first_ok is None:
                    first_ok = c
                cells.append(f"{p95:.0f}{' ok' if ok else ''}")
            reached[mode].append(first_ok)
            lines.append(
                f"| {mode} | {seed} | "
                + " | ".join(cells)
                + f" | ({t.final[0]:.3f}, {t.final[1]:.3f}) |"
            )
    for mode in (PAIRED, PAPER):
        n400 = sum(1 for r in reached[mode] if r is not None and r <= 400)
        lines.append(
            f"\n{mode}: within 5 % of the grid optimum by 400 completions in {n400} of "
            f"{len(SEEDS)} seeds."
        )
    assert figure_traj is not None
    img_dir.mkdir(parents=True, exist_ok=True)
    fig = img_dir / "results-tuner-convergence.png"
    convergence_figure(figure_traj, fig)
    lines.append("\n![Tuner convergence](img/results-tuner-convergence.png)\n")
    return "\n".join(lines), Weights(*figure_traj.final)


# -- a regime change: what the tuner is for ---------------------------------------------


@dataclass(frozen=True)
class RegimeChange:
    """Mid-run, the RTT to one region is multiplied by rtt_factor and the request rate by
    rate_factor (arrivals after at_s, trace time, come closer together)."""

    at_s: float
    region: str = "eu-frankfurt"
    rtt_factor: float = 3.0
    rate_factor: float = 1.5


def changed_trace(trace: Sequence[TraceRequest], change: RegimeChange) -> list[TraceRequest]:
    """The trace with its arrivals after the change compressed by rate_factor."""
    from dataclasses import replace

    at, f = change.at_s, change.rate_factor
    return [
        r if r.arrival_s < at else replace(r, arrival_s=at + (r.arrival_s - at) / f) for r in trace
    ]


@dataclass(frozen=True)
class RegimeRun:
    tune: str
    seed: int
    # p95 TTFT / E2E (ms) of the first `after` requests completed after the change
    ttft_p95_ms: float
    e2e_p95_ms: float
    final: tuple[float, float] | None


def regime_run(
    trace: Sequence[TraceRequest],
    ts: float,
    change: RegimeChange,
    tune: str,
    seed: int,
    after: int = 600,
) -> RegimeRun:
    """One run through the change, tuning online (`tune`) or with frozen defaults
    ("off"); scored on the first `after` completions of requests sent after it."""
    from emulator.wan import DelaySettings
    from loadgen.simulate import Simulation

    sim = Simulation(
        changed_trace(trace, change),
        SimSettings(policy="gorgo", time_scale=ts, seed=seed, tune=tune),
    )
    change_s = change.at_s * ts

    def apply() -> None:
        for (_door, backend), link in sim.links.items():
            if backend == change.region:
                s = link.settings
                link.settings = DelaySettings(
                    s.rtt_ms * change.rtt_factor, s.jitter_ms * change.rtt_factor
                )

    sim.at(change_s, apply)
    done: list[RequestResult] = []
    sent_after = {r.id for r in changed_trace(trace, change) if r.arrival_s >= change.at_s}

    def hook(res: RequestResult, _router: Router) -> None:
        if res.id in sent_after and len(done) < after:
            done.append(res)

    sim.hook = hook
    sim.run()
    s = summarize(done)
    tuner = sim.router.tuner
    return RegimeRun(
        tune,
        seed,
        float(s["ttft_ms"]["p95"]),
        float(s["e2e_ms"]["p95"]),
        None if tuner is None else tuner.state.parent,
    )


def false_accept_rate(
    samples: Sequence[tuple[float, float]],
    settings: TunerSettings,
    rounds: int = 2000,
    seed: int = 0,
) -> float:
    """Share of rounds in which the tuner accepts a child that cannot be better: both arms
    draw their (TTFT, E2E) samples from the same pool (pure noise; paper mode scores
    windows of the same pool against each other)."""
    import random as _random

    from ext_proc.tuner import Tuner

    rng = _random.Random(seed)
    tuner = Tuner(settings, Weights(1.0, 1.0), _random.Random(seed + 1))
    steps = accepted = i = 0
    while steps < rounds:
        rid = f"r{i}"
        i += 1
        tuner.weights_for(rid)
        ttft, e2e = rng.choice(samples)
        step = tuner.observe(rid, ttft, e2e)
        if step is not None:
            steps += 1
            accepted += step.accepted
            # keep exploring: a frozen tuner takes no more steps to count
            if tuner.state.frozen:
                tuner.unfreeze()
    return accepted / steps


def regime_section(
    trace: Sequence[TraceRequest], ts: float, change: RegimeChange, seeds: Sequence[int]
) -> str:
    """Markdown: the tuner against frozen defaults through a regime change, and the tuner's
    false-accept rate on pure noise."""
    lines = [
        f"## The tuner through a regime change (time_scale {ts:g})\n",
        f"At {change.at_s:g} s of trace time the RTT to {change.region} is multiplied by "
        f"{change.rtt_factor:g} and the request rate by {change.rate_factor:g}. Scored on "
        "the first 600 completions of requests sent after the change; `paired` tunes "
        "online from the defaults (from the start of the run), `off` keeps the defaults.\n",
        "| seed | frozen p95 TTFT | tuned p95 TTFT | tuned / frozen | frozen p95 E2E | "
        "tuned p95 E2E | tuned weights after |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        print(f"tuner: regime change, seed {seed}", file=sys.stderr)
        off = regime_run(trace, ts, change, "off", seed)
        on = regime_run(trace, ts, change, PAIRED, seed)
        w = "-" if on.final is None else f"({on.final[0]:.2f}, {on.final[1]:.2f})"
        lines.append(
            f"| {seed} | {off.ttft_p95_ms:.0f} | {on.ttft_p95_ms:.0f} | "
            f"{on.ttft_p95_ms / off.ttft_p95_ms:.2f} | {off.e2e_p95_ms:.0f} | "
            f"{on.e2e_p95_ms:.0f} | {w} |"
        )
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=ts))
    pool = [(r.ttft_ms, r.e2e_ms) for r in res.requests if r.ttft_ms and r.e2e_ms]
    lines += [
        "\nFalse accepts on pure noise (both arms drawn from the same pool of this window's "
        "(TTFT, E2E) pairs, 1,000 rounds): "
        + ", ".join(
            f"{name} {false_accept_rate(pool, s, 1000):.1%}"
            for name, s in (
                ("paired (confidence 0.8, E2E guard 5 %)", TunerSettings()),
                ("paper", TunerSettings.paper()),
            )
        )
        + ".\n"
    ]
    return "\n".join(lines)


def run_tuner_bench(trace_path: str, ts: float, at_s: float, seeds: Sequence[int]) -> int:
    from loadgen.traces import read_trace, window

    trace = window(read_trace(trace_path), 0, 1200)
    print(regime_section(trace, ts, RegimeChange(at_s), seeds))
    return 0
