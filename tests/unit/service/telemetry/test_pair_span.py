import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.schema import TelemetryConfig
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.service.telemetry.spans import (
    A_BACKEND,
    A_KV_TRANSFER_MS,
    A_KV_TRANSFER_OBSERVED_MS,
    A_PREFILL_BACKEND,
    decision_attributes,
)
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router
from tests.unit.core.test_pairs import LONG, pd_router


def test_the_span_names_both_engines_and_the_predicted_transfer() -> None:
    router, _ = pd_router()
    d = router.decide(chat(LONG, rid="r"))
    assert d.prefill is not None
    attrs = decision_attributes(d, None, None)
    assert (attrs[A_BACKEND], attrs[A_PREFILL_BACKEND]) == ("da", "pa")
    assert attrs[A_KV_TRANSFER_MS] == pytest.approx(d.prefill.transfer_ms, abs=1e-3)


def test_an_aggregated_decisions_span_has_no_prefill() -> None:
    router, _ = make_router("gorgo")
    attrs = decision_attributes(router.decide(chat(rid="r")), None, None)
    assert A_PREFILL_BACKEND not in attrs and A_KV_TRANSFER_MS not in attrs


def test_the_closed_span_carries_the_observed_transfer() -> None:
    router, clock = pd_router()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    d = router.decide(chat(LONG, rid="r"))
    assert d.prefill is not None
    clock.advance(d.chosen.predicted_ttft_ms / 1000)
    router.first_byte("r")
    router.close("r", Status.OK)
    telemetry.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes[A_PREFILL_BACKEND] == "pa"
    assert span.attributes[A_KV_TRANSFER_OBSERVED_MS] == pytest.approx(
        d.prefill.transfer_ms, abs=1e-2
    )
