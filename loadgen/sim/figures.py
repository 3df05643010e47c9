"""The simulator's figures: per time_scale the TTFT CDF of each policy and p95 TTFT / E2E
against time_scale (`gorgo simulate`, `gorgo bench results`), and a tuner's convergence
(weights, sigma and the windowed p95 against completed requests: the paper's Figure 3).

matplotlib is imported inside each function, so importing this module costs nothing until
a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.results import read_result


def write_figures(out_dir: Path, summaries: dict[tuple[str, float], dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    policies = sorted({p for p, _ in summaries})
    scales = sorted({ts for _, ts in summaries})
    for ts in scales:
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in policies:
            doc = read_result(out_dir / f"{p}-ts{ts:g}.json")
            ttft = np.sort([r["ttft_ms"] for r in doc["requests"] if r["ttft_ms"] is not None])
            ax.plot(ttft / 1000, np.linspace(0, 1, len(ttft)), label=p)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"TTFT CDF, time_scale {ts:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"ttft-cdf-ts{ts:g}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    if len(scales) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for p in policies:
            axes[0].plot(
                scales,
                [summaries[(p, ts)]["ttft_ms"]["p95"] / 1000 for ts in scales],
                marker="o",
                label=p,
            )
            axes[1].plot(
                scales,
                [summaries[(p, ts)]["e2e_ms"]["p95"] / 1000 for ts in scales],
                marker="o",
                label=p,
            )
        for ax, what in zip(axes, ("TTFT", "E2E"), strict=True):
            ax.set_xlabel("time_scale (larger = lighter load)")
            ax.set_ylabel(f"p95 {what} (s)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "p95-vs-time-scale.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def convergence_plot(
    h: Sequence[dict[str, Any]],
    title: str,
    path: Path,
    names: tuple[str, str] = ("w_rtt", "w_queue"),
) -> None:
    """The tuned values (the weights, or a P/D fleet's knobs), sigma and the windowed p95
    against completed requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["samples"] for s in h]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a1.plot(xs, [s["parent"][0] for s in h], label=names[0])
    a1.plot(xs, [s["parent"][1] for s in h], label=names[1])
    a1.plot(xs, [s["sigma"] for s in h], label="sigma", linestyle=":")
    a1.set_yscale("log")
    a1.set_ylabel("value / sigma")
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
