"""`gorgo bench prefix-state`'s pure parts: reading decision spans, joining them with the
client's results, the per-run figures and their ratios, and one rendered table."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from loadgen.bench.live.prefix_state import (
    Prediction,
    PrefixReport,
    SpanSink,
    prefix_report,
    ratios,
    report_table,
)
from loadgen.results import RequestResult


def test_the_sink_keeps_each_decisions_prediction() -> None:
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add(name="gorgo.route")
    for key, value in (
        ("gorgo.request_id", AnyValue(string_value="t1")),
        ("gorgo.backend", AnyValue(string_value="a")),
        ("gorgo.prefix_state", AnyValue(string_value="precise")),
        ("gorgo.predicted_cached_tokens", AnyValue(int_value=512)),
    ):
        span.attributes.append(KeyValue(key=key, value=value))
    req.resource_spans[0].scope_spans[0].spans.add(name="other")  # no prediction: skipped
    sink = SpanSink()
    sink.Export(req, None)
    assert sink.snapshot() == {"t1": Prediction("a", "precise", 512)}
    assert sink.has_all({"t1"}) and not sink.has_all({"t1", "t2"})


def _results() -> list[RequestResult]:
    return [
        RequestResult("t1", "a", 100.0, 1000.0, input_tokens=1000, cached_tokens=500),
        RequestResult("t2", "a", 200.0, 2000.0, input_tokens=1000, cached_tokens=0),
        RequestResult("t3", "b", 300.0, 3000.0, input_tokens=1000, cached_tokens=0),  # elsewhere
        RequestResult("t4", "a", status="error", error="HTTP 503"),
    ]


PREDICTIONS = {
    "t1": Prediction("a", "precise", 512),
    "t2": Prediction("a", "approximate", 100),
    "t3": Prediction("a", "precise", 0),
}


def test_the_report_joins_on_id_and_answering_backend() -> None:
    r = prefix_report(_results(), PREDICTIONS)
    assert (r.requests, r.ok, r.joined, r.precise_share, r.mispredicted) == (4, 3, 2, 0.5, 2)
    assert r.error_mean == pytest.approx((12 + 100) / 2000)
    assert r.error_p95 is not None and 12 / 1000 <= r.error_p95 <= 100 / 1000
    assert r.hit_rate == pytest.approx(500 / 3000)
    assert r.predicted_hit_rate == pytest.approx(612 / 2000)
    assert r.ttft_p95_ms is not None and 200.0 < r.ttft_p95_ms <= 300.0


def test_without_predictions_the_joined_figures_are_unknown() -> None:
    r = prefix_report(_results(), {})
    assert (r.ok, r.joined, r.mispredicted) == (3, 0, 0)
    assert r.precise_share is r.error_mean is r.error_p95 is r.predicted_hit_rate is None
    assert r.hit_rate == pytest.approx(500 / 3000)


def test_precise_over_approximate() -> None:
    precise = prefix_report(_results(), PREDICTIONS)
    approximate = replace(precise, error_mean=2 * (precise.error_mean or 0), hit_rate=0.0)
    x = ratios(precise, approximate)
    assert x["error_mean"] == pytest.approx(0.5) and x["ttft_p95_ms"] == pytest.approx(1.0)
    assert x["hit_rate"] is None  # over 0
    assert ratios(prefix_report(_results(), {}), precise)["error_mean"] is None


def test_the_table_has_a_row_per_run_and_the_ratios() -> None:
    r = PrefixReport(4, 3, 2, 0.5, 2, 0.056, 0.1, 0.1667, 0.306, 300.0, 3000.0)
    table = report_table({"precise": r, "approximate": replace(r, error_p95=None, ok=9)})
    assert "| precise | 3 / 2 | 50% | 2 | 5.600% | 10.000% | 16.670% | 30.600% | 300 | 3000 |" in (
        table
    )
    assert "| approximate | 9 / 2 | 50% | 2 | 5.600% | - |" in table
    assert table.endswith(
        "| precise / approximate | | | | x1.00 | - | x1.00 | x1.00 | x1.00 | x1.00 |"
    )
