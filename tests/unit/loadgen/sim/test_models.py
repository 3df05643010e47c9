"""Many models in the simulator (issue 28): traces carrying a model per request, the
two-models preset, engines serving the fleet file's models and adapters (each its own
cache), the router told what each serves, refusals counted, and every policy given only
the backends serving the request's model."""

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from emulator.stack.fleet import NO_FLEET, fleet_from_dict, load_fleet
from loadgen.client.protocol import Protocol
from loadgen.results import summarize
from loadgen.sim.models import DEFAULT_MODEL, served_models
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import simulate
from loadgen.traces.load import load_trace
from loadgen.traces.models import assign_models, model_of
from loadgen.traces.readers import read_mooncake, write_mooncake
from loadgen.traces.request import TraceError, TraceRequest
from loadgen.traces.synthetic import synthetic

ROOT = Path(__file__).resolve().parents[4]
FLEET_FILE = ROOT / "loadgen/data/fleets/two-models.yaml"
REGIONS = SimSettings().regions


@pytest.fixture(scope="module")
def fleet():  # type: ignore[no-untyped-def]
    return load_fleet(FLEET_FILE, REGIONS)


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return assign_models(
        synthetic(sessions=40, turns=3, rate_rps=2.0, system_tokens=512, turn_tokens=800)
    )


def _row(ts: int, **extra: object) -> str:
    return json.dumps({"timestamp": ts, "input_length": 600, "output_length": 8, **extra})


def test_mooncake_rows_may_name_a_model(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(_row(0, hash_ids=[0, 1], model="alpha") + "\n" + _row(5, hash_ids=[0, 2]) + "\n")
    trace = read_mooncake(p)
    assert [r.model for r in trace] == ["alpha", None]
    again = read_mooncake(write_mooncake(tmp_path / "again.jsonl", trace))
    assert [r.model for r in again] == ["alpha", None]
    p.write_text(_row(0, hash_ids=[0, 1], model="") + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1: 'model' must be a non-empty string"):
        read_mooncake(p)


def test_two_models_preset_gives_a_conversation_one_model(tmp_path: Path) -> None:
    p = write_mooncake(tmp_path / "t.jsonl", synthetic(sessions=60, turns=3))
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    rows[0]["model"] = "gamma"  # a row's own model stays
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(f"two-models:{p}")
    assert trace[0].model == "gamma"
    per_session: dict[str, set[str | None]] = {}
    for r in trace[1:]:
        per_session.setdefault(r.session, set()).add(r.model)
    assert all(len(models) == 1 for models in per_session.values())
    counts = Counter(m for ms in per_session.values() for m in ms)
    assert set(counts) == {"alpha", "beta"} and min(counts.values()) >= 10
    assert model_of("s1", (("alpha", 1.0), ("beta", 0.0))) == "alpha"


def test_engines_serve_the_fleet_files_models() -> None:
    fleet = load_fleet(FLEET_FILE, REGIONS)
    ashburn = served_models(fleet, "us-ashburn")
    assert ashburn.base == {"alpha"} and dict(ashburn.adapters) == {"beta": "alpha"}
    assert served_models(fleet, "ap-seoul").base == {"beta"}
    assert served_models(NO_FLEET, "ap-seoul").base == {DEFAULT_MODEL}


@pytest.mark.parametrize(
    "policy", ["least_request", "prefix_cache", "session_affinity", "round_robin", "gorgo"]
)
def test_a_policy_only_sends_a_model_where_it_is_served(policy, fleet, trace) -> None:  # type: ignore[no-untyped-def]
    res = simulate(trace, SimSettings(policy=policy, time_scale=1.0, fleet=fleet))
    serves = {r: served_models(fleet, r) for r in REGIONS}
    assert all(r.status == "ok" for r in res.requests) and not res.refused
    used = Counter((t.model, r.backend) for t, r in zip(trace, res.requests, strict=True))
    assert all(serves[b].serves(m) for m, b in used)  # type: ignore[arg-type]
    # the router was told, as discovery tells it
    assert res.router.backends["eu-frankfurt"].models == serves["eu-frankfurt"]


def test_precise_prefix_state_with_models(fleet, trace) -> None:  # type: ignore[no-untyped-def]
    s = SimSettings(policy="gorgo", time_scale=1.0, fleet=fleet, prefix_state="precise")
    res = simulate(trace, s)
    assert all(r.status == "ok" for r in res.requests)
    assert summarize(res.requests)["cache_hit_rate"] > 0.1


def _same_prompt(models: list[str | None]) -> list[TraceRequest]:
    """Identical prompts 2 s apart, one per model."""
    return [
        TraceRequest(i, 2.0 * i, 2048, 4, (1, 2, 3, 4), 512, f"s{i}", model=m)
        for i, m in enumerate(models)
    ]


def test_an_adapter_has_its_own_cache_on_a_shared_engine() -> None:
    # only us-ashburn serves alpha and its adapter beta
    raw = {
        "backends": [
            {"id": "us-ashburn", "model": "alpha", "lora_modules": ["beta"]},
            {"id": "eu-frankfurt", "model": "other"},
            {"id": "ap-seoul", "model": "other"},
        ]
    }
    fleet = fleet_from_dict(raw, REGIONS)
    res = simulate(_same_prompt(["alpha", "beta", "beta", "alpha"]), SimSettings(fleet=fleet))
    assert [r.backend for r in res.requests] == ["us-ashburn"] * 4
    cached = [r.cached_tokens for r in res.requests]
    assert cached[0] == 0 and cached[1] == 0  # beta: no hit on alpha's blocks
    assert cached[2] > 0 and cached[3] > 0
    # without models in the fleet, the same prompts share the cache as before
    res = simulate(_same_prompt([None, None]), SimSettings(policy="round_robin"))
    assert [r.status for r in res.requests] == ["ok", "ok"]


@pytest.mark.parametrize("cap", [None, 1])
def test_refused_requests_are_counted_not_fatal(fleet, cap) -> None:  # type: ignore[no-untyped-def]
    trace = _same_prompt(["alpha", "gamma", None, "beta"])
    s = SimSettings(fleet=fleet, protocol=Protocol(max_concurrency=cap))
    res = simulate(trace, s)
    assert res.refused == {400: 1, 404: 1}
    assert [r.status for r in res.requests] == ["ok", "refused", "refused", "ok"]
    assert res.requests[1].error.startswith("HTTP 404 model_not_found: Model 'gamma' not found")
    assert res.requests[1].backend == "" and res.requests[1].ttft_ms is None
    summary = summarize(res.requests)
    assert summary["refused"] == {"400": 1, "404": 1} and summary["errors"] == 2
    assert summary["ttft_ms"]["p95"] is not None


def test_a_trace_without_models_runs_as_before() -> None:
    trace = synthetic(sessions=10, turns=2)
    a = simulate(trace, SimSettings(policy="gorgo"))
    b = simulate([replace(r, model=None) for r in trace], SimSettings(policy="gorgo"))
    assert [(r.backend, r.ttft_ms) for r in a.requests] == [
        (r.backend, r.ttft_ms) for r in b.requests
    ]
    assert not a.refused


def test_bench_models_report_judges_gorgo_against_the_best_baseline() -> None:
    from loadgen.bench.sim.models import Run, report

    runs = [
        Run(0.0, 3.0, "gorgo", 10, 900.0, 2000.0, 0, 0),
        Run(0.0, 3.0, "least_load", 10, 1000.0, 2500.0, 0, 0),
        Run(0.0, 3.0, "prefix_cache", 10, 1200.0, 1900.0, 0, 0),
        Run(0.0, 4.0, "gorgo", 10, 700.0, 1000.0, 0, 0),
        Run(0.0, 4.0, "least_load", 10, 800.0, 1000.0, 0, 0),
    ]
    text = report(runs)
    assert "| 0-1200 s | 3 | 900 / 1,000 (least_load) | 0.90 | 2,000 / 1,900 (prefix_cache)" in text
    assert "| 1.05 | FAIL |" in text and "| 1.00 | PASS |" in text
    assert text.endswith("1 / 2 cells")
