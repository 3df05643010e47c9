"""The request's recipe (director.recipe.Director): resolve the model, admit, schedule,
record; what every transport gets back."""

from ext_proc.director.outcomes import Refused, Routed, Unrouted
from ext_proc.director.recipe import Director
from ext_proc.feeds.served_models import ServedModels
from tests.builders import chat, make_config, make_router


def test_a_request_is_routed_and_recorded() -> None:
    router, _ = make_router("gorgo", backends=["a", "b"])
    out = Director(router).handle(chat(rid="r1"))
    assert isinstance(out, Routed) and out.served_model is None
    assert router.in_flight["r1"].backend == out.decision.backend


def test_an_alias_goes_as_the_served_name_it_resolves_to() -> None:
    router, _ = make_router(
        "gorgo",
        backends=["a"],
        models=[{"name": "chat", "served": [{"model": "qwen-v2"}]}],
    )
    router.inputs.record_models("a", ServedModels(frozenset({"qwen-v2"})))
    out = Director(router).handle(chat(rid="r1", model="chat"))
    assert isinstance(out, Routed) and out.served_model == "qwen-v2"
    assert out.decision.model == "qwen-v2"


def test_a_model_no_backend_serves_is_refused_and_nothing_is_recorded() -> None:
    # vLLM answers a name it does not serve 404 (SGLang takes any): so does the router
    router, _ = make_router(
        "gorgo", backends=[{"id": "a", "address": "127.0.0.1:1", "engine": "vllm"}]
    )
    router.inputs.record_models("a", ServedModels(frozenset({"alpha"})))
    out = Director(router).handle(chat(rid="r1", model="beta"))
    assert isinstance(out, Refused) and out.refusal.status == 404
    assert not router.in_flight


def test_no_active_backend_leaves_it_to_envoys_fallback_route() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    router.fleet.confirm_new_backends = True
    new = make_config("gorgo", backends=["b"]).backends[0]
    router.fleet.add(new, "test")  # pending until Envoy has its cluster
    router.fleet.drain("a", "test")  # the only active one goes
    out = Director(router).handle(chat(rid="r1"))
    assert isinstance(out, Unrouted) and not router.in_flight
