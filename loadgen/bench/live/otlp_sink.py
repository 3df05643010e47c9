"""An OTLP/gRPC trace receiver that counts the spans it is sent and keeps nothing: the
endpoint `gorgo bench overhead --otlp` gives the router, so its CPU per request is
measured as a user runs it (spans exported), not with tracing idle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _Counter(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request: Any, context: Any) -> Any:
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    """Listens on 127.0.0.1:`port` (0: a free one) in its own threads until `stop`. Start
    it after the processes it serves: a process forked while its gRPC threads run can
    inherit them half-made (gorgo serve aborted in epoll_wait)."""

    def __init__(self, port: int = 0) -> None:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self._counter = _Counter()
        add = trace_service_pb2_grpc.add_TraceServiceServicer_to_server
        add(self._counter, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()

    @property
    def spans(self) -> int:
        return self._counter.spans

    def stop(self) -> None:
        self._server.stop(grace=None)
