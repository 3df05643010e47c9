"""The pure parts of `gorgo bench peers` (loadgen/bench/live/rivals.py): the rounds' order,
the repeats' median, gorgo's ratio to the best rival, the options' checks, session headers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from emulator.rivals.fronts import FRONTS
from loadgen.bench.live.rivals import (
    FrontRun,
    RivalsOptions,
    class_headers,
    classed,
    failures,
    median_summary,
    order,
    ratios,
    scheduler_metrics,
    session_headers,
    smg_class_of,
)
from loadgen.results import RequestResult
from loadgen.sim.classes import Classes, class_summary, classes_from_dict, load_classes
from loadgen.traces.request import TraceRequest

CLASSES = Path(__file__).resolve().parents[5] / "loadgen/data/classes/interactive-batch.yaml"


def _results(ttfts: list[float], errors: int = 0) -> list[RequestResult]:
    rows = [
        RequestResult(
            id=f"r{i}",
            backend="b",
            ttft_ms=t,
            e2e_ms=2 * t,
            input_tokens=100,
            output_tokens=10,
            cached_tokens=25,
            status="ok",
            error="",
            itl_ms=[],
        )
        for i, t in enumerate(ttfts)
    ]
    rows += [
        RequestResult(
            id=f"e{i}",
            backend="",
            ttft_ms=None,
            e2e_ms=None,
            input_tokens=0,
            output_tokens=0,
            cached_tokens=0,
            status="error",
            error="HTTP 503",
            itl_ms=[],
        )
        for i in range(errors)
    ]
    return rows


def test_rounds_alternate_their_order() -> None:
    assert order(["gorgo", "a", "b"], 3) == [
        ["gorgo", "a", "b"],
        ["b", "a", "gorgo"],
        ["gorgo", "a", "b"],
    ]


def test_the_summary_takes_the_repeats_median_and_keeps_their_spread() -> None:
    runs = [
        FrontRun("gorgo", _results([100.0] * 20), cpu_s=0.2, peak_rss_mb=150, wall_s=1),
        FrontRun("gorgo", _results([300.0] * 20, errors=1), cpu_s=0.4, peak_rss_mb=170, wall_s=1),
        FrontRun("gorgo", _results([200.0] * 20), cpu_s=0.3, peak_rss_mb=160, wall_s=1),
    ]
    s = median_summary(runs)
    assert s["ttft_ms"]["p95"] == 200.0
    assert s["e2e_ms"]["p95"] == 400.0
    assert s["spread"]["ttft_ms"]["p95"] == [100.0, 300.0]
    assert (s["runs"], s["errors_total"], s["requests_total"]) == (3, 1, 61)
    assert s["router_cpu_ms_per_request"] == round(0.9e3 / 61, 3)
    assert s["router_peak_rss_mb"] == 170
    assert s["cache_hit_rate"] == 0.25
    assert s["failures"] == {"HTTP 503": 1}


def test_gorgo_is_compared_with_the_lowest_rival_of_each_figure() -> None:
    fronts = {
        "gorgo": {"ttft_ms": {"p95": 80.0}, "e2e_ms": {"p95": 300.0}},
        "smg:cache_aware": {"ttft_ms": {"p95": 100.0}, "e2e_ms": {"p95": 200.0}},
        "vllm-router:cache_aware": {"ttft_ms": {"p95": 160.0}, "e2e_ms": {"p95": 150.0}},
    }
    assert ratios(fronts) == {"ttft_ms_p95_vs_best_peer": 0.8, "e2e_ms_p95_vs_best_peer": 2.0}
    assert ratios({"gorgo": fronts["gorgo"]}) == {}


def test_bad_options_are_named() -> None:
    bad = RivalsOptions("t", fronts=("gorgo", "smg:nope", "gorgo"), rtt_profile="moon", repeat=0)
    problems = " | ".join(bad.problems())
    for part in ("smg:nope", "names one twice", "--rtt-profile", "--repeat"):
        assert part in problems
    assert RivalsOptions("t", rtt_profile="single").problems() == []


def test_a_front_gets_its_own_session_header_only_when_the_replay_lacks_it() -> None:
    row = TraceRequest(1, 0.0, 10, 1, (7,), 512, "s7")
    hashing = session_headers(FRONTS["smg:consistent_hashing"])
    assert hashing is not None and dict(hashing(row)) == {"x-smg-routing-key": "s7"}
    assert session_headers(FRONTS["vllm-router:sticky_least_loaded"]) is None  # x-session-id
    assert session_headers(FRONTS["smg:cache_aware"]) is None
    assert session_headers(None) is None


def _classes() -> Classes:
    return load_classes(CLASSES)


def test_objectives_map_to_smg_classes_by_rank() -> None:
    assert smg_class_of(_classes()) == {"interactive": "interactive", "batch": "bulk"}
    three = classes_from_dict(
        {
            "objectives": [
                {"name": "low", "share": 1, "priority": -5},
                {"name": "mid", "share": 1, "priority": 0},
                {"name": "high", "share": 1, "priority": 9},
            ]
        }
    )
    assert smg_class_of(three) == {"low": "bulk", "mid": "default", "high": "interactive"}


def test_each_front_is_told_the_class_its_own_way() -> None:
    c = _classes()
    rows = [TraceRequest(i, 0.0, 10, 1, (i,), 512, f"s{i}") for i in range(40)]
    gorgo = class_headers(None, c)
    smg = class_headers(FRONTS["smg:cache_aware"], c)
    vllm = class_headers(FRONTS["vllm-router:cache_aware"], c)
    seen = set()
    for r in rows:
        objective = c.objective_of(r.session)
        seen.add(objective)
        assert dict(gorgo(r)) == {"x-gorgo-objective": objective}
        want = "interactive" if objective == "interactive" else "bulk"
        assert dict(smg(r)) == {"x-smg-priority": want}
        assert dict(vllm(r)) == {}
    assert seen == {"interactive", "batch"}


def test_scheduler_metrics_keep_the_non_zero_scheduler_series() -> None:
    text = "\n".join(
        [
            "# HELP smg_scheduler_admitted_total admitted",
            'smg_scheduler_admitted_total{class="interactive"} 12',
            'smg_scheduler_admitted_total{class="bulk"} 0',
            'smg_http_requests_total{path="/v1/chat/completions"} 40',
            "smg_scheduler_queue_depth 3",
        ]
    )
    assert scheduler_metrics(text) == {
        'smg_scheduler_admitted_total{class="interactive"}': 12.0,
        "smg_scheduler_queue_depth": 3.0,
    }


def test_refusals_are_not_failures_with_classes() -> None:
    rows = _results([100.0] * 98)
    rows.append(replace(rows[0], id="x", status="error", error="HTTP 429: rejected-slo"))
    rows.append(replace(rows[0], id="y", status="error", error="HTTP 503"))
    run = FrontRun("gorgo", rows, cpu_s=0, peak_rss_mb=0, wall_s=1)
    assert failures([run]) == 2
    assert failures([run], refusals_allowed=True) == 1


def test_results_get_their_sessions_class_for_the_class_summary() -> None:
    c = _classes()
    trace = [TraceRequest(i, 0.0, 10, 1, (i,), 512, f"s{i}") for i in range(30)]
    rows = [replace(_results([100.0])[0], id=r.id) for r in trace]
    got = classed(rows, trace, c)
    assert [x.objective for x in got] == [c.objective_of(r.session) for r in trace]
    summary = class_summary(got, c)
    assert set(summary["objectives"]) == {"interactive", "batch"}
    assert summary["goodput"] == 1.0
