"""The P/D knobs' study (loadgen/bench/tuner/knobs.py): its fixed runs, a tuned run that
moves only the knobs, and the verdict against the best fixed pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.bench.tuner.knobs import (
    GRID_MARGINS,
    GRID_THRESHOLDS,
    STARTS,
    WITHIN,
    KnobPoint,
    KnobStudy,
    TunedRun,
    fixed,
    report,
    tuned,
)
from loadgen.sim.settings import SimSettings
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import window

SLICE = Path(__file__).resolve().parents[5] / "loadgen/data/mooncake-conversation-head400.jsonl"
BASE = SimSettings(time_scale=3.0, pd=True, pd_protocol="vllm", kv_link_gbps=100.0)


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return window(read_trace(SLICE), limit=150)


def test_a_tuned_run_moves_the_knobs_from_its_start_and_not_the_weights(
    trace: list[TraceRequest],
) -> None:
    router = tuned(trace, BASE, STARTS[1], seed=0)
    knobs, weights = router.pair_tuner, router.tuner
    assert knobs is not None and weights is not None
    assert weights.state.frozen and weights.state.parent == (1.0, 1.0)
    assert knobs.state.samples > 100  # every request of the P/D fleet scored its arm
    assert knobs.state.history[0]["parent"] == STARTS[1]


def test_the_knobs_change_where_prompts_are_prefilled(trace: list[TraceRequest]) -> None:
    free = fixed(trace, BASE, STARTS[0], [0])
    none = fixed(trace, BASE, STARTS[1], [0])
    assert free.remote_share > 0.05 and none.remote_share == 0.0


def test_the_verdict_is_the_final_pairs_ttft_within_10_percent_of_the_best() -> None:
    best = KnobPoint((1000.0, 1.0), 1000.0, 2000.0, 0.2)
    near = TunedRun(STARTS[0], 1, KnobPoint((900.0, 2.0), 1000.0 * (1 + WITHIN), 2000.0, 0.2), 9, 2)
    far = TunedRun(STARTS[1], 1, KnobPoint(STARTS[1], 1000.0 * (1 + WITHIN) + 1, 2000.0, 0.0), 9, 0)
    grid = [KnobPoint((t, m), 1000.0, 2000.0, 0.1) for t in GRID_THRESHOLDS for m in GRID_MARGINS]
    assert KnobStudy(grid, best, [near]).passed()
    assert not KnobStudy(grid, best, [near, far]).passed()
    text = report(KnobStudy(grid, best, [near, far]), "test")
    assert "1.100 PASS" in text and "FAIL" in text and "| 32768 | 1.00 (10%)" in text
