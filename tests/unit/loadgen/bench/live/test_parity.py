"""`gorgo bench parity`'s measurements without a live fleet (stored live results, a faked
simulator): the rows' live and simulated quantiles, the worst disagreement, the loads
recorded; and one rendered block."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loadgen.bench.live import parity as bench_live
from loadgen.bench.live.parity import (
    PARITY_END,
    PARITY_SEEDS,
    PARITY_START,
    LiveLoad,
    Parity,
    ParityRow,
    parity,
    parity_markdown,
)
from loadgen.results import RequestResult, write_result
from loadgen.sim.settings import SimSettings
from loadgen.traces.request import TraceRequest

TRACE = [TraceRequest(i, float(i), 100, 10, (i,), 512, f"s{i}") for i in range(4)]


def _results(ttft_ms: float) -> list[RequestResult]:
    return [RequestResult(f"t{i}", "b0", ttft_ms, 2 * ttft_ms, input_tokens=100) for i in range(4)]


def test_a_row_sets_the_seeds_mean_against_live() -> None:
    row = ParityRow("gorgo", "p95", 1000.0, (900.0, 1000.0, 1400.0))
    assert row.mean_ms == pytest.approx(1100.0) and row.diff == pytest.approx(0.1)
    p = Parity(4, 0.0, 60.0, 1.0, (row, ParityRow("x", "p50", 100.0, (80.0,))), (), (), 2)
    assert p.worst == pytest.approx(0.2) and not p.ok
    assert Parity(4, 0.0, 60.0, 1.0, (row,), (), (), 2).ok


def test_parity_on_stored_live_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_result(tmp_path / "parity-live-gorgo.json", _results(1000.0), {"policy": "gorgo"})
    meta = {"policy": "random", "load_before": 1.5, "load_after": 2.0}
    write_result(tmp_path / "parity-live-random.json", _results(500.0), meta)
    seeds: list[int] = []

    def simulate(trace: Any, settings: SimSettings) -> Any:
        assert settings.door_spacing_ms == bench_live.LIVE_DOOR_SPACING_MS  # live-like
        seeds.append(settings.seed)
        return SimpleNamespace(requests=_results(1000.0 + 100 * settings.seed), itl_ms=[])

    monkeypatch.setattr(bench_live, "read_trace", lambda path: TRACE)
    monkeypatch.setattr(bench_live, "simulate", simulate)
    p = parity("t", ["gorgo", "random"], 0.0, 60.0, 1.0, tmp_path, reuse_live=True)
    assert seeds == [*PARITY_SEEDS, *PARITY_SEEDS]
    assert (p.requests, [(r.policy, r.quantile) for r in p.rows]) == (
        4,
        [("gorgo", "p50"), ("gorgo", "p95"), ("random", "p50"), ("random", "p95")],
    )
    gorgo, _, rnd, _ = p.rows
    assert gorgo.live_ms == 1000.0 and gorgo.sim_ms == (1000.0, 1100.0, 1200.0, 1300.0, 1400.0)
    assert gorgo.diff == pytest.approx(0.2) and rnd.diff == pytest.approx(1.4)
    assert p.worst == pytest.approx(1.4) and not p.ok
    assert [label for label, _ in p.runs] == [
        "gorgo live",
        "gorgo simulated (seed 0)",
        "random live",
        "random simulated (seed 0)",
    ]
    assert p.loads == (LiveLoad("random", 1.5, 2.0),)  # gorgo's run recorded none
    assert (tmp_path / "parity-sim-random-seed4.json").is_file()


def test_the_block_renders_rows_loads_and_the_worst() -> None:
    row = ParityRow("gorgo", "p95", 1000.0, (900.0, 1000.0, 1400.0))
    md = parity_markdown(Parity(4, 10.0, 60.0, 2.0, (row,), (), (LiveLoad("gorgo", 1.5, 2),), 2))
    assert md.startswith(PARITY_START) and md.endswith(PARITY_END)
    assert "4 requests of the conversation trace (10-70 s)" in md
    assert "| gorgo | TTFT p95 | 1000 | 1100 (900-1400) | +10.0% |" in md
    assert "gorgo live: 1-minute load average 1.5 before, 2 after (2 cores)." in md
    assert "Largest disagreement: 10.0%." in md
