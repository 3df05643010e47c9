"""`gorgo bench target`'s report: the matrix's markdown (from loadgen.bench.sim.target's rows
and blocks) and the command that runs the cells and writes it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ext_proc.common.files import write_atomic
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.backend import DEFAULT_PROFILE
from loadgen.bench.sim.policies import AGAINST
from loadgen.bench.sim.target import (
    TARGET_E2E,
    TARGET_TTFT,
    Block,
    Row,
    blocks,
    cells_for,
    run_cells,
    windows_for,
)
from loadgen.client.protocol import PRESETS, Protocol

SHORT = {
    "least_request": "LR",
    "least_load": "LL",
    "session_affinity": "SA",
    "prefix_cache": "PC",
    "round_robin": "RR",
    "random": "RND",
    "smg_cache_aware": "SMG-CA",
    "smg_least_load": "SMG-LL",
    "smg_prefix_hash": "SMG-PH",
    "vllm_router_cache_aware": "VR-CA",
    "vllm_router_sticky_least_loaded": "VR-SLL",
    "llmd_weighted": "LLMD-W",
    "llmd_sticky": "LLMD-S",
    "dynamo_kv": "DYN",
}


def _ms(x: float) -> str:
    return f"{x:.0f}"


def block_summary(b: Block) -> str:
    """A block's counts, the line above its table."""
    return (
        f"**{b.workload}, protocol `{b.protocol}`** ({Protocol.describe(PRESETS[b.protocol])}): "
        f"`{b.subject}` meets the target in {b.met}/{len(b.rows)} cells; {b.feasible} cells "
        f"are feasible for some policy ({b.rows[0].target_ttft:g} x best baseline / floor >= 1.0, "
        "with both "
        f"floors), "
        f"met in {b.met_feasible} of them; in {b.below_greedy} the "
        f"target is below the clairvoyant greedy scheduler's p95, in "
        f"{b.below_pool} below the best clairvoyant placement's "
        f"with the engines' real KV pool, and in "
        f"{b.below_either} below at least one of "
        "the two.\n"
    )


def row_cells(r: Row, subject: str, extra: Sequence[str] = ()) -> list[str]:
    """A row of the matrix, cell by cell."""
    (bt, vt), (be, ve) = r.best_ttft, r.best_e2e
    t, e = r.ratios(subject)
    cells = [
        r.cell.window.label,
        r.cell.rtt_profile,
        f"{r.cell.time_scale:g}",
        f"{_ms(vt)} ({SHORT[bt]}) / {_ms(ve)} ({SHORT[be]})",
        _ms(r.floor_ms),
        f"{r.headroom:.2f}" + ("" if r.headroom >= 1 else " (infeasible)"),
        _ms(r.burst_floor_ms) if r.burst_floor_ms else "-",
        (f"{r.burst_headroom:.2f}" if r.burst_floor_ms else "-")
        + ("" if r.burst_headroom >= 1 else " (infeasible)"),
        _ms(r.greedy_ms) if r.greedy_ms else "-",
        f"{r.greedy_headroom:.2f}" if r.greedy_ms else "-",
        _ms(r.pool_ms) if r.pool_ms else "-",
        f"{r.pool_headroom:.2f}" if r.pool_ms else "-",
        f"{t:.2f} / {e:.2f}",
        "yes" if r.meets else "no",
    ]
    for p in extra:
        if p in r.p95:
            xt, xe = r.ratios(p)
            cells.append(f"{xt:.2f} / {xe:.2f}")
        else:
            cells.append("-")
    return cells


def markdown(rows: Sequence[Row], extra: Sequence[str] = ()) -> str:
    """The matrix: one table per (workload, protocol) block, its met/feasible counts."""
    parts: list[str] = []
    for b in blocks(rows):
        parts.append(block_summary(b))
        x = f"{b.rows[0].target_ttft:g} x best baseline"
        head = [
            "window",
            "RTT",
            "time_scale",
            "best baseline p95 TTFT / E2E (ms)",
            "floor p95 TTFT (ms)",
            f"{x} / floor",
            "burst floor p95 TTFT (ms)",
            f"{x} / burst floor",
            "clairvoyant greedy p95 TTFT (ms)",
            f"{x} / clairvoyant greedy",
            "clairvoyant, real pool p95 TTFT (ms)",
            f"{x} / clairvoyant, real pool",
            f"{b.subject} TTFT / E2E ratio",
            "meets",
            *[f"{p} TTFT / E2E ratio" for p in extra],
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row_cells(r, b.subject, extra)) + " |" for r in b.rows]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def note(command: str, seed: int, profile_name: str, target_ttft: float = TARGET_TTFT) -> str:
    """What the matrix's columns are, above it."""
    return (
        f"Made by `{command}`; seed {seed}, engine profile `{profile_name}`. A ratio is "
        "the policy's p95 over the best baseline's (TTFT and E2E each against its own "
        f"best). meets: TTFT ratio <= {target_ttft:g} and E2E ratio <= {TARGET_E2E}. "
        "floor: p95 of each request's TTFT alone on an idle engine with every prefix an "
        "earlier request computed cached, plus the smallest RTT; burst floor: p95 of "
        "bounds that also count the queue a burst of same-instant arrivals forces on the "
        f"fleet (loadgen/bench/sim/target.py). Either above {target_ttft:g} x the best "
        "baseline: no policy "
        "can meet the target in that cell. clairvoyant greedy: a router that knows every "
        "backlog, cache and prefill time, on engines that only prefill and never evict; "
        "clairvoyant, real pool: the best of six such placements on engines that evict "
        "(references, not bounds).\n\n"
    )


def run_target_bench(
    trace: str,
    workloads: Sequence[str],
    starts: Sequence[float] | None,
    duration_s: float,
    rtt_profiles: Sequence[str],
    protocols: Sequence[str],
    time_scales: Sequence[float] | None,
    extra: Sequence[str],
    work: Path,
    out: Path | None,
    jobs: int,
    reuse: bool,
    rerun: Sequence[str],
    seed: int = 0,
    command: str = "gorgo bench target",
    run: bool = True,
    engine_profile: str = DEFAULT_PROFILE,
    against: str = "paper",
) -> int:
    for p in protocols:
        if p not in PRESETS:
            print(f"gorgo bench target: unknown protocol {p!r}", file=sys.stderr)
            return 2
    try:
        windows = windows_for(workloads, trace, starts, duration_s)
        profile = load_profile(engine_profile)
    except ValueError as e:
        print(f"gorgo bench target: {e}", file=sys.stderr)
        return 2
    cells = cells_for(windows, rtt_profiles, protocols, time_scales, engine_profile)
    baselines, target_ttft = AGAINST[against]
    policies = [*baselines, "gorgo", *[p for p in extra if p not in (*baselines, "gorgo")]]
    rows = run_cells(
        cells,
        policies,
        work,
        jobs,
        seed,
        reuse or not run,
        rerun,
        run=run,
        baselines=baselines,
        target_ttft=target_ttft,
    )
    extra = [p for p in extra if p not in (*baselines, "gorgo")]
    text = note(command, seed, profile.name, target_ttft) + markdown(rows, extra)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)
        print(f"wrote {out}", file=sys.stderr)
    return 0
