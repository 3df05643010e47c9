"""A request's objective, tenant and deadline (flow.classify)."""

import math

from ext_proc.config.flow import FlowControl, Objective
from ext_proc.flow.classify import DEFAULT, Objectives, read_headers
from ext_proc.vocab.types import RouteRequest
from tests.builders import chat

SETTINGS = FlowControl(
    enabled=True,
    objectives=(
        Objective("interactive", priority=10, ttft_slo_ms=2000),
        Objective("batch", priority=-1, sheddable=True, max_wait_s=300, models=("bulk-model",)),
    ),
    default_objective="",
)


def test_the_header_names_it_else_the_model_else_the_default() -> None:
    o = Objectives(SETTINGS)
    named = RouteRequest("r", None, None, objective="interactive")
    assert o.of(named).name == "interactive"
    by_model = chat(rid="r", model="bulk-model")
    assert o.of(by_model).name == "batch"
    unknown = RouteRequest("r", None, None, objective="gold")
    assert o.of(unknown) is DEFAULT and DEFAULT.priority == 0
    assert o.max_wait_s(o.by_name["batch"]) == 300 and o.max_wait_s(DEFAULT) == 60


def test_the_deadline_is_arrival_plus_its_own_slo_else_its_objectives() -> None:
    o = Objectives(SETTINGS)
    interactive = o.by_name["interactive"]
    assert o.deadline_s(interactive, RouteRequest("r", None, None), 100.0) == 102.0
    own = RouteRequest("r", None, None, ttft_slo_ms=500)
    assert o.deadline_s(interactive, own, 100.0) == 100.5
    assert o.deadline_s(DEFAULT, RouteRequest("r", None, None), 100.0) == math.inf


def test_the_headers_and_a_malformed_slo() -> None:
    headers = {
        "x-gorgo-objective": " batch ",
        "x-gorgo-tenant": "acme",
        "x-gorgo-ttft-slo-ms": "750",
    }
    assert read_headers(SETTINGS, headers) == ("batch", "acme", 750.0)
    for bad in ("soon", "-5", "0", "nan", "inf", "1e30"):
        assert read_headers(SETTINGS, {"x-gorgo-ttft-slo-ms": bad}) == ("", "", 0.0), bad


def test_the_inference_extensions_headers_are_read_beside_ours() -> None:
    """x-gateway-inference-objective / x-gateway-inference-fairness-id, which the
    extension's gateways set; the configured headers win when both are there."""
    theirs = {"x-gateway-inference-objective": "batch", "x-gateway-inference-fairness-id": "t1"}
    assert read_headers(SETTINGS, theirs) == ("batch", "t1", 0.0)
    both = {**theirs, "x-gorgo-objective": "interactive", "x-gorgo-tenant": "acme"}
    assert read_headers(SETTINGS, both) == ("interactive", "acme", 0.0)
    renamed = FlowControl(objective_header="x-prio", tenant_header="x-who")
    assert read_headers(renamed, theirs) == ("batch", "t1", 0.0)
