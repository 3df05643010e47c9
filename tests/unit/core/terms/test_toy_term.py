"""A cost term is one function, registered by name: a toy one added through the registry
is computed for every candidate, scored by gorgo at its weight, and shown wherever the
terms are (the decision's JSON, the span, the metric, the operator page's feed)."""

import json
from collections.abc import Iterator, Mapping

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.terms.base import TermInputs
from ext_proc.core.terms.catalog import BUILT_IN, TERMS
from ext_proc.service.admin.operator_page import entry_row, terms_json
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.terms import register_term, unregister_term
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router


@pytest.fixture
def toy() -> Iterator[str]:
    """A term pricing each request in flight on a backend at 1 s (a toy), weighed 1.0."""

    @register_term("crowd", weight=1.0, label="crowd")
    def crowd_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
        return 1000.0 * x.backend.load.in_flight

    yield "crowd"
    unregister_term("crowd")


def test_a_toy_term_reaches_the_candidates_the_score_and_every_view(toy: str) -> None:
    assert list(TERMS) == [*BUILT_IN, toy]  # after the built-in ones
    router, _ = make_router("gorgo", backends=["near", "far"])
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)

    first = router.decide(chat("one", rid="r1"))  # near: nearer, nothing in flight yet
    second = router.decide(chat("two", rid="r2"))
    other = next(b for b in ("near", "far") if b != first.backend)
    crowd = {c.backend_id: c.terms[toy] for c in second.candidates}
    assert crowd == {first.backend: 1000.0, other: 0.0}
    # gorgo weighs it at its weight: a second of it outweighs the nearer backend's RTT edge
    assert second.backend != first.backend
    chosen = second.chosen
    expected = second.scores[chosen.backend_id]
    assert expected == pytest.approx(
        sum(
            w * chosen.terms[n]
            for n, w in router.policy.term_weights(second.weights).items()  # type: ignore[attr-defined]
            if n in chosen.terms
        )
    )

    # the decision's JSON, the page's feed, the span, the metric
    shown = second.as_json()["candidates"][0]
    assert f"{toy}_ms" in shown
    assert toy in [t["name"] for t in terms_json()]
    entry = router.recent.find("r2")
    assert entry is not None
    names = [t["name"] for t in terms_json()]
    row = entry_row(entry, router.policy.term_weights)  # type: ignore[attr-defined]
    assert row["term_weights"][names.index(toy)] == 1.0
    for rid in ("r1", "r2"):
        router.first_byte(rid)
        router.close(rid, Status.OK)
    telemetry.shutdown()
    spans = {(s.attributes or {})["gorgo.request_id"]: s for s in exporter.get_finished_spans()}
    attrs = spans["r2"].attributes or {}
    listed = {c["backend"]: c for c in json.loads(str(attrs["gorgo.candidates"]))}
    assert listed[first.backend][f"{toy}_ms"] == 1000.0
    registry = telemetry.metrics.registry
    assert registry.get_sample_value("gorgo_cost_term_seconds_count", {"term": toy}) == 2.0
    # in seconds, as every term in ms: the chosen backends' RTTs
    rtt_s = (first.chosen.terms["rtt"] + second.chosen.terms["rtt"]) / 1000
    assert registry.get_sample_value("gorgo_cost_term_seconds_sum", {"term": "rtt"}) == (
        pytest.approx(rtt_s)
    )
    assert rtt_s > 0


def test_a_term_name_is_registered_once(toy: str) -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_term(toy)(lambda x, terms: 0.0)
