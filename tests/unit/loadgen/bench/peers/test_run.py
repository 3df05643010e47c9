"""The pure parts of `gorgo bench peers` (loadgen/bench/peers/): the rounds' order,
the repeats' median, gorgo's ratio to the best rival, the options' checks, session headers;
with --pd, which fronts run on which protocol's twins, the ratios per protocol and where
the legs went (from the twins' /stats)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from emulator.rivals.fronts import FRONTS
from loadgen.bench.peers.classes import class_headers, classed, scheduler_metrics, smg_class_of
from loadgen.bench.peers.pd import pd_legs
from loadgen.bench.peers.run import Entry, RivalsOptions, order, session_headers
from loadgen.bench.peers.summary import FrontRun, failures, median_summary, pd_ratios, ratios
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


def test_pd_options_pair_each_front_with_the_protocol_it_speaks() -> None:
    fronts = ("gorgo", "smg:pd", "vllm-router:pd")
    both = RivalsOptions("t", fronts=fronts, pd=True, kv_link_gbps=10.0)
    assert both.problems() == []
    # gorgo beside each rival on the rival's protocol
    assert both.entries() == [
        Entry("gorgo@sglang", "gorgo", "sglang"),
        Entry("gorgo@vllm", "gorgo", "vllm"),
        Entry("smg:pd", "smg:pd", "sglang"),
        Entry("vllm-router:pd", "vllm-router:pd", "vllm"),
    ]
    one = RivalsOptions("t", fronts=("gorgo", "smg:pd"), pd=True, pd_protocol="sglang")
    assert one.problems() == []
    assert [(e.key, e.protocol) for e in one.entries()] == [
        ("gorgo", "sglang"),
        ("smg:pd", "sglang"),
    ]
    on_vllm = RivalsOptions("t", fronts=("gorgo", "vllm-router:pd"), pd=True, pd_protocol="vllm")
    assert [(e.key, e.protocol) for e in on_vllm.entries()] == [
        ("gorgo", "vllm"),
        ("vllm-router:pd", "vllm"),
    ]
    alone = RivalsOptions("t", fronts=("gorgo",), pd=True)
    assert alone.entries() == [Entry("gorgo", "gorgo", "sglang")]  # the stack's default
    assert RivalsOptions("t", fronts=("gorgo", "smg:cache_aware")).entries()[1].protocol is None


def test_pd_option_mismatches_are_named() -> None:
    def problems(**kw: object) -> str:
        return " | ".join(RivalsOptions("t", **kw).problems())  # type: ignore[arg-type]

    got = problems(fronts=("gorgo", "smg:pd"), pd=True, pd_protocol="vllm")
    assert "smg:pd speaks sglang's P/D protocol only, not --pd-protocol vllm" in got
    got = problems(fronts=("vllm-router:pd",), pd=True, pd_protocol="sglang")
    assert "vllm-router:pd speaks vllm's P/D protocol only, not --pd-protocol sglang" in got
    assert "smg:pd is a P/D front: add --pd" in problems(fronts=("gorgo", "smg:pd"))
    got = problems(fronts=("gorgo", "smg:cache_aware"), pd=True)
    assert "smg:cache_aware routes aggregated engines" in got and "vllm-router:pd" in got
    assert "go with --pd" in problems(pd_protocol="vllm")
    assert "go with --pd" in problems(kv_link_gbps=5.0)
    assert "--pd-protocol must be one of" in problems(fronts=("gorgo",), pd=True, pd_protocol="x")
    assert "--kv-link-gbps must be >= 0" in problems(fronts=("gorgo",), pd=True, kv_link_gbps=-1.0)
    assert "--classes" in problems(fronts=("gorgo",), pd=True, classes=str(CLASSES))


def test_pd_ratios_compare_gorgo_with_the_rivals_on_its_own_protocol() -> None:
    def s(ttft: float, e2e: float) -> dict[str, dict[str, float]]:
        return {"ttft_ms": {"p95": ttft}, "e2e_ms": {"p95": e2e}}

    fronts = {
        "gorgo@sglang": s(80.0, 300.0),
        "gorgo@vllm": s(50.0, 100.0),
        "smg:pd": s(100.0, 300.0),
        "vllm-router:pd": s(40.0, 200.0),  # best overall, but on the other protocol
    }
    protocol = {"gorgo@sglang": "sglang", "gorgo@vllm": "vllm", "smg:pd": "sglang"}
    got = pd_ratios(fronts, {**protocol, "vllm-router:pd": "vllm"})
    assert got["by_protocol"] == {
        "sglang": {"ttft_ms_p95_vs_best_peer": 0.8, "e2e_ms_p95_vs_best_peer": 1.0},
        "vllm": {"ttft_ms_p95_vs_best_peer": 1.25, "e2e_ms_p95_vs_best_peer": 0.5},
    }
    # the headline: the larger of each figure over the protocols
    assert (got["ttft_ms_p95_vs_best_peer"], got["e2e_ms_p95_vs_best_peer"]) == (1.25, 1.0)
    # one protocol: gorgo as plain "gorgo"
    one = pd_ratios({"gorgo": s(80.0, 300.0), "smg:pd": s(100.0, 300.0)},
                    {"gorgo": "sglang", "smg:pd": "sglang"})  # fmt: skip
    assert one["ttft_ms_p95_vs_best_peer"] == 0.8 and list(one["by_protocol"]) == ["sglang"]
    assert pd_ratios({"gorgo": s(1.0, 1.0)}, {"gorgo": "sglang"}) == {}


class _Stack:
    """What pd_legs reads of a stack: its settings (regions, the P/D layout)."""

    def __init__(self) -> None:
        from emulator.stack.pd import PdLayout, PdSettings
        from emulator.stack.settings import DEFAULT_REGIONS, StackSettings

        pd = PdSettings(ports=list(range(23001, 23001 + PdLayout.size(2))))
        self.settings = StackSettings(regions=DEFAULT_REGIONS[:2], pd=pd)


def test_pd_legs_count_each_twins_legs_and_the_pairs_across_regions() -> None:
    stack = _Stack()
    pd = stack.settings.pd_layout()
    ash, fra = pd.advertised(0), pd.advertised(1)
    stats = [
        {"name": "us-ashburn", "completed_total": 5, "kv_received_from": {ash: 3, fra: 1}},
        {"name": "eu-frankfurt", "completed_total": 2, "kv_received_from": {ash: 2}},
        {"name": "us-ashburn-prefill", "completed_total": 5},
        {"name": "eu-frankfurt-prefill", "completed_total": 1},
    ]
    legs = pd_legs(stack, stats)  # type: ignore[arg-type]
    assert legs == {
        "prefill": {"us-ashburn-prefill": 5, "eu-frankfurt-prefill": 1},
        "decode": {"us-ashburn": 5, "eu-frankfurt": 2},
        "pairs": {
            "eu-frankfurt->us-ashburn": 1,
            "us-ashburn->eu-frankfurt": 2,
            "us-ashburn->us-ashburn": 3,
        },
        "paired": 6,
        "cross_region": 3,
        "whole": 1,  # a decode served without a transfer (a vLLM decode engine whole)
    }
