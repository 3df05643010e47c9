"""The tuner bench's pieces: de-noised static scores, the bad start, the regime change's
trace, and the false-accept measurement."""

import random
from dataclasses import replace
from typing import Any

import pytest

from ext_proc.learn.settings import TunerSettings
from ext_proc.vocab.types import Weights
from loadgen.bench.tuner import regime as bench_regime
from loadgen.bench.tuner import study as bench_tuner
from loadgen.bench.tuner.regime import (
    RegimeChange,
    RegimeRun,
    RegimeSeed,
    RegimeStudy,
    changed_trace,
)
from loadgen.bench.tuner.report import regime_markdown
from loadgen.bench.tuner.study import GridPoint, StaticScores, false_accept_rate, worst_corner
from loadgen.traces.request import TraceRequest


def test_static_scores_average_seeds_and_cache_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Weights, int]] = []

    def fake_run(
        trace: Any, ts: float, w: Weights, seed: int = 0, base: Any = None
    ) -> dict[str, Any]:
        calls.append((w, seed))
        return {"ttft_ms": {"p95": 100.0 * (seed + 1)}, "e2e_ms": {"p95": 1000.0 + seed}}

    monkeypatch.setattr(bench_tuner, "static_run", fake_run)
    scores = StaticScores([], 3.0)
    p = scores((2.0, 0.5), (0, 1, 2))
    assert (p.ttft_p95_ms, p.e2e_p95_ms) == (200.0, 1001.0)  # means over the seeds
    assert scores((2.0, 0.5), (0, 1, 2)) == p and len(calls) == 3  # a parent that held
    scores((2.0, 0.5), (10,))
    assert len(calls) == 4  # other seeds are other measurements


def test_the_bad_start_is_the_worst_corner_not_the_worst_point() -> None:
    pts = [
        GridPoint(r, q, ttft, 0.0)
        for r, q, ttft in [
            (0.1, 0.1, 5.0),
            (0.1, 10.0, 7.0),
            (10.0, 0.1, 6.0),
            (10.0, 10.0, 4.0),
            (1.0, 1.0, 9.0),  # worse, but inside
        ]
    ]
    c = worst_corner(pts)
    assert (c.rtt, c.queue) == (0.1, 10.0)


def test_the_regime_change_compresses_only_the_arrivals_after_it() -> None:
    trace = [
        TraceRequest(i, float(t), 10, 10, (), 16, "s") for i, t in enumerate([0, 50, 100, 130])
    ]
    out = changed_trace(trace, RegimeChange(at_s=100.0, rate_factor=1.5))
    assert [r.arrival_s for r in out] == pytest.approx([0, 50, 100, 120])


def test_false_accepts_on_noise_stay_rare_and_an_easier_test_lets_more_through() -> None:
    rng = random.Random(0)
    pool = [
        (t, t * 3 + rng.uniform(0, 500)) for t in (rng.lognormvariate(7, 1) for _ in range(2000))
    ]
    s = replace(TunerSettings(), bootstrap=100)
    strict = false_accept_rate(pool, replace(s, confidence=0.95), rounds=300)
    loose = false_accept_rate(pool, replace(s, confidence=0.6), rounds=300)
    assert strict < 0.12 < loose


def _bowl(w: Weights, seed: int) -> dict[str, Any]:
    """A landscape with its optimum at (64, 1), and seed noise."""
    import math

    d = (math.log(w.rtt / 64) ** 2 + math.log(w.queue) ** 2) ** 0.5
    ttft = 10_000 * (1 + 0.1 * d) * (1 + 0.01 * (seed % 3))
    return {"ttft_ms": {"p95": ttft}, "e2e_ms": {"p95": 3 * ttft}}


def test_the_tuner_study_scores_tuned_points_on_fresh_seeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[int] = []

    def fake_run(
        trace: Any, ts: float, w: Weights, seed: int = 0, base: Any = None
    ) -> dict[str, Any]:
        runs.append(seed)
        return _bowl(w, seed)

    def fake_tune(
        trace: Any, ts: float, mode: str, seed: int, start: Any = (1.0, 1.0), **_: Any
    ) -> Any:
        # seed 0 reaches the optimum by 200; the others stay where they started
        at = {c: ((64.0, 1.0) if seed == 0 and c >= 200 else start) for c in (100, 200, 300)}
        h = [
            {"samples": c, "parent": w, "sigma": 0.5, "parent_p95_ms": 1.0, "child_p95_ms": 1.0}
            for c, w in at.items()
        ]
        return bench_tuner.Trajectory(mode, seed, start, at, h, at[300])

    monkeypatch.setattr(bench_tuner, "static_run", fake_run)
    monkeypatch.setattr(bench_tuner, "tune", fake_tune)
    s = bench_tuner.tuner_study([], 3.0, "test")
    assert len(s.points) == 49 and (s.best.rtt, s.best.queue) == pytest.approx((64.0, 1.0))
    assert s.best_eval.ttft_p95_ms == pytest.approx(10_100.0)  # fresh seeds 10, 11, 12
    assert s.target_ms == pytest.approx(1.05 * 10_100.0)
    assert s.reached("defaults") == [0, 1, 1] and s.reached("worst corner") == [0, 1, 1]
    seed0 = next(r for r in s.runs if (r.start, r.seed) == ("defaults", 0))
    first, later, _ = seed0.at
    assert first is not None and not first.ok and first.ratio > 1.05
    assert later is not None and later.ok and later.ratio == pytest.approx(1.0)
    assert s.tuned == Weights(64.0, 1.0)
    assert set(bench_tuner.EVAL_SEEDS) <= set(runs)  # tuned points measured on fresh seeds


def test_the_regime_study_scores_a_venue_against_its_own_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The token form's venue: frozen runs start from its defaults, the room is its own
    static points, and each seed reads tuned against frozen."""
    venue = bench_regime.PAPER_REGIME_VENUES[1]
    calls: list[tuple[str, int, Any]] = []

    def fake_run(
        trace: Any,
        ts: float,
        change: Any,
        tune: str,
        seed: int,
        weights: Any = None,
        venue: Any = None,
        **_: Any,
    ) -> RegimeRun:
        w = weights or venue.defaults
        calls.append((tune, seed, w))
        # tuned: 0.85 x frozen in seed 0, 0.95 x in seed 1; static (0.5, 0.05) is the best
        ttft = 1000.0 * ({0: 0.85, 1: 0.95}[seed] if tune != "off" else 1.0)
        if tune == "off" and w == (0.5, 0.05):
            ttft = 800.0
        return RegimeRun(tune, seed, ttft, 2000.0, w, w)

    monkeypatch.setattr(bench_regime, "regime_run", fake_run)
    s = bench_regime.regime_study(
        [], 1.0, RegimeChange(600.0), [0, 1], venue=venue, false_accepts=False, jobs=1
    )
    assert [(r.seed, r.off.ttft_p95_ms, r.on.ttft_p95_ms) for r in s.seeds] == [
        (0, 1000.0, 850.0),
        (1, 1000.0, 950.0),
    ]
    assert s.ratios == pytest.approx([0.85, 0.95]) and [r.ok for r in s.seeds] == [True, False]
    assert s.met == 1
    assert (s.room_best.rtt, s.room_best.queue, s.room_best.ttft_p95_ms) == (0.5, 0.05, 800.0)
    assert s.room_defaults.ttft_p95_ms == 1000.0 and s.room_best.e2e_p95_ms == 2000.0
    assert s.false_accept_paired is None and s.false_accept_paper is None
    assert {w for t, _, w in calls if t == "off"} == {venue.defaults, *venue.room}


def test_the_regime_table_renders_a_seed_and_the_room() -> None:
    venue = bench_regime.PAPER_REGIME_VENUES[1]
    off = RegimeRun("off", 0, 1000.0, 2000.0, (0.5, 0.1), (0.5, 0.1))
    on = RegimeRun("paired", 0, 850.0, 2000.0, (0.5, 0.1), (0.25, 0.1))
    room = (GridPoint(0.5, 0.1, 1000.0, 2100.0), GridPoint(0.5, 0.05, 800.0, 2000.0))
    s = RegimeStudy(venue, RegimeChange(600.0), 1.0, (RegimeSeed(0, off, on),), (0,), room)
    md = regime_markdown(s)
    assert "Policy `gorgo_tokens`, defaults (0.5, 0.1)" in md
    assert "| 0 | 1000 | 850 | 0.85 ok |" in md and "Target met in 1 of 1 seeds" in md
    assert "w = (0.5, 0.05): 800 ms (p95 E2E 2000 ms) against the defaults' 1000 ms" in md
    assert "False accepts" not in md


def test_a_paired_comparison_misranks_a_small_gap_often_and_a_large_one_rarely() -> None:
    """misranked: two static runs' TTFTs by id; each draw puts one arm's requests on one
    run and the other's on the other, and compares the arms' p95."""
    rng = random.Random(0)
    trace = [TraceRequest(i, float(i), 10, 10, (), 16, f"s{i}") for i in range(6000)]
    base = {r.id: rng.lognormvariate(6.5, 0.6) for r in trace}
    same = bench_tuner.misranked(trace, base, base, 150, draws=400)
    slightly = bench_tuner.misranked(trace, base, {k: v * 1.05 for k, v in base.items()}, 150)
    much = bench_tuner.misranked(trace, base, {k: v * 1.5 for k, v in base.items()}, 150)
    assert 0.3 < same < 0.7  # the same run: a coin flip, both arms holding other requests
    assert 0.15 < slightly < 0.5  # 5 % worse: still ranked better often
    assert much < 0.02  # 50 % worse: nearly never
    # more samples per arm resolve the small gap better
    assert (
        bench_tuner.misranked(trace, base, {k: v * 1.05 for k, v in base.items()}, 1000) < slightly
    )
