"""`gorgo check`'s judgement of a look at the fleet, on looks made here: each problem's fix
names the key or flag for the engine and mode at hand, and the notes are not problems."""

from __future__ import annotations

from typing import Any

from ext_proc.config.load import config_from_dict
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.served_models import ServedModels
from ext_proc.service.check.judge import judge
from ext_proc.service.check.kv import KvLook
from ext_proc.service.check.probes import BackendLook, Look, TokenizerLook, TokensLook

REPORT = EngineReport(waiting=1.0, running=2.0, kv_usage=0.1, kv_capacity_tokens=1000)


# A tokenizer at hand (the judge only asks whether there is one).
AT_HAND = TokenizerLook("config", "tokenizer.json", engine=object())  # type: ignore[arg-type]


def look_of(
    raw: dict[str, Any], tokenizer: TokenizerLook | None = None, **per_backend: Any
) -> tuple[Any, Look]:
    """The config, and a look where every backend answered well unless told otherwise."""
    cfg = config_from_dict(raw)
    looks = []
    for i, b in enumerate(cfg.backends):
        fields: dict[str, Any] = {
            "models": ServedModels(frozenset({"m"})),
            "served": ("m", ""),
            "rtt_ms": [1.0, 2.0, 3.0],
            "metrics": REPORT,
            "tokens": TokensLook(False, "4 bytes per token: none"),
            **per_backend.get(b.id, {}),
        }
        looks.append(BackendLook(i, b, **fields))
    return cfg, Look(looks, tokenizer or TokenizerLook("", not_found="none"), 1.0)


def one(raw: dict[str, Any], tokenizer: TokenizerLook | None = None, **per_backend: Any) -> str:
    cfg, look = look_of(raw, tokenizer, **per_backend)
    (problem,) = judge(cfg, look).problems
    return problem.line()


A = {"id": "a", "address": "10.0.0.1:8000"}


def test_all_well_with_notes_for_what_the_config_leaves_approximate() -> None:
    cfg, look = look_of({"backends": [A]})
    verdict = judge(cfg, look)
    assert verdict.problems == [] and verdict.exit_code == 0
    assert len(verdict.notes) == 2  # tokens approximated, prefix the router's own
    (b,) = verdict.backends
    assert (b.prefix.precise, b.tokens.precise, b.queue.precise) == (False, False, True)
    assert b.rtt_ms == 2.0 and b.models == ["m"]


def test_vllm_without_metrics_is_told_to_check_the_engine_not_a_flag() -> None:
    line = one(
        {"backends": [{**A, "engine": "vllm"}]},
        a={"metrics": None, "metrics_missing": True, "metrics_error": "HTTP 404"},
    )
    assert line.startswith("backend a: http://10.0.0.1:8000/metrics answers 404. Fix: vLLM")
    assert "check backends[0].engine" in line


def test_metrics_off_is_an_estimate_by_choice_not_a_problem() -> None:
    cfg, look = look_of({"backends": [A], "probes": {"metrics_interval_s": 0}}, a={"metrics": None})
    verdict = judge(cfg, look)
    assert verdict.problems == []
    assert verdict.backends[0].queue.how == (
        "the router's own estimate (probes.metrics_interval_s is 0)"
    )


def test_an_engine_that_does_not_report_its_kv_pool_is_a_note() -> None:
    report = EngineReport(waiting=0.0, running=0.0, kv_usage=None)
    cfg, look = look_of({"backends": [A]}, a={"metrics": report})
    verdict = judge(cfg, look)
    assert verdict.problems == []
    assert any("set backends[0].kv_capacity_tokens" in n for n in verdict.notes)


def test_a_kv_endpoint_in_bind_mode_tells_the_engine_to_connect_to_the_router() -> None:
    raw = {"backends": [{**A, "kv_events": {"endpoint": "tcp://*:5557", "mode": "bind"}}]}
    kv = [KvLook(0, "tcp://*:5557", True, "no engine connected to tcp://*:5557 within 1 s")]
    line = one(raw, AT_HAND, a={"kv": kv, "tokens": TokensLook(True, "verified against m")})
    assert "KV events: no engine connected" in line
    assert '"endpoint": "tcp://ROUTER_HOST:5557"' in line and "mode bind" in line


def test_a_vllm_kv_fix_enables_its_events_and_names_the_dp_rank() -> None:
    raw = {
        "backends": [
            {**A, "engine": "vllm", "kv_events": {"endpoint": "tcp://*:5557", "dp_ranks": 2}}
        ]
    }
    kv = [
        KvLook(0, "tcp://10.0.0.1:5557", False, ""),
        KvLook(1, "tcp://10.0.0.1:5558", False, "nothing accepts a connection"),
    ]
    line = one(raw, AT_HAND, a={"kv": kv, "tokens": TokensLook(True, "verified against m")})
    assert line.startswith("backend a: KV events (DP rank 1): nothing accepts")
    assert '\'{"enable_kv_cache_events": true, "publisher": "zmq"' in line


def test_kv_events_without_a_tokenizer_to_be_had_are_one_problem_for_the_fleet() -> None:
    endpoint = {"kv_events": {"endpoint": "tcp://*:5557"}}
    raw = {"backends": [{**A, **endpoint}, {"id": "b", "address": "10.0.0.2:8000", **endpoint}]}
    kv = [KvLook(0, "tcp://10.0.0.1:5557", False, "")]
    line = one(raw, a={"kv": kv}, b={"kv": kv})
    assert line.startswith(
        "tokenizer: the KV events of a, b need the engine's tokens, and no tokenizer is at "
        "hand (none). Fix: set tokenizer.path to the tokenizer.json 'm' is served with"
    )


def test_a_probe_path_that_makes_the_engine_work_is_found() -> None:
    raw = {"backends": [A], "probes": {"path": "/health"}}
    line = one(raw, a={"rtt_ms": [40.0, 41.0, 42.0], "reference_rtt_ms": [1.0, 1.0, 1.0]})
    assert "probes of /health answer in 41 ms, /v1/models in 1 ms" in line
    assert line.endswith(
        "Fix: set probes.path to a path the engine answers without work "
        "(empty: the engine's own, /v1/models)"
    )


def test_probes_that_fail_where_the_engine_answers_are_a_problem() -> None:
    line = one({"backends": [A]}, a={"rtt_ms": [], "rtt_failures": 1})
    assert line.startswith("backend a: RTT probes of /v1/models fail")
    assert "check backends[0].engine" in line


def test_a_fleet_split_evenly_between_models_is_one_problem() -> None:
    raw = {"backends": [A, {"id": "b", "address": "10.0.0.2:8000"}]}
    line = one(raw, b={"models": ServedModels(frozenset({"n"})), "served": ("n", "")})
    assert line == (
        "fleet: the backends serve different models (a: m; b: n). Fix: start every engine "
        "with the same model, or, for a fleet of several models, list each backend's in "
        "backends[].models"
    )


def test_an_unreachable_backend_is_one_problem_not_one_per_endpoint() -> None:
    raw = {"backends": [{**A, "kv_events": {"endpoint": "tcp://*:5557"}}]}
    down = {
        "models": None,
        "served": None,
        "rtt_ms": [],
        "rtt_failures": 1,
        "metrics": None,
        "unreachable": "connection refused",
        "models_error": "connection refused",
        "kv": [KvLook(0, "tcp://10.0.0.1:5557", False, "nothing accepts a connection")],
        "tokens": None,
    }
    line = one(raw, a=down)
    assert line == (
        "backend a: http://10.0.0.1:8000/v1/models: connection refused. Fix: start its "
        "engine, or correct backends[0].address (its host:port as the router and Envoy "
        "reach it)"
    )
