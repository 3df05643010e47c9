"""The paper's experiment under the paper's protocol, the first part of `gorgo bench
results` (docs/results.md): its Table 2 (a tuning window tuned online, two held-out windows
with the weights frozen) and Table 3 (a load sweep) on the paper-shaped workload, measured
into a PaperStudy (`paper_study`), and rendered with the paper's published rows beside ours
(`paper_markdown`) and its Figure 3, the tuner's convergence (`paper_section`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ext_proc.vocab.types import Weights
from loadgen.progress import bar, counter
from loadgen.results import summarize
from loadgen.sim.figures import convergence_plot
from loadgen.sim.run import run_simulations
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate

# The GORGO paper's Table 2 and Table 3, p95 TTFT (ms) / p95 E2E (s).
PAPER_TABLE2: dict[tuple[str, float], dict[str, tuple[float, float]]] = {
    ("tuning", 1.0): {
        "gorgo": (2514, 8.91),
        "session_affinity": (2428, 18.27),
        "least_load": (2447, 13.69),
        "least_request": (3970, 16.62),
        "prefix_cache": (6784, 22.63),
    },
    ("held-out", 2.0): {
        "gorgo": (1584, 3.28),
        "session_affinity": (1875, 4.75),
        "least_load": (1818, 4.06),
        "least_request": (1852, 3.99),
        "prefix_cache": (1798, 4.95),
    },
    ("held-out", 3.0): {
        "gorgo": (1417, 3.36),
        "session_affinity": (1522, 3.92),
        "least_load": (1669, 4.07),
        "least_request": (1759, 4.44),
        "prefix_cache": (1861, 12.00),
    },
}
PAPER_TABLE3: dict[float, dict[str, tuple[float, float]]] = {
    1.0: {
        "gorgo": (8260, 15.76),
        "session_affinity": (1835, 17.94),
        "least_request": (6138, 18.62),
    },
    2.0: {"gorgo": (1822, 5.65), "session_affinity": (1707, 15.50), "least_request": (4361, 16.85)},
    3.0: {"gorgo": (1378, 3.25), "session_affinity": (1556, 4.04), "least_request": (1805, 4.92)},
}
# Windows of the paper-shaped workload (loadgen.traces.paper_synthetic): a seed each, as
# the paper's were different days.
PAPER_WINDOWS = (("tuning", 0, 1.0), ("held-out", 1, 2.0), ("held-out", 2, 3.0))
TABLE3_SEED = 1


SWEEP_POLICIES = ("gorgo", "session_affinity", "least_request")
FIGURE = "img/results-paper-convergence.png"


@dataclass(frozen=True)
class PaperCell:
    """One policy's row of a Table 2 window: ours, and the paper's where it has the row.
    p95 TTFT in ms, p95 E2E in s, as the paper's tables."""

    policy: str
    ttft_p95_ms: float
    e2e_p95_s: float
    slip_p95_ms: float
    paper: tuple[float, float] | None


@dataclass(frozen=True)
class PaperWindow:
    name: str  # "tuning" or "held-out"
    seed: int
    time_scale: float
    cells: tuple[PaperCell, ...]


@dataclass(frozen=True)
class SweepRow:
    """One time_scale of Table 3: per policy, (p95 TTFT ms, p95 E2E s), ours and the
    paper's."""

    time_scale: float
    ours: dict[str, tuple[float, float]]
    paper: dict[str, tuple[float, float]]


@dataclass(frozen=True)
class PaperStudy:
    """Table 2's windows, the weights tuned online on the tuning window (None: it did not
    run) and the tuner's history there, and Table 3's rows."""

    windows: tuple[PaperWindow, ...]
    tuned: Weights | None
    history: tuple[dict[str, Any], ...]
    sweep: tuple[SweepRow, ...]


def _p95s(s: dict[str, Any]) -> tuple[float, float]:
    return s["ttft_ms"]["p95"], s["e2e_ms"]["p95"] / 1000


def _window(
    name: str, seed: int, ts: float, summaries: dict[tuple[str, float], dict[str, Any]]
) -> PaperWindow:
    """A window's rows. The paper's GORGO row was tuned online on its tuning window, frozen
    after: it stands beside ours tuned the same way."""
    paper = dict(PAPER_TABLE2.get((name, ts), {}))
    ours_gorgo = "gorgo (tuning online)" if name == "tuning" else "gorgo (tuned, frozen)"
    paper[ours_gorgo] = paper.pop("gorgo", (float("nan"), float("nan")))
    cells = tuple(
        PaperCell(policy, *_p95s(s), s["slip_ms"]["p95"], paper.get(policy))
        for (policy, _), s in summaries.items()
    )
    return PaperWindow(name, seed, ts, cells)


def paper_study(policies: Sequence[str], work_dir: Path) -> PaperStudy:
    """Table 2's windows (every policy; GORGO tuned online on the tuning window, then
    frozen on the held-out ones) and Table 3's sweep, under the paper's protocol."""
    from loadgen.client.protocol import PAPER
    from loadgen.traces.synthetic import paper_synthetic

    base = SimSettings(protocol=PAPER)
    tuned: Weights | None = None
    history: tuple[dict[str, Any], ...] = ()
    windows = []
    for name, seed, ts in PAPER_WINDOWS:
        print(f"paper protocol: {name} window (seed {seed}), time_scale {ts:g}", file=sys.stderr)
        trace = paper_synthetic(seed)
        d = work_dir / f"paper-{name}-seed{seed}"
        summaries = run_simulations(trace, policies, [ts], d, base, f"paper {name}")
        if name == "tuning":
            online = replace(base, policy="gorgo", time_scale=ts, tune="paired")
            with bar(len(trace), "gorgo tuning online", unit="req", leave=False) as done:
                res = simulate(trace, online, progress=counter(done))
            summaries[("gorgo (tuning online)", ts)] = summarize(res.requests, res.itl_ms)
            assert res.router.tuner is not None
            tuned = Weights(*res.router.tuner.state.parent)
            history = tuple(res.router.tuner.state.history)
        elif tuned is not None:
            frozen = replace(
                base,
                policy="gorgo",
                time_scale=ts,
                router={
                    "policies": {"gorgo": {"weights": {"rtt": tuned.rtt, "queue": tuned.queue}}}
                },
            )
            with bar(len(trace), "gorgo tuned, frozen", unit="req", leave=False) as done:
                res = simulate(trace, frozen, progress=counter(done))
            summaries[("gorgo (tuned, frozen)", ts)] = summarize(res.requests, res.itl_ms)
        windows.append(_window(name, seed, ts, summaries))
    print("paper protocol: Table 3 sweep", file=sys.stderr)
    trace = paper_synthetic(TABLE3_SEED)
    sweep = run_simulations(
        trace, SWEEP_POLICIES, sorted(PAPER_TABLE3), work_dir / "paper-sweep", base, "paper sweep"
    )
    rows = tuple(
        SweepRow(ts, {p: _p95s(sweep[(p, ts)]) for p in SWEEP_POLICIES}, PAPER_TABLE3[ts])
        for ts in sorted(PAPER_TABLE3)
    )
    return PaperStudy(tuple(windows), tuned, history, rows)


# -- the markdown ---------------------------------------------------------------------------


def _pair(p95s: tuple[float, float]) -> str:
    return f"{p95s[0]:.0f} / {p95s[1]:.2f}"


def paper_markdown(s: PaperStudy) -> str:
    """The section: Table 2, the tuned weights and the convergence figure, Table 3."""
    from loadgen.client.protocol import PAPER

    parts = [
        "# The paper's experiment, under the paper's protocol\n",
        f"Workload: the paper-shaped synthetic windows (`paper-synthetic:SEED`, 30 min each; "
        f"docs/benchmarks.md has its statistics beside the paper's); {PAPER.describe()}. "
        "Cells: p95 TTFT (ms) / p95 E2E (s). The paper's rows are its Table 2 and 3 (the GORGO "
        'paper: README, "Citation"), measured on its own fleet: set them beside ours for the '
        "shape (which policy wins, by how much), not the absolute values.\n",
        "## Table 2: a tuning window (online tuning), two held-out windows (weights frozen)\n",
    ]
    rows = []
    for w in s.windows:
        for c in w.cells:
            mark = "-" if c.paper is None else _pair(c.paper)
            rows.append(
                f"| {w.name}, ts {w.time_scale:g} | {c.policy} | "
                f"{_pair((c.ttft_p95_ms, c.e2e_p95_s))} | {c.slip_p95_ms:.0f} | {mark} |"
            )
        rows.append("| | | | | |")
    parts += [
        "| window | policy | ours | our slip p95 (ms) | paper |",
        "|---|---|---|---|---|",
        *rows[:-1],
        "",
    ]
    if s.tuned is not None:
        parts.append(
            f"Tuned online on the tuning window, then frozen: w_rtt {s.tuned.rtt:.3f}, w_queue "
            f"{s.tuned.queue:.3f} (the paper learned 0.276 / 0.5).\n"
        )
        parts.append(f"![Tuner convergence, paper protocol]({FIGURE})\n")
    parts += [
        f"## Table 3: load sweep (window seed {TABLE3_SEED}, static weights)\n",
        "| time_scale | "
        + " | ".join(f"{p} (ours)" for p in SWEEP_POLICIES)
        + " | "
        + " | ".join(f"{p} (paper)" for p in SWEEP_POLICIES)
        + " |",
        "|---|" + "---|" * (2 * len(SWEEP_POLICIES)),
    ]
    for r in s.sweep:
        ours = " | ".join(_pair(r.ours[p]) for p in SWEEP_POLICIES)
        published = " | ".join(_pair(r.paper[p]) for p in SWEEP_POLICIES)
        parts.append(f"| {r.time_scale:g} | {ours} | {published} |")
    parts.append("")
    return "\n".join(parts)


def paper_section(policies: Sequence[str], work_dir: Path, img_dir: Path) -> str:
    """The paper's Table 2 and Table 3 and Figure 3, under its protocol, on the
    paper-shaped workload, with the paper's published rows beside ours."""
    s = paper_study(policies, work_dir)
    if s.tuned is not None:
        img_dir.mkdir(parents=True, exist_ok=True)
        convergence_plot(
            s.history,
            "paired mode, paper protocol, tuning window",
            img_dir / Path(FIGURE).name,
        )
    return paper_markdown(s)
