"""`gorgo bench engine-model`: the engine model's shape against its calibration targets.

Everything here runs the pure model on a virtual clock (seconds of compute for hours of
emulated GPU time) and writes the figures and the table used by docs/engine-model.md.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from emulator.engine.model.scheduler import EngineModel
from ext_proc.estimate.profile import EngineProfile, load_profile

# Workload shaped like the Mooncake conversation trace: input tokens lognormal with
# median 6,909 and mean 12,035; output tokens mean 343.
INPUT_MEDIAN_TOKENS = 6909
INPUT_MEAN_TOKENS = 12035
OUTPUT_MEAN_TOKENS = 343
INPUT_MAX_TOKENS = 126_195
OUTPUT_MAX_TOKENS = 2000


@dataclass(frozen=True)
class LoadPoint:
    rate_rps: float
    requests: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    mean_running: float


def _workload(n: int, rate_rps: float, rng: random.Random) -> list[tuple[float, int, int]]:
    sigma = math.sqrt(2 * math.log(INPUT_MEAN_TOKENS / INPUT_MEDIAN_TOKENS))
    mu = math.log(INPUT_MEDIAN_TOKENS)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        n_in = min(INPUT_MAX_TOKENS, max(16, int(rng.lognormvariate(mu, sigma))))
        n_out = min(OUTPUT_MAX_TOKENS, max(1, int(rng.expovariate(1 / OUTPUT_MEAN_TOKENS))))
        out.append((t, n_in, n_out))
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_load(profile: EngineProfile, rate_rps: float, n: int = 600, seed: int = 0) -> LoadPoint:
    """Poisson arrivals of unique prompts (no cache reuse) on one engine."""
    rng = random.Random(seed)
    model = EngineModel(profile, random.Random(seed))
    arrivals = _workload(n, rate_rps, rng)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    running_samples: list[int] = []
    i = 0
    while i < len(arrivals) or model.next_event_s() is not None:
        due = model.next_event_s()
        if i < len(arrivals) and (due is None or arrivals[i][0] <= due):
            t, n_in, n_out = arrivals[i]
            model.advance(t)
            model.submit(f"r{i}", n_in, n_out, [], t)
            i += 1
            continue
        assert due is not None
        for e in model.advance(due):
            if e.index == 0:
                first[e.rid] = e.time_s
            else:
                itl.append((e.time_s - last[e.rid]) * 1e3)
            last[e.rid] = e.time_s
        running_samples.append(model.num_running)
    ttft = [(first[f"r{k}"] - arrivals[k][0]) * 1e3 for k in range(len(arrivals))]
    return LoadPoint(
        rate_rps,
        n,
        _pct(ttft, 0.5),
        _pct(ttft, 0.95),
        _pct(itl, 0.5),
        _pct(itl, 0.95),
        statistics.fmean(running_samples) if running_samples else 0.0,
    )


def sweep(profile: EngineProfile, rates: list[float], n: int = 600) -> list[LoadPoint]:
    return [run_load(profile, r, n) for r in rates]


def write_figures(profile: EngineProfile, points: list[LoadPoint], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    p = replace(profile, jitter_sigma=0.0)

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [1024 * k for k in (1, 2, 4, 8, 16, 32, 64, 96, 128)]
    for frac in (0.0, 0.5, 0.9):
        ax.plot(
            [n / 1024 for n in lengths],
            [p.lone_ttft_ms(n, int(n * frac)) / 1e3 for n in lengths],
            marker="o",
            label=f"{int(frac * 100)} % cached",
        )
    ax.set_xlabel("prompt length (k tokens)")
    ax.set_ylabel("TTFT alone on the engine (s)")
    ax.set_title(f"Prefill: {p.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out_dir / "engine-ttft.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    batches = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    for ctx in (2_000, 8_000, 16_000):
        ax.plot(
            batches,
            [p.decode_ms(b, b * ctx) for b in batches],
            marker="o",
            label=f"{ctx // 1000}k context each",
        )
    ax.axhspan(9, 10, color="green", alpha=0.15, label="target light load (9-10 ms)")
    ax.axhspan(17, 25, color="orange", alpha=0.15, label="target near saturation (17-25 ms)")
    ax.set_xlabel("running requests (batch)")
    ax.set_ylabel("decode step = ITL (ms)")
    ax.set_title(f"Decode: {p.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / "engine-itl.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [q.rate_rps for q in points], [q.itl_p50_ms for q in points], marker="o", label="ITL p50"
    )
    ax.plot(
        [q.rate_rps for q in points], [q.itl_p95_ms for q in points], marker="s", label="ITL p95"
    )
    ax.set_xlabel("arrival rate, one engine (requests/s)")
    ax.set_ylabel("ms")
    ax.set_title("ITL under Mooncake-shaped load")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out_dir / "engine-load.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def table(points: list[LoadPoint]) -> str:
    lines = [
        "| arrival rate (req/s) | TTFT p50 (ms) | TTFT p95 (ms) | ITL p50 (ms) | ITL p95 (ms) "
        "| mean running |",
        "|---|---|---|---|---|---|",
    ]
    for q in points:
        lines.append(
            f"| {q.rate_rps:g} | {q.ttft_p50_ms:.0f} | {q.ttft_p95_ms:.0f} | "
            f"{q.itl_p50_ms:.1f} | {q.itl_p95_ms:.1f} | {q.mean_running:.1f} |"
        )
    return "\n".join(lines)


RATES_RPS = [0.1, 0.2, 0.3, 0.4, 0.45, 0.5, 0.6]


def run_calibration(profile_name: str, out_dir: Path, requests: int) -> int:
    profile = load_profile(profile_name)
    points = sweep(profile, RATES_RPS, requests)
    print(table(points))
    for path in write_figures(profile, points, out_dir):
        print(f"wrote {path}")
    return 0
