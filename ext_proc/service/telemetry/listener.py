"""Telemetry as a lifecycle listener of the router: the span `gorgo.route` starts at the
dispatch and ends when the request is closed (however it ends), a child of Envoy's request
span when the ext_proc call carries a `traceparent`; the metrics follow each event."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, StatusCode
from opentelemetry.trace import Status as SpanStatus
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.estimate.prediction import prediction_error
from ext_proc.service.otlp import otlp_exporter
from ext_proc.service.telemetry.metrics import Metrics
from ext_proc.service.telemetry.spans import (
    A_E2E_MS,
    A_ENGINE_CACHED,
    A_PREDICTION_ERROR_RATIO,
    A_PREDICTION_ERROR_TOKENS,
    A_STATUS,
    A_TTFT_MS,
    SPAN_NAME,
    decision_attributes,
    prefix_attributes,
)
from ext_proc.vocab.events import Closed, Dispatched, FirstByte, Listener
from ext_proc.vocab.types import Status


class Telemetry(Listener):
    """Spans and metrics for decisions, subscribed to the router's lifecycle. `exporter`:
    injected in tests; otherwise OTLP over gRPC (plaintext or TLS, service/otlp.py) when an
    endpoint is configured (config or OTEL_EXPORTER_OTLP_ENDPOINT)."""

    def __init__(
        self, cfg: TelemetryConfig, router: Router, exporter: SpanExporter | None = None
    ) -> None:
        self.router = router
        self.metrics = Metrics(router)
        self._spans: dict[str, Span] = {}
        endpoint = cfg.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if exporter is None and endpoint:
            exporter = otlp_exporter(cfg, endpoint)
        self.provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if exporter is not None:
            self.provider = TracerProvider(
                resource=Resource.create({"service.name": cfg.service_name}),
                sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            )
            # Batched: export never runs on the request path.
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
            self._tracer = self.provider.get_tracer("gorgo")

    # -- lifecycle ----------------------------------------------------------------------

    def on_dispatch(self, e: Dispatched) -> None:
        d = e.decision
        m = self.metrics
        m.decisions.labels(d.backend, d.policy, d.model or "").inc()
        chosen = d.chosen
        for name, value in chosen.terms.items():
            m.term.labels(name).observe(value)
        m.term.labels("pace_hold").observe(d.hold_ms)
        if self.router.cfg.flow_control.enabled:
            m.flow_wait.observe(d.waited_ms / 1000)
        m.prompt_tokens.inc(d.input_tokens)
        m.cached_tokens.inc(chosen.cached_tokens)
        if self._tracer is None:
            return
        ctx = TraceContextTextMapPropagator().extract(dict(e.request.trace_context))
        attributes = {
            **decision_attributes(d, e.request.session_key, self.router.tuner),
            **prefix_attributes(e, self.router.backends[e.record.backend]),
        }
        span = self._tracer.start_span(SPAN_NAME, context=ctx, attributes=attributes)
        if span.is_recording():
            self._spans[d.request_id] = span
            self.router.recent.set_trace(d.request_id, f"{span.get_span_context().trace_id:032x}")

    def on_first_byte(self, e: FirstByte) -> None:
        self.metrics.ttft.labels(e.backend).observe(e.ttft_ms / 1000)
        span = self._spans.get(e.request_id)
        if span is not None:
            span.set_attribute(A_TTFT_MS, round(e.ttft_ms, 3))

    def on_close(self, c: Closed) -> None:
        self.metrics.completions.labels(c.backend, c.status).inc()
        if c.status == Status.OK:
            self.metrics.e2e.labels(c.backend).observe(c.e2e_ms / 1000)
        err = prediction_error(c)
        if err is not None:
            state = str(c.record.prefix_state)
            self.metrics.prediction_error.labels(c.backend, state).observe(err.error_ratio)
        span = self._spans.pop(c.request_id, None)
        if span is None:
            return
        if err is not None:
            span.set_attribute(A_ENGINE_CACHED, err.reported_tokens)
            span.set_attribute(A_PREDICTION_ERROR_TOKENS, err.error_tokens)
            span.set_attribute(A_PREDICTION_ERROR_RATIO, round(err.error_ratio, 6))
        span.set_attribute(A_E2E_MS, round(c.e2e_ms, 3))
        span.set_attribute(A_STATUS, str(c.status))
        if c.ttft_ms is not None:
            span.set_attribute(A_TTFT_MS, round(c.ttft_ms, 3))
        if c.status != Status.OK:
            span.set_status(SpanStatus(StatusCode.ERROR, str(c.status)))
        span.end()

    def fallback(self, backend: str) -> None:
        self.metrics.fallback.labels(backend or "unknown").inc()

    def shutdown(self) -> None:
        """End what is still open and flush the exporter."""
        for span in self._spans.values():
            span.set_attribute(A_STATUS, "shutdown")
            span.end()
        self._spans.clear()
        if self.provider is not None:
            self.provider.shutdown()
