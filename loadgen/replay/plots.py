"""Figures of a `gorgo replay` run (`--plot`).

matplotlib is imported inside the plotting function, so importing this module (or
`loadgen.replay.run`, which uses it) costs nothing until a figure is actually drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for its type only: the replay's shell needs aiohttp
    from loadgen.replay.loop import ReplayRun


def plot_run(path: str | Path, run: ReplayRun, title: str) -> None:
    """TTFT CDF (left) and TTFT over the run (right; errors as red marks at the bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in run.sent if s.result.status == "ok" and s.result.ttft_ms is not None]
    ttft_s = sorted(s.result.ttft_ms / 1e3 for s in ok if s.result.ttft_ms is not None)
    fig, (cdf, over) = plt.subplots(1, 2, figsize=(11, 4))
    if ttft_s:
        cdf.plot(ttft_s, [(i + 1) / len(ttft_s) for i in range(len(ttft_s))])
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3)
    over.scatter(
        [s.sent_s for s in ok],
        [s.result.ttft_ms / 1e3 for s in ok if s.result.ttft_ms is not None],
        s=6,
        alpha=0.6,
        label="ok",
    )
    failed = [s.sent_s for s in run.sent if s.result.status != "ok"]
    if failed:
        over.scatter(failed, [0.0] * len(failed), s=12, marker="x", color="red", label="error")
        over.legend()
    over.set_xlabel("send time (s since start)")
    over.set_ylabel("TTFT (s)")
    over.set_title("TTFT over time")
    over.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
