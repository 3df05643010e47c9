"""`gorgo bench prefix-state`'s pure parts: reading decision spans, joining them with the
client's results, the per-run figures."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from loadgen.bench_prefix import Prediction, SpanSink, prefix_report, report_table
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


def test_the_report_joins_on_id_and_answering_backend() -> None:
    results = [
        RequestResult("t1", "a", 100.0, 1000.0, input_tokens=1000, cached_tokens=500),
        RequestResult("t2", "a", 200.0, 2000.0, input_tokens=1000, cached_tokens=0),
        RequestResult("t3", "b", 300.0, 3000.0, input_tokens=1000, cached_tokens=0),  # elsewhere
        RequestResult("t4", "a", status="error", error="HTTP 503"),
    ]
    predictions = {
        "t1": Prediction("a", "precise", 512),
        "t2": Prediction("a", "approximate", 100),
        "t3": Prediction("a", "precise", 0),
    }
    r = prefix_report(results, predictions)
    assert (r["requests"], r["ok"], r["joined"], r["precise_share"]) == (4, 3, 2, 0.5)
    assert r["error_mean"] == pytest.approx((12 + 100) / 2000) and r["mispredicted"] == 2
    assert r["hit_rate"] == pytest.approx(500 / 3000)
    assert r["predicted_hit_rate"] == pytest.approx(612 / 2000)
    table = report_table({"precise": r, "approximate": r})
    assert "| precise / approximate |" in table and "x1.00" in table
