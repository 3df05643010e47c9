"""`gorgo bench target`: the target matrix (gorgo vs the best baseline per cell), reproducibly.

A cell is (workload window, RTT profile, client protocol, time_scale). In each, every
baseline and `gorgo` (and any `--extra` policy) is simulated on the same fleet and seed;
the row gives the best baseline's p95 TTFT and p95 E2E (each the lowest over the
baselines, so they may be two different policies), `gorgo`'s ratios to them, whether it
meets the target (TTFT ratio <= 0.8 and E2E ratio <= 1.0), the cell's no-queue and burst
floors, and the clairvoyant greedy reference (below).

The floor (`no_queue_floor_ms`) is a lower bound on any policy's p95 TTFT in the cell:
per request, the TTFT it would have alone on an idle engine (the engine model's chunked
prefill, `EngineProfile.lone_ttft_ms`, without jitter) with every prefix it can reuse
already cached, plus the smallest mean RTT of any backend; then the p95 over the cell's
requests. A prefix is reusable when an earlier request of the run computed it: the
leading engine blocks of the prompt that are full blocks of an earlier prompt (the cache
starts cold and is unbounded here), at most all but the last prompt token (the engine
always computes one). Every request's TTFT is at least its own floor (up to the engine's
step jitter and the WAN's), so every policy's p95 is at least the p95 of the floors: a
cell where 0.8 x the best baseline's p95 is below it cannot be met by any policy.

The conversation trace stamps arrivals in 3 s steps (about 9 requests at one instant), and
such a burst queues on a fleet of 3 whatever the policy: the burst floor
(`burst_floor_ttfts_ms`) is the tighter bound there. Of the requests arriving at one
instant, sorted by TTFT, the k-th is at least the k-th smallest of their own floors, and
at least the smallest RTT + one prefill step's base + the prefill token work of the
ceil(k / backends) smallest of them (some backend runs ceil(k / backends) of the first k,
one after another: prefill runs before decode, FCFS), and the last of them at least the
smallest RTT + a base + the burst's token work / backends. The p95 of these bounds over the
cell is at most any policy's p95 (the sorted TTFTs of each burst dominate its bounds).
Both floors ignore the engine's step jitter (lognormal, 2 %) and the WAN's (the RTT is a
mean), so a policy could in principle come within a few percent below them.

What a perfectly informed router would get is the third reference column: the clairvoyant
greedy scheduler (`clairvoyant_greedy_ttfts_ms`) decides each request as gorgo does, one
at a time in arrival order to the backend with the soonest first token, but with every
backlog, cache and prefill time known exactly and engines that only prefill. It is not a
bound (a scheduler that looks ahead can beat it), but where 0.8 x the best baseline is
below it, meeting the target asks an online router to beat perfect information.

Its cache never evicts, which flatters it where the engines' KV pools fill (the
paper-shaped workload). The fourth column (`clairvoyant_pool_ms`) is the same router on
engines that cache only what their pool holds, least recently used block out first, in
six variants: the greedy, and "home" placements that keep a session on one backend unless
another's first token comes 100 ms, 300 ms, 1 s, 3 s or never sooner; the best of them per
cell. Not a bound either: its engines never batch two prompts in one step (a real engine's
step base is shared, so under heavy load the engine does better than it assumes).

Result files go to --work, one per cell and policy (the shared schema); `--reuse` reads
those that exist instead of running them again (except the policies named by --rerun).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ext_proc.vocab.backend import DEFAULT_PROFILE
from loadgen.bench.sim.floors import (
    burst_floor_ttfts_ms,
    clairvoyant_greedy_ttfts_ms,
    floor_ttfts_ms,
)
from loadgen.bench.sim.policies import BASELINES
from loadgen.client.protocol import PRESETS
from loadgen.progress import say, tracked
from loadgen.results import read_result, write_result
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.load import load_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import window

TARGET_TTFT = 0.8
TARGET_E2E = 1.0

CONVERSATION = "conversation"
SYNTHETIC = "synthetic"
# The conversation trace's windows (start_s, duration_s): those of `make bench`.
CONVERSATION_WINDOWS = ((0.0, 1200.0), (1200.0, 1200.0), (2400.0, 1200.0))
# Per (workload, protocol): the time_scales where the fleet is not saturated, the last
# before saturation first (docs/cost-model.md says where each saturates).
TIME_SCALES: dict[tuple[str, str], tuple[float, ...]] = {
    (CONVERSATION, "open"): (3.0, 4.0, 6.0),
    (CONVERSATION, "paper"): (1.5, 2.0, 3.0, 4.0, 6.0),
    (SYNTHETIC, "open"): (0.75, 1.0, 1.5, 2.0, 3.0),
    (SYNTHETIC, "paper"): (0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
}


@dataclass(frozen=True)
class Window:
    """One workload window: its requests (arrivals from 0) and how a table names it."""

    workload: str
    label: str
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class Cell:
    window: Window
    rtt_profile: str
    protocol: str
    time_scale: float
    # Every engine's profile (a built-in name or a YAML path).
    engine_profile: str = DEFAULT_PROFILE

    @property
    def key(self) -> str:
        w = self.window
        key = f"{w.workload}-{w.label}-{self.rtt_profile}-{self.protocol}-ts{self.time_scale:g}"
        # Another engine's runs are kept apart from the default engine's.
        other = self.engine_profile != DEFAULT_PROFILE
        return f"{key}-{Path(self.engine_profile).stem}" if other else key

    def settings(self, policy: str, seed: int) -> SimSettings:
        return SimSettings(
            policy=policy,
            time_scale=self.time_scale,
            rtt_profile=self.rtt_profile,
            seed=seed,
            protocol=PRESETS[self.protocol],
            engine_profile=self.engine_profile,
        )


@dataclass
class Row:
    cell: Cell
    # policy -> (p95 TTFT, p95 E2E), ms
    p95: dict[str, tuple[float, float]]
    floor_ms: float
    # The p95 of the burst bounds (burst_floor_ms); 0: not computed.
    burst_floor_ms: float = 0.0
    subject: str = "gorgo"
    # The clairvoyant greedy scheduler's p95 TTFT (clairvoyant_greedy_ttfts_ms), and the
    # best clairvoyant placement's with the engines' real KV pool (clairvoyant_pool_ms);
    # 0: not computed.
    greedy_ms: float = 0.0
    pool_ms: float = 0.0
    # Where the best baseline is picked from, and the TTFT ratio to meet.
    baselines: tuple[str, ...] = BASELINES
    target_ttft: float = TARGET_TTFT

    @property
    def best_ttft(self) -> tuple[str, float]:
        ps = [(p, self.p95[p][0]) for p in self.baselines if p in self.p95]
        return min(ps, key=lambda x: x[1])

    @property
    def best_e2e(self) -> tuple[str, float]:
        ps = [(p, self.p95[p][1]) for p in self.baselines if p in self.p95]
        return min(ps, key=lambda x: x[1])

    def ratios(self, policy: str) -> tuple[float, float]:
        ttft, e2e = self.p95[policy]
        return ttft / self.best_ttft[1], e2e / self.best_e2e[1]

    @property
    def meets(self) -> bool:
        t, e = self.ratios(self.subject)
        return t <= self.target_ttft and e <= TARGET_E2E

    @property
    def headroom(self) -> float:
        """target x the best baseline's p95 TTFT over the floor: below 1, no policy meets it."""
        return self.target_ttft * self.best_ttft[1] / self.floor_ms

    @property
    def burst_headroom(self) -> float:
        """The same over the burst floor (the tighter bound where arrivals come in bursts)."""
        if not self.burst_floor_ms:
            return math.inf
        return self.target_ttft * self.best_ttft[1] / self.burst_floor_ms

    @property
    def greedy_headroom(self) -> float:
        """0.8 x the best baseline's p95 TTFT over the clairvoyant greedy scheduler's."""
        return self.target_ttft * self.best_ttft[1] / self.greedy_ms if self.greedy_ms else math.inf

    @property
    def pool_headroom(self) -> float:
        """0.8 x the best baseline's p95 TTFT over the best clairvoyant placement's with
        the engines' real pool."""
        return self.target_ttft * self.best_ttft[1] / self.pool_ms if self.pool_ms else math.inf

    @property
    def feasible(self) -> bool:
        """Below either floor, no policy can meet the target."""
        return min(self.headroom, self.burst_headroom) >= 1.0


@dataclass(frozen=True)
class Block:
    """The rows of one (workload, protocol) and its counts of cells: where the subject
    meets the target, where some policy could (feasible, with both floors) and the subject
    does, and where the target is below the clairvoyant greedy scheduler's p95, below the
    best clairvoyant placement's with the real pool, and below either."""

    workload: str
    protocol: str
    rows: tuple[Row, ...]
    met: int
    feasible: int
    met_feasible: int
    below_greedy: int
    below_pool: int
    below_either: int

    @property
    def subject(self) -> str:
        return self.rows[0].subject


def blocks(rows: Sequence[Row]) -> list[Block]:
    """The rows by (workload, protocol), in their order, with each block's counts."""
    by: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by.setdefault((r.cell.window.workload, r.cell.protocol), []).append(r)
    out = []
    for (workload, protocol), rs in by.items():
        feasible = [r for r in rs if r.feasible]
        out.append(
            Block(
                workload,
                protocol,
                tuple(rs),
                met=sum(r.meets for r in rs),
                feasible=len(feasible),
                met_feasible=sum(r.meets for r in feasible),
                below_greedy=sum(r.greedy_headroom < 1 for r in rs),
                below_pool=sum(r.pool_headroom < 1 for r in rs),
                below_either=sum(min(r.greedy_headroom, r.pool_headroom) < 1 for r in rs),
            )
        )
    return out


# The clairvoyant placements tried with the engines' real KV pool: how much sooner
# (ms) another backend's first token must come for a session to leave its home (0: the
# greedy; inf: never). The reference is the best of them, cell by cell.
SPILL_MS = (0.0, 100.0, 300.0, 1000.0, 3000.0, math.inf)


def clairvoyant_p95_ms(cell: Cell, pool: bool = False, spill_ms: float = 0.0) -> float:
    """The p95 of clairvoyant_greedy_ttfts_ms over the cell (time_scale applied, the
    protocol's drops too; its concurrency cap is not modelled: TTFT counts from dispatch)."""
    kept, _ = PRESETS[cell.protocol].apply(cell.window.requests)
    scaled = [replace(r, arrival_s=r.arrival_s * cell.time_scale) for r in kept]
    ttfts = clairvoyant_greedy_ttfts_ms(
        scaled, cell.rtt_profile, cell.engine_profile, pool=pool, spill_ms=spill_ms
    )
    return float(np.percentile(ttfts, 95))


def clairvoyant_greedy_ms(cell: Cell) -> float:
    """The clairvoyant greedy scheduler's p95 (an unbounded cache per engine)."""
    return clairvoyant_p95_ms(cell)


def clairvoyant_pool_ms(cell: Cell) -> float:
    """The lowest p95 TTFT of the clairvoyant placements (SPILL_MS) on engines that cache
    only what their KV pool holds (clairvoyant_greedy_ttfts_ms with `pool`)."""
    return min(clairvoyant_p95_ms(cell, pool=True, spill_ms=m) for m in SPILL_MS)


def no_queue_floor_ms(cell: Cell) -> float:
    """The cell's floor: the p95 of its requests' floors (the protocol's drops applied)."""
    kept, _ = PRESETS[cell.protocol].apply(cell.window.requests)
    return float(np.percentile(floor_ttfts_ms(kept, cell.rtt_profile, cell.engine_profile), 95))


def burst_floor_ms(cell: Cell) -> float:
    """The p95 of the burst bounds (burst_floor_ttfts_ms): at least the no-queue floor."""
    kept, _ = PRESETS[cell.protocol].apply(cell.window.requests)
    bounds = burst_floor_ttfts_ms(kept, cell.rtt_profile, cell.engine_profile)
    return float(np.percentile(bounds, 95))


def _result_path(work: Path, cell: Cell, policy: str) -> Path:
    return work / cell.key / f"{policy}.json"


def _run_one(cell: Cell, policy: str, seed: int, path: Path) -> tuple[float, float, float]:
    """Simulate one policy in one cell; write its result file; (p95 TTFT, p95 E2E, wall s)."""
    t0 = time.perf_counter()
    res = simulate(cell.window.requests, cell.settings(policy, seed))
    wall_s = time.perf_counter() - t0
    meta = {
        "mode": "bench-target",
        "cell": cell.key,
        "policy": policy,
        "time_scale": cell.time_scale,
        "rtt_profile": cell.rtt_profile,
        "protocol": PRESETS[cell.protocol].meta(),
        "seed": seed,
        "dropped": res.dropped,
        "wall_s": round(wall_s, 2),
    }
    s = write_result(path, res.requests, meta, res.itl_ms)["summary"]
    return s["ttft_ms"]["p95"], s["e2e_ms"]["p95"], wall_s


def run_cells(
    cells: Sequence[Cell],
    policies: Sequence[str],
    work: Path,
    jobs: int = 1,
    seed: int = 0,
    reuse: bool = False,
    rerun: Iterable[str] = (),
    subject: str = "gorgo",
    run: bool = True,
    baselines: tuple[str, ...] = BASELINES,
    target_ttft: float = TARGET_TTFT,
) -> list[Row]:
    """Every policy in every cell (in parallel with jobs > 1), then one Row per cell.
    run=False: only what the result files hold (cells missing a run are left out)."""
    rerun = set(rerun)
    p95: dict[str, dict[str, tuple[float, float]]] = {c.key: {} for c in cells}
    todo: list[tuple[Cell, str, Path]] = []
    for c in cells:
        for p in policies:
            path = _result_path(work, c, p)
            if reuse and p not in rerun and path.exists():
                s = read_result(path)["summary"]
                p95[c.key][p] = (s["ttft_ms"]["p95"], s["e2e_ms"]["p95"])
            else:
                todo.append((c, p, path))
    if not run:
        missing = {c.key for c, _, _ in todo}
        for key in sorted(missing):
            print(f"bench target: {key} left out (runs missing)", file=sys.stderr)
        cells = [c for c in cells if c.key not in missing]
        todo = []
    n = len(todo)
    print(
        f"bench target: {len(cells)} cells x {len(policies)} policies, {n} runs "
        f"({len(cells) * len(policies) - n} reused), {jobs} jobs",
        file=sys.stderr,
        flush=True,
    )

    def report(i: int, c: Cell, p: str, r: tuple[float, float, float]) -> None:
        p95[c.key][p] = (r[0], r[1])
        say(
            f"  [{i}/{n}] {c.key:<40} {p:<17} p95 TTFT {r[0]:>8.0f} ms  E2E {r[1]:>8.0f} ms"
            f"  ({r[2]:.1f} s)"
        )

    if jobs <= 1:
        for i, (c, p, path) in enumerate(tracked(todo, n, "bench target"), 1):
            report(i, c, p, _run_one(c, p, seed, path))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_run_one, c, p, seed, path): (c, p) for c, p, path in todo}
            for i, f in enumerate(tracked(as_completed(futures), n, "bench target"), 1):
                c, p = futures[f]
                report(i, c, p, f.result())
    return [
        Row(
            c,
            p95[c.key],
            no_queue_floor_ms(c),
            burst_floor_ms(c),
            subject,
            clairvoyant_greedy_ms(c),
            clairvoyant_pool_ms(c),
            baselines,
            target_ttft,
        )
        for c in cells
    ]


def _label(start_s: float, duration_s: float) -> str:
    a, b = start_s / 60, (start_s + duration_s) / 60
    # The trace ends before its last hour does: 40-60 min holds 40-59 min.
    return f"{a:g}-{min(b, 59):g} min" if b >= 60 else f"{a:g}-{b:g} min"


def windows_for(
    workloads: Sequence[str], trace: str, starts: Sequence[float] | None, duration_s: float
) -> list[Window]:
    out: list[Window] = []
    for w in workloads:
        if w == CONVERSATION:
            whole = load_trace(trace)
            for start in starts if starts is not None else [s for s, _ in CONVERSATION_WINDOWS]:
                reqs = tuple(window(whole, start, duration_s))
                out.append(Window(CONVERSATION, _label(start, duration_s), reqs))
        elif w == SYNTHETIC:
            out.append(Window(SYNTHETIC, "paper-synthetic", tuple(load_trace("paper-synthetic"))))
        else:
            raise ValueError(f"unknown workload {w!r} ({CONVERSATION}, {SYNTHETIC})")
    return out


def cells_for(
    windows: Sequence[Window],
    rtt_profiles: Sequence[str],
    protocols: Sequence[str],
    time_scales: Sequence[float] | None,
    engine_profile: str = DEFAULT_PROFILE,
) -> list[Cell]:
    out: list[Cell] = []
    for protocol in protocols:
        for w in windows:
            for rtt in rtt_profiles:
                scales = time_scales or TIME_SCALES[(w.workload, protocol)]
                out.extend(Cell(w, rtt, protocol, ts, engine_profile) for ts in scales)
    return out
