"""`gorgo bench results`' computed parts without simulating: a window's ranking, and the
paper's experiment (faked runs) into its study: Table 2's rows with the paper's beside
ours, the weights tuned online and frozen after, Table 3's rows; and one rendered section."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ext_proc.vocab.types import Weights
from loadgen.bench.results import Ranking, ranking, ranking_line
from loadgen.bench.sim import paper as bench_paper
from loadgen.bench.sim.paper import (
    PAPER_TABLE2,
    PAPER_TABLE3,
    SWEEP_POLICIES,
    PaperCell,
    PaperStudy,
    PaperWindow,
    SweepRow,
    paper_markdown,
    paper_study,
)
from loadgen.results import RequestResult, summarize
from loadgen.sim.settings import SimSettings
from loadgen.traces import synthetic


def _summary(ttft_ms: float, e2e_ms: float) -> dict[str, Any]:
    return summarize([RequestResult("t", "b", ttft_ms, e2e_ms, slip_ms=5.0)])


def test_the_ranking_names_the_lowest_ttft_and_gorgos_e2e_against_the_best() -> None:
    summaries = {
        ("least_request", 3.0): _summary(900.0, 5000.0),
        ("gorgo", 3.0): _summary(1000.0, 4400.0),
        ("random", 3.0): _summary(2000.0, 4000.0),
    }
    r = ranking(summaries)
    assert r.best_ttft == "least_request"
    assert r.e2e_vs_best == pytest.approx({"gorgo": 0.1})
    summaries[("gorgo (tuned, frozen)", 3.0)] = _summary(800.0, 3000.0)
    r = ranking(summaries)
    assert r.best_ttft == "gorgo (tuned, frozen)"
    assert r.e2e_vs_best == pytest.approx({"gorgo": 4400 / 3000 - 1, "gorgo (tuned, frozen)": 0})


def test_the_paper_study_sets_the_papers_rows_beside_ours(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def run_simulations(
        trace: Any, policies: Any, scales: Any, d: Path, base: SimSettings, label: str = ""
    ) -> dict[tuple[str, float], dict[str, Any]]:
        assert base.protocol.max_concurrency == 64  # the paper's protocol
        return {(p, ts): _summary(1000.0 * ts, 4000.0 * ts) for ts in scales for p in policies}

    frozen: list[Any] = []

    def simulate(trace: Any, settings: SimSettings, progress: Any = None) -> Any:
        if settings.tune == "off":
            frozen.append(settings.router["policies"]["gorgo"]["weights"])
        tuner = SimpleNamespace(state=SimpleNamespace(parent=(0.3, 0.45), history=[{"n": 1}]))
        requests = [RequestResult("t", "b", 500.0, 2000.0, slip_ms=1.0)]
        return SimpleNamespace(requests=requests, itl_ms=[], router=SimpleNamespace(tuner=tuner))

    monkeypatch.setattr(bench_paper, "run_simulations", run_simulations)
    monkeypatch.setattr(bench_paper, "simulate", simulate)
    monkeypatch.setattr(synthetic, "paper_synthetic", lambda seed: [])
    s = paper_study(("gorgo", "least_request"), tmp_path)
    assert s.tuned == Weights(0.3, 0.45) and s.history == ({"n": 1},)
    assert frozen == [{"rtt": 0.3, "queue": 0.45}] * 2  # both held-out windows
    assert [(w.name, w.seed, w.time_scale) for w in s.windows] == [
        ("tuning", 0, 1.0),
        ("held-out", 1, 2.0),
        ("held-out", 2, 3.0),
    ]
    tuning, held_out, _ = s.windows
    assert [c.policy for c in tuning.cells] == ["gorgo", "least_request", "gorgo (tuning online)"]
    gorgo, lr, online = tuning.cells
    assert gorgo == PaperCell("gorgo", 1000.0, 4.0, 5.0, None)  # the paper's row is the tuned one
    assert lr.paper == PAPER_TABLE2[("tuning", 1.0)]["least_request"]
    assert online == PaperCell("gorgo (tuning online)", 500.0, 2.0, 1.0, (2514, 8.91))
    assert held_out.cells[-1].policy == "gorgo (tuned, frozen)"
    assert held_out.cells[-1].paper == PAPER_TABLE2[("held-out", 2.0)]["gorgo"]
    assert [r.time_scale for r in s.sweep] == sorted(PAPER_TABLE3)
    assert s.sweep[1].ours == {p: (2000.0, 8.0) for p in SWEEP_POLICIES}
    assert s.sweep[1].paper == PAPER_TABLE3[2.0]


def test_the_paper_section_and_a_ranking_render() -> None:
    cells = (PaperCell("gorgo", 1234.4, 5.678, 9.6, None), PaperCell("lr", 1.0, 2.0, 0.0, (3, 4)))
    sweep = SweepRow(2.0, {p: (10.0, 1.0) for p in SWEEP_POLICIES}, PAPER_TABLE3[2.0])
    md = paper_markdown(PaperStudy((PaperWindow("tuning", 0, 1.0, cells),), None, (), (sweep,)))
    assert "| tuning, ts 1 | gorgo | 1234 / 5.68 | 10 | - |\n| tuning, ts 1 | lr |" in md
    assert "| lr | 1 / 2.00 | 0 | 3 / 4.00 |\n\n## Table 3" in md  # no tuned weights
    assert "| 2 | 10 / 1.00 | 10 / 1.00 | 10 / 1.00 | 1822 / 5.65 | 1707 / 15.50 |" in md
    assert ranking_line(Ranking("random", {"gorgo": 0.123})) == (
        "Lowest p95 TTFT: **random**. gorgo: p95 E2E +12.3% against the best p95 E2E of the "
        "window.\n"
    )
