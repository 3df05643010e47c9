"""Routing by the request's model: only backends serving it are candidates, and the router
answers itself (no engine reached) for a model no backend serves (404), no model named
when several are served (400), a model whose every backend is out of rotation (503), and a
prompt longer than every context (400)."""

import json

from ext_proc.core.admission import fallback_order
from ext_proc.core.router import Router
from ext_proc.feeds.served_models import ServedModels
from ext_proc.prompt.parse import COMPLETIONS, parse_body
from ext_proc.vocab.types import RouteRequest, Status
from tests.builders import FakeClock, chat, make_router

BACKENDS = [
    {"id": "a", "address": "127.0.0.1:1", "rtt_prior_ms": 10},
    {"id": "b", "address": "127.0.0.1:2", "rtt_prior_ms": 20},
    {"id": "c", "address": "127.0.0.1:3", "rtt_prior_ms": 30},
]


def fleet(**routing: object) -> tuple[Router, FakeClock]:
    r, clock = make_router("gorgo", backends=BACKENDS, routing=routing)
    r.inputs.record_models("a", ServedModels(frozenset({"alpha"})))
    r.inputs.record_models("b", ServedModels(frozenset({"alpha"}), {"alpha-sql": "alpha"}))
    r.inputs.record_models("c", ServedModels(frozenset({"beta"})))
    return r, clock


def test_a_model_goes_only_where_it_is_served() -> None:
    r, _ = fleet()
    for i in range(20):
        beta = chat(f"q{i}", model="beta")
        assert r.admit(beta) is None
        assert r.decide(beta).backend == "c"
        alpha = chat(f"q{i}", model="alpha")
        d = r.decide(alpha)
        assert d.backend in ("a", "b") and {c.backend_id for c in d.candidates} == {"a", "b"}
        assert r.decide(chat(f"s{i}", model="alpha-sql")).backend == "b"


def test_unknown_missing_and_unavailable_models_are_answered() -> None:
    r, _ = fleet()
    unknown = r.admit(chat(model="gamma"))
    assert unknown is not None and unknown.status == 404
    assert "gamma" in unknown.message and "/v1/models" in unknown.message
    missing = r.admit(chat())
    assert missing is not None and missing.status == 400
    assert "alpha, beta" in missing.message
    r.decide(chat(model="beta"))  # in flight on c: draining keeps c until it ends
    r.fleet.drain("c")
    gone = r.admit(chat(model="beta"))
    assert gone is not None and gone.status == 503 and gone.retry_after_s == 5.0


def test_an_ejected_backends_model_is_unavailable_until_the_ejection_ends() -> None:
    r, clock = fleet(eject_after_errors=1, eject_s=4.0)
    d = r.decide(chat(model="beta"))
    r.close(d.request_id, Status.ERROR)
    refused = r.admit(chat(model="beta"))
    assert refused is not None and refused.status == 503
    assert refused.retry_after_s == 4.0
    clock.advance(4.5)
    assert r.admit(chat(model="beta")) is None


def test_one_model_served_needs_none_named_and_unknown_backends_serve_anything() -> None:
    # vLLM engines: a name no engine lists is not taken by one that lists another
    r, _ = make_router("gorgo", backends=[{**b, "engine": "vllm"} for b in BACKENDS])
    assert r.admit(chat(model="anything")) is None  # nothing known: nothing refused
    assert r.served_models() is None
    r.inputs.record_models("a", ServedModels(frozenset({"alpha"})))
    d = r.decide(chat(model="zeta"))
    assert d.backend in ("b", "c")  # a does not serve it; b and c may
    for b in ("b", "c"):
        r.inputs.record_models(b, ServedModels(frozenset({"alpha"})))
    assert r.admit(chat()) is None  # one model served: no model named is fine
    assert r.served_models() == {"alpha": None}


def test_configured_models_pin_and_restrict_what_is_discovered() -> None:
    backends = [{**BACKENDS[0], "models": ["alpha"]}, BACKENDS[1]]
    r, _ = make_router("gorgo", backends=backends)
    assert r.backends["a"].models == ServedModels(frozenset({"alpha"}))
    r.inputs.record_models("a", ServedModels(frozenset({"alpha"}), {"alpha-sql": "alpha"}))
    assert r.backends["a"].serves("alpha") and not r.backends["a"].serves("alpha-sql")


def test_an_adapter_has_its_own_cache_and_speed_on_its_engine() -> None:
    r, _ = make_router("gorgo", backends=BACKENDS[1:2])
    r.inputs.record_models("b", ServedModels(frozenset({"alpha"}), {"alpha-sql": "alpha"}))
    text = "a long shared document " * 400

    def cached_on_b(model: str) -> int:
        d = r.decide(chat(text, model=model))
        return d.candidates[0].cached_tokens

    assert cached_on_b("alpha") == 0
    assert cached_on_b("alpha") > 0  # the base model's blocks are in the index
    assert cached_on_b("alpha-sql") == 0  # but they are not the adapter's
    assert cached_on_b("alpha-sql") > 0
    b = r.backends["b"]
    assert b.speed_for("alpha-sql") is not b.learned.speed
    assert b.speed_for("alpha") is b.learned.speed
    assert {rec.model for rec in r.in_flight.values()} == {"alpha", "alpha-sql"}


def test_a_placeholder_name_reaches_a_one_model_sglang_fleet_not_vllm() -> None:
    sglang = [{**b, "engine": "sglang"} for b in BACKENDS]
    vllm = [{**b, "engine": "vllm"} for b in BACKENDS]
    for backends, refused in ((sglang, None), (vllm, 404)):
        r, _ = make_router("gorgo", backends=backends)
        for b in ("a", "b", "c"):
            r.inputs.record_models(b, ServedModels(frozenset({"alpha"})))
        answer = r.admit(chat(model="default"))
        assert (answer and answer.status) == refused
        if refused is None:
            assert r.decide(chat(model="default")).backend in ("a", "b", "c")


def test_the_fleets_models_are_the_known_ones_while_a_backend_is_not_known() -> None:
    # c's engine has not answered /v1/models (down at start): a and b's models are still
    # the fleet's, not one engine's list through the fallback route
    r, _ = make_router("gorgo", backends=BACKENDS)
    assert r.served_models() is None  # nothing known: the fallback route answers
    r.inputs.record_models("a", ServedModels(frozenset({"alpha"})))
    r.inputs.record_models("b", ServedModels(frozenset({"beta"}), {"beta-sql": "beta"}))
    assert r.served_models() == {"alpha": None, "beta": None, "beta-sql": "beta"}
    r.inputs.record_models("c", ServedModels(frozenset({"gamma"})))
    assert r.served_models() == {"alpha": None, "beta": None, "beta-sql": "beta", "gamma": None}


def test_an_adapter_prefers_where_it_is_loaded_over_a_full_batch_of_others() -> None:
    from ext_proc.feeds.engine_metrics import EngineReport

    r, _ = make_router("gorgo", backends=BACKENDS[:2])  # a is nearer than b
    for b in ("a", "b"):
        r.inputs.record_models(
            b, ServedModels(frozenset({"alpha"}), {"sql": "alpha", "doc": "alpha"})
        )
    for i in range(4):
        r.decide(chat(f"doc {i} " * 50, model="doc"))

    def queue_on_a(max_lora: int) -> tuple[str, float]:
        r.inputs.record_engine_report("a", EngineReport(0, 4, 0.1, frozenset({"doc"}), max_lora))
        r.inputs.record_engine_report("b", EngineReport(0, 1, 0.1, frozenset({"sql"}), 1))
        d = r.decide(chat(f"sql {max_lora}", model="sql"))
        return d.backend, next(c.wait_ms for c in d.candidates if c.backend_id == "a")

    free_backend, free_ms = queue_on_a(2)  # a slot free on a: no wait for one
    full_backend, full_ms = queue_on_a(1)  # a's one slot held by doc: wait for a finish
    assert free_backend == "a" and full_backend == "b"
    assert full_ms > free_ms + 1000


def test_a_reload_restricts_a_backend_before_its_adapter_is_unloaded() -> None:
    """The operator's way to take an adapter off one backend with no request failing:
    leave it out of that backend's `backends[].models` (a reload), then unload it."""
    from dataclasses import replace

    r, _ = make_router("gorgo", backends=BACKENDS[:2])
    for b in ("a", "b"):
        r.inputs.record_models(b, ServedModels(frozenset({"alpha"}), {"sql": "alpha"}))
    assert {c.backend_id for c in r.decide(chat(model="sql")).candidates} == {"a", "b"}
    kept = replace(r.backends["a"].config, models=("alpha",))
    r.fleet.reconcile([kept, r.backends["b"].config])
    for i in range(10):
        assert r.decide(chat(f"q{i}", model="sql")).backend == "b"
    assert r.decide(chat("base", model="alpha")).backend in ("a", "b")
    moved = replace(r.backends["b"].config, address="127.0.0.1:9")  # another engine
    r.fleet.reconcile([kept, moved])
    assert r.backends["b"].models is None  # to be read again from the new engine


def test_a_prompt_longer_than_every_context_is_refused_and_a_shorter_one_avoids_small_ones() -> (
    None
):
    """Engines report their context (`max_model_len` on /v1/models): a prompt no backend
    can hold is the router's 400; one only the larger hold goes there."""
    r, _ = make_router(backends=["small", "large"])
    r.inputs.record_models("small", ServedModels(frozenset({"m"}), max_model_len=4096))
    r.inputs.record_models("large", ServedModels(frozenset({"m"}), max_model_len=32768))
    ids = tuple(range(5000))  # the engine's own token ids: an exact count

    def request(n: int) -> RouteRequest:
        body = json.dumps({"model": "m", "prompt": list(ids[:n])}).encode()
        return RouteRequest(f"r{n}", parse_body(COMPLETIONS, body), None)

    assert r.admit(request(4095)) is None
    assert {c.backend_id for c in r.features.candidates(request(4095), [])} == {"small", "large"}
    assert r.admit(request(5000)) is None
    assert {c.backend_id for c in r.features.candidates(request(5000), [])} == {"large"}
    huge = RouteRequest(
        "h",
        parse_body(COMPLETIONS, json.dumps({"model": "m", "prompt": list(range(40000))}).encode()),
        None,
    )
    refused = r.admit(huge)
    assert refused is not None and refused.status == 400
    assert "40000 tokens" in refused.message and "32768" in refused.message


def test_an_approximate_count_is_refused_only_well_past_the_context() -> None:
    """~4 bytes a token without the engine's tokenizer: off by up to 2x either way."""
    r, _ = make_router(backends=["a"])
    r.inputs.record_models("a", ServedModels(frozenset({"m"}), max_model_len=4096))

    def text(n_bytes: int) -> RouteRequest:
        body = json.dumps({"model": "m", "prompt": "x" * n_bytes}).encode()
        return RouteRequest("t", parse_body(COMPLETIONS, body), None)

    assert r.admit(text(4 * 6000)) is None  # ~6,000 counted: may well fit
    refused = r.admit(text(4 * 9000))  # ~9,000 counted: over 2 x 4,096
    assert refused is not None and refused.status == 400


def test_a_request_without_a_decision_goes_to_active_backends_available_first_least_loaded() -> (
    None
):
    r, clock = fleet(eject_after_errors=1, eject_s=4.0)
    assert fallback_order(r.fleet.state, clock()) == ["a", "b", "c"]
    r.decide(chat(model="alpha"))  # one in flight on a or b
    busy = next(b for b in ("a", "b") if r.backends[b].load.in_flight)
    idle = "b" if busy == "a" else "a"
    assert fallback_order(r.fleet.state, clock()) == [idle, "c", busy]
    d = r.decide(chat(model="beta"))
    r.close(d.request_id, Status.ERROR)  # c ejected: last
    assert fallback_order(r.fleet.state, clock()) == [idle, busy, "c"]
    r.fleet.drain(idle)  # not active: not named
    assert fallback_order(r.fleet.state, clock()) == [busy, "c"]
