"""Telemetry as a lifecycle listener of the router: the span `gorgo.route` starts at the
dispatch and ends when the request is closed (however it ends), a child of Envoy's request
span when the ext_proc call carries a `traceparent`; the metrics follow each event."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision as SamplingDecision
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags, get_current_span
from opentelemetry.trace import Status as SpanStatus
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ext_proc.common.build import package_version
from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.core.terms.catalog import TERMS
from ext_proc.estimate.prediction import prediction_error
from ext_proc.service.telemetry.metrics import Children, Metrics
from ext_proc.service.telemetry.otlp import otlp_exporter
from ext_proc.service.telemetry.spans import (
    A_E2E_MS,
    A_ENGINE_CACHED,
    A_ERROR_TYPE,
    A_KV_TRANSFER_OBSERVED_MS,
    A_PREDICTION_ERROR_RATIO,
    A_PREDICTION_ERROR_TOKENS,
    A_STATUS,
    A_TTFT_MS,
    SPAN_NAME,
    decision_attributes,
    dispatch_attributes,
)
from ext_proc.vocab.events import Closed, Dispatched, FirstByte, Listener
from ext_proc.vocab.types import Decision, Status

_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = InstrumentationScope("gorgo")


@dataclass(slots=True)
class _OpenSpan:
    """A decision span until its request closes: its ids, its parent (Envoy's request
    span, if the call carried one), its start, its decision and what the attributes
    read of the state at the dispatch (the rest is built at close, off the request's
    path)."""

    context: SpanContext
    parent: SpanContext | None
    start_ns: int
    decision: Decision
    session_key: str | None
    weights_version: int | None
    attributes: dict[str, Any]


class Telemetry(Listener):
    """Spans and metrics for decisions, subscribed to the router's lifecycle. `exporter`:
    injected in tests; otherwise OTLP over gRPC (plaintext or TLS, otlp.py) when an
    endpoint is configured (config or OTEL_EXPORTER_OTLP_ENDPOINT).

    A span's ids and sampling are decided at the dispatch (the decision log links its
    trace), and the span is made once, finished, when its request closes: the SDK's live
    `Span` validated and locked each attribute as it was set, and cost more than the
    decision. The provider's sampler, id generator and resource are used as they are."""

    def __init__(
        self, cfg: TelemetryConfig, router: Router, exporter: SpanExporter | None = None
    ) -> None:
        self.router = router
        self.metrics = m = Metrics(router)
        self._decisions = Children(m.decisions)
        self._term = Children(m.term)
        self._ttft = Children(m.ttft)
        self._e2e = Children(m.e2e)
        self._completions = Children(m.completions)
        self._prediction_error = Children(m.prediction_error)
        self._spans: dict[str, _OpenSpan] = {}
        # Dispatches not yet recorded (on_dispatch), with when each was made (ns).
        self._pending: dict[str, tuple[Dispatched, int]] = {}
        self._flush_scheduled = False
        endpoint = cfg.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if exporter is None and endpoint:
            exporter = otlp_exporter(cfg, endpoint)
        self.provider: TracerProvider | None = None
        self._batch: BatchSpanProcessor | None = None
        if exporter is not None:
            self.provider = TracerProvider(
                resource=Resource.create(
                    {"service.name": cfg.service_name, "service.version": package_version()}
                ),
                sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            )
            # Batched: export never runs on the request path.
            self._batch = BatchSpanProcessor(exporter)
            self.provider.add_span_processor(self._batch)

    # -- lifecycle ----------------------------------------------------------------------

    def on_dispatch(self, e: Dispatched) -> None:
        """Recorded a moment later, on the event loop's next turn, when the decision's
        reply is on its way: none of it is on the request's path. Without a running loop
        (tests, tools), at once."""
        self._pending[e.decision.request_id] = (e, time.time_ns())
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._record_dispatches()
            return
        self._flush_scheduled = True
        loop.call_soon(self._record_dispatches)

    def _record_dispatches(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for e, start_ns in pending.values():
            self._dispatched(e, start_ns)

    def _dispatched(self, e: Dispatched, start_ns: int) -> None:
        d = e.decision
        m = self.metrics
        self._decisions[(d.backend, d.policy, d.model or "")].inc()
        chosen = d.chosen
        term = self._term
        for name, value in chosen.terms.items():
            info = TERMS.get(name)
            if info is None or info.unit == "ms":  # in seconds, as the metric is
                term[(name,)].observe(value / 1000)
        term[("pace_hold",)].observe(d.pace_ms / 1000)
        if self.router.cfg.flow_control.enabled:
            m.flow_wait.observe(d.waited_ms / 1000)
        m.prompt_tokens.inc(d.input_tokens)
        m.cached_tokens.inc(chosen.cached_tokens)
        provider = self.provider
        if provider is None:
            return
        carrier = e.request.trace_context
        ctx = _PROPAGATOR.extract(dict(carrier)) if carrier else None
        parent: SpanContext | None = get_current_span(ctx).get_span_context()
        assert parent is not None
        if not parent.is_valid:
            parent = None
        ids = provider.id_generator
        trace_id = parent.trace_id if parent is not None else ids.generate_trace_id()
        sampled = provider.sampler.should_sample(ctx, trace_id, SPAN_NAME)
        if sampled.decision is not SamplingDecision.RECORD_AND_SAMPLE:
            return
        context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=sampled.trace_state,
        )
        tuner = self.router.tuner
        self._spans[d.request_id] = _OpenSpan(
            context,
            parent,
            start_ns,
            d,
            e.request.session_key,
            None if tuner is None else len(tuner.state.history),
            dispatch_attributes(e, self.router.backends[e.record.backend]),
        )
        self.router.recent.set_trace(d.request_id, f"{trace_id:032x}")

    def on_first_byte(self, e: FirstByte) -> None:
        if e.request_id in self._pending:
            self._record_dispatches()
        self._ttft[(e.backend,)].observe(e.ttft_ms / 1000)
        span = self._spans.get(e.request_id)
        if span is not None:
            span.attributes[A_TTFT_MS] = round(e.ttft_ms, 3)

    def on_close(self, c: Closed) -> None:
        if c.request_id in self._pending:
            self._record_dispatches()
        self._completions[(c.backend, str(c.status))].inc()
        if c.status == Status.OK:
            self._e2e[(c.backend,)].observe(c.e2e_ms / 1000)
        elif c.served_ok and c.served_by:  # failed over: the backend that answered
            self._e2e[(c.served_by,)].observe(c.e2e_ms / 1000)
        err = prediction_error(c)
        if err is not None:
            state = str(c.record.prefix_state)
            self._prediction_error[(c.backend, state)].observe(err.error_ratio)
        span = self._spans.pop(c.request_id, None)
        if span is None:
            return
        a = span.attributes
        if err is not None:
            a[A_ENGINE_CACHED] = err.reported_tokens
            a[A_PREDICTION_ERROR_TOKENS] = err.error_tokens
            a[A_PREDICTION_ERROR_RATIO] = round(err.error_ratio, 6)
        a[A_E2E_MS] = round(c.e2e_ms, 3)
        if c.ttft_ms is not None:
            a[A_TTFT_MS] = round(c.ttft_ms, 3)
        if c.record.observed_transfer_ms is not None:
            a[A_KV_TRANSFER_OBSERVED_MS] = round(c.record.observed_transfer_ms, 3)
        self._end(span, str(c.status), c.status != Status.OK)

    def _end(self, span: _OpenSpan, status: str, error: bool) -> None:
        """The span, finished, to the batch exporter."""
        assert self.provider is not None and self._batch is not None
        attributes = decision_attributes(span.decision, span.session_key, span.weights_version)
        attributes.update(span.attributes)
        attributes[A_STATUS] = status
        if error:
            attributes[A_ERROR_TYPE] = status  # the conventions' error.type: which end
        finished = ReadableSpan(
            SPAN_NAME,
            context=span.context,
            parent=span.parent,
            resource=self.provider.resource,
            attributes=attributes,
            status=SpanStatus(StatusCode.ERROR, status) if error else SpanStatus(),
            start_time=span.start_ns,
            end_time=time.time_ns(),
            instrumentation_scope=_SCOPE,
        )
        self._batch.on_end(finished)

    def fallback(self, backend: str) -> None:
        self.metrics.fallback.labels(backend or "unknown").inc()

    def shutdown(self) -> None:
        """End what is still open and flush the exporter."""
        self._record_dispatches()
        for span in self._spans.values():
            self._end(span, "shutdown", False)
        self._spans.clear()
        if self.provider is not None:
            self.provider.shutdown()
