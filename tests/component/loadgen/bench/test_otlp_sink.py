"""The overhead bench's OTLP receiver counts the spans a real gRPC export carries."""

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from loadgen.bench.live.otlp_sink import OtlpSink

pytestmark = pytest.mark.component


def test_the_sink_counts_the_spans_it_is_sent() -> None:
    sink = OtlpSink()
    try:
        spans = [trace_pb2.Span(name=f"s{i}") for i in range(3)]
        request = trace_service_pb2.ExportTraceServiceRequest(
            resource_spans=[
                trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])
            ]
        )
        with grpc.insecure_channel(f"127.0.0.1:{sink.port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
            stub.Export(request, timeout=5)
            stub.Export(request, timeout=5)
        assert sink.spans == 6
    finally:
        sink.stop()
