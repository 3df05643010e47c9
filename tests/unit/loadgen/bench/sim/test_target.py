"""`gorgo bench target`: the table's logic on a tiny trace (best baseline, ratios, meets,
the blocks' counts, and a floor no policy goes below), and one rendered row."""

import math
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from ext_proc.estimate.profile import load_profile
from loadgen.bench.sim.floors import (
    burst_floor_ttfts_ms,
    clairvoyant_greedy_ttfts_ms,
    floor_ttfts_ms,
)
from loadgen.bench.sim.policies import AGAINST
from loadgen.bench.sim.target import (
    BASELINES,
    Cell,
    Row,
    Window,
    blocks,
    no_queue_floor_ms,
    run_cells,
)
from loadgen.bench.sim.target_report import markdown
from loadgen.sim.settings import SimSettings
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import window

SLICE = Path(__file__).resolve().parents[5] / "loadgen/data/mooncake-conversation-head400.jsonl"


def _cell(reqs: list[TraceRequest], protocol: str = "open", ts: float = 1.0) -> Cell:
    return Cell(Window("conversation", "head", tuple(reqs)), "paper", protocol, ts)


def _row() -> Row:
    p95 = {p: (1000.0 + 100 * i, 5000.0 - 100 * i) for i, p in enumerate(BASELINES)}
    p95["gorgo"] = (790.0, 4600.0)
    p95["gorgo_time3"] = (100.0, 100.0)  # not a baseline: never the best
    return Row(_cell([]), p95, floor_ms=500.0)


def test_row_picks_each_best_baseline_and_ratios() -> None:
    row = _row()
    assert row.best_ttft == ("least_request", 1000.0)
    assert row.best_e2e == ("random", 4500.0)
    t, e = row.ratios("gorgo")
    assert t == pytest.approx(0.79) and e == pytest.approx(4600 / 4500)
    assert not row.meets  # E2E above the best baseline's
    row.p95["gorgo"] = (790.0, 4500.0)
    assert row.meets
    row.p95["gorgo"] = (801.0, 1000.0)
    assert not row.meets  # TTFT above 0.8 x
    assert row.headroom == pytest.approx(0.8 * 1000 / 500) and row.feasible
    row.floor_ms = 900.0
    assert not row.feasible  # 0.8 x 1000 < 900: no policy can meet it
    row.floor_ms, row.burst_floor_ms = 500.0, 900.0
    assert not row.feasible  # the burst floor is the tighter bound
    assert row.burst_headroom == pytest.approx(800 / 900)
    assert row.ratios("gorgo_time3") == pytest.approx((0.1, 100 / 4500))


def test_blocks_count_met_feasible_and_below_the_references() -> None:
    met = replace(_row(), p95={**_row().p95, "gorgo": (790.0, 4500.0)}, greedy_ms=900.0)
    infeasible = replace(_row(), floor_ms=900.0, pool_ms=1200.0)
    other = replace(_row(), cell=_cell([], "paper"))
    a, b = blocks([met, infeasible, other])
    assert (a.workload, a.protocol, a.subject, b.protocol) == (
        "conversation",
        "open",
        "gorgo",
        "paper",
    )
    assert a.rows == (met, infeasible) and b.rows == (other,)
    assert (a.met, a.feasible, a.met_feasible) == (1, 1, 1)
    assert (a.below_greedy, a.below_pool, a.below_either) == (1, 1, 2)
    assert (b.met, b.feasible, b.met_feasible, b.below_either) == (0, 1, 0, 0)


def test_the_matrix_renders_a_block_and_its_rows() -> None:
    row = replace(_row(), burst_floor_ms=900.0)
    row.p95["gorgo"] = (801.0, 1000.0)
    md = markdown([row], extra=["gorgo_time3"])
    assert "1000 (LR) / 4500 (RND)" in md and "| 500 | 1.60 | 900 | 0.89 (infeasible) |" in md
    assert "| 0.80 / 0.22 | no | 0.10 / 0.02 |" in md
    assert "meets the target in 0/1 cells; 0 cells are feasible" in md


def test_floor_caches_what_earlier_requests_computed() -> None:
    prof = load_profile(SimSettings().engine_profile)
    bt = 512
    a = TraceRequest(0, 0.0, 2 * bt, 8, (1, 2), bt, "s")
    b = TraceRequest(1, 1.0, 3 * bt, 8, (1, 2, 3), bt, "s")  # reuses a's two blocks
    c = TraceRequest(2, 2.0, 2 * bt, 8, (1, 2), bt, "s")  # all cached: one block recomputed
    rtt = min(SimSettings(rtt_profile="paper").rtt_ms("", r)[0] for r in SimSettings().regions)
    fa, fb, fc = floor_ttfts_ms([a, b, c], "paper")
    assert fa == pytest.approx(prof.lone_ttft_ms(2 * bt) + rtt)
    assert fb == pytest.approx(prof.lone_ttft_ms(3 * bt, 2 * bt) + rtt)
    cached_c = (2 * bt - 1) // prof.block_tokens * prof.block_tokens
    assert fc == pytest.approx(prof.lone_ttft_ms(2 * bt, cached_c) + rtt)
    assert fb < fa + rtt and fc < fa


def test_floor_is_below_every_policy_on_a_tiny_trace(tmp_path: Path) -> None:
    reqs = window(read_trace(SLICE), limit=80)
    cells = [_cell(reqs, "open", 0.5), _cell(reqs, "paper", 0.5)]
    rows = run_cells(cells, [*BASELINES, "gorgo"], tmp_path, jobs=1)
    for row in rows:
        assert set(row.p95) == {*BASELINES, "gorgo"}
        assert row.floor_ms == no_queue_floor_ms(row.cell)
        assert row.floor_ms <= row.burst_floor_ms
        for p, (ttft, _) in row.p95.items():
            assert row.burst_floor_ms <= ttft, p
        best = min(row.p95[p][0] for p in BASELINES)
        assert row.best_ttft[1] == best
        assert row.ratios("gorgo")[0] == pytest.approx(row.p95["gorgo"][0] / best)
    # the paper's protocol drops the long prompts: its floor is lower
    assert rows[1].floor_ms <= rows[0].floor_ms
    # reused, the result files give the same table
    again = run_cells(cells, [*BASELINES, "gorgo"], tmp_path, reuse=True)
    assert [r.p95 for r in again] == [r.p95 for r in rows]


def test_burst_floor_counts_the_queue_of_same_instant_arrivals() -> None:
    prof = load_profile(SimSettings().engine_profile)
    bt = 512
    rtt = min(SimSettings(rtt_profile="paper").rtt_ms("", r)[0] for r in SimSettings().regions)
    # seven same-instant 4096-token prompts, nothing shared, on 3 backends: the 7th is
    # behind two others somewhere
    burst = [
        TraceRequest(i, 5.0, 8 * bt, 8, tuple(range(10 * i, 10 * i + 8)), bt, f"s{i}")
        for i in range(7)
    ]
    own = floor_ttfts_ms(burst, "paper")
    bounds = sorted(burst_floor_ttfts_ms(burst, "paper"))
    work = prof.lone_ttft_ms(8 * bt) - prof.prefill_base_ms  # one chunk
    assert bounds[:3] == pytest.approx([own[0]] * 3)
    assert bounds[3] == pytest.approx(rtt + prof.prefill_base_ms + 2 * work)
    assert bounds[6] == pytest.approx(rtt + prof.prefill_base_ms + 3 * work)
    # spread out, no queue is forced
    spread = [replace(r, arrival_s=float(i)) for i, r in enumerate(burst)]
    assert burst_floor_ttfts_ms(spread, "paper") == pytest.approx(floor_ttfts_ms(spread, "paper"))


def test_no_run_leaves_out_cells_without_result_files(tmp_path: Path) -> None:
    reqs = window(read_trace(SLICE), limit=5)
    assert run_cells([_cell(reqs)], [*BASELINES, "gorgo"], tmp_path, run=False) == []


def test_clairvoyant_greedy_sends_each_request_where_its_first_token_is_soonest() -> None:
    prof = load_profile(SimSettings().engine_profile)
    bt = 512
    rtt = {r: SimSettings(rtt_profile="paper").rtt_ms("", r)[0] for r in SimSettings().regions}
    near, mid = sorted(rtt.values())[:2]
    burst = [
        TraceRequest(i, 5.0, 8 * bt, 8, tuple(range(10 * i, 10 * i + 8)), bt, f"s{i}")
        for i in range(2)
    ]
    again = TraceRequest(9, 60.0, 9 * bt, 8, (*range(8), 99), bt, "s0")  # s0's next turn
    first, second, third = clairvoyant_greedy_ttfts_ms([*burst, again], "paper")
    lone = prof.lone_ttft_ms(8 * bt)
    assert first == pytest.approx(near + lone)
    # behind the first on the nearest backend, or alone on the next one
    assert second == pytest.approx(min(near + 2 * lone, mid + lone))
    # the next turn finds its prefix where the first went
    assert third == pytest.approx(near + prof.lone_ttft_ms(9 * bt, 8 * bt))
    # perfect information still meets every request's own floor
    reqs = window(read_trace(SLICE), limit=200)
    floors = floor_ttfts_ms(reqs, "network")
    greedy = clairvoyant_greedy_ttfts_ms(reqs, "network")
    assert all(g >= f - 1e-6 for g, f in zip(greedy, floors, strict=True))


def test_another_engine_profile_runs_apart_on_its_own_engines(tmp_path: Path) -> None:
    """--engine-profile: the cell's runs use that profile (floors too) and their result
    files are kept apart from the default engine's."""
    slow = tmp_path / "slow.yaml"
    default = (
        SLICE.parents[2] / "ext_proc/estimate/profiles" / f"{SimSettings().engine_profile}.yaml"
    )
    rate = f"prefill_tokens_per_s: {load_profile(str(default)).prefill_tokens_per_s}"
    assert rate in default.read_text()
    quarter = load_profile(str(default)).prefill_tokens_per_s / 4
    slow.write_text(default.read_text().replace(rate, f"prefill_tokens_per_s: {quarter}"))
    reqs = window(read_trace(SLICE), limit=40)
    base, other = _cell(reqs), replace(_cell(reqs), engine_profile=str(slow))
    assert other.key == f"{base.key}-slow"
    assert other.settings("gorgo", 0).engine_profile == str(slow)
    rows = run_cells([base, other], ["least_request"], tmp_path / "work")
    assert len(list((tmp_path / "work").rglob("*.json"))) == 2
    # a quarter of the prefill rate: every floor and the policy's tail are slower
    assert rows[1].floor_ms > 1.5 * rows[0].floor_ms
    assert rows[1].p95["least_request"][0] > 1.5 * rows[0].p95["least_request"][0]


def test_the_real_pool_evicts_and_a_sticky_placement_keeps_a_session_home(
    tmp_path: Path,
) -> None:
    """clairvoyant_greedy_ttfts_ms with `pool`: an engine caches only what its KV pool
    holds (LRU); with `spill_ms`, a session stays on its home backend unless another is
    that much sooner."""
    default = (
        SLICE.parents[2] / "ext_proc/estimate/profiles" / f"{SimSettings().engine_profile}.yaml"
    )
    prof = load_profile(str(default))
    bt = 512
    line = f"kv_capacity_tokens: {prof.kv_capacity_tokens}"
    assert line in default.read_text()
    small = tmp_path / "small.yaml"  # a pool of one 8-block prompt
    small.write_text(default.read_text().replace(line, f"kv_capacity_tokens: {8 * bt}"))
    near = min(SimSettings(rtt_profile="paper").rtt_ms("", r)[0] for r in SimSettings().regions)
    turns = [
        TraceRequest(0, 0.0, 8 * bt, 8, tuple(range(8)), bt, "s0"),
        TraceRequest(1, 30.0, 8 * bt, 8, tuple(range(100, 108)), bt, "s1"),
        TraceRequest(2, 60.0, 9 * bt, 8, (*range(8), 99), bt, "s0"),  # s0's next turn
    ]
    unbounded = clairvoyant_greedy_ttfts_ms(turns, "paper", str(small))
    pooled = clairvoyant_greedy_ttfts_ms(turns, "paper", str(small), pool=True)
    # every turn goes to the idle nearest backend; s1's prompt evicts s0's from its pool
    assert unbounded[2] == pytest.approx(near + prof.lone_ttft_ms(9 * bt, 8 * bt))
    assert pooled[2] == pytest.approx(near + prof.lone_ttft_ms(9 * bt))
    assert pooled[:2] == pytest.approx(unbounded[:2])
    # sticky: each session on its own home, whatever the RTT there
    regions = list(SimSettings().regions)
    rtt = {r: SimSettings(rtt_profile="paper").rtt_ms("", r)[0] for r in regions}
    sticky = clairvoyant_greedy_ttfts_ms(turns, "paper", spill_ms=math.inf)
    for r, ttft in zip(turns, sticky, strict=True):
        home = regions[zlib.crc32(r.session.encode()) % len(regions)]
        cached = 8 * bt if r.index == 2 else 0
        assert ttft == pytest.approx(rtt[home] + prof.lone_ttft_ms(r.input_tokens, cached))
    # a row reports the target over the pool reference
    row = Row(_cell([]), {p: (1000.0, 1000.0) for p in BASELINES}, 100.0, pool_ms=1000.0)
    assert row.pool_headroom == pytest.approx(0.8)
    assert blocks([replace(row, p95={**row.p95, "gorgo": (1.0, 1.0)})])[0].below_pool == 1


def test_against_peers_the_best_is_a_rival_and_the_bar_is_085(tmp_path: Path) -> None:
    """`--against peers`: the rivals' simulated rules run in the cell, the floors still
    bound every one of them, and meets/headroom use 0.85."""
    baselines, target = AGAINST["peers"]
    assert target == 0.85 and "dynamo_kv" in baselines and "least_request" not in baselines
    reqs = window(read_trace(SLICE), limit=60)
    (row,) = run_cells(
        [_cell(reqs, "open", 0.5)],
        [*baselines, "gorgo"],
        tmp_path,
        baselines=baselines,
        target_ttft=target,
    )
    assert row.best_ttft[0] in baselines and row.best_e2e[0] in baselines
    for p in baselines:
        assert row.burst_floor_ms <= row.p95[p][0], p
    assert row.headroom == pytest.approx(0.85 * row.best_ttft[1] / row.floor_ms)
    t, e = row.ratios("gorgo")
    assert row.meets == (t <= 0.85 and e <= 1.0)
    assert "0.85 x best baseline / floor" in markdown([row])
