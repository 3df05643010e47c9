"""Observability of every decision: an OpenTelemetry span and Prometheus metrics.

A lifecycle listener of the router: the span `gorgo.route` starts at the dispatch and
ends when the request is closed (however it ends); it is a child of Envoy's request span
when the ext_proc call carries a `traceparent`. It never holds prompt text: only counts,
terms, ids and a hash of the session key.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, StatusCode
from opentelemetry.trace import Status as SpanStatus
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.features import prefix_state
from ext_proc.core.router import Router
from ext_proc.core.terms.catalog import TERMS
from ext_proc.estimate.prediction import prediction_error
from ext_proc.service.otlp import otlp_exporter
from ext_proc.service.prediction_metrics import latency_prediction_gauges, served_model_gauges
from ext_proc.vocab.events import Closed, Dispatched, FirstByte, Listener
from ext_proc.vocab.types import BackendLifecycle, Decision, PrefixState, Status

SPAN_NAME = "gorgo.route"
# Attribute names (docs/operations.md lists them all).
A_POLICY = "gorgo.policy"
A_BACKEND = "gorgo.backend"
A_INPUT_TOKENS = "gorgo.input_tokens"
A_MODEL = "gorgo.model"
A_SESSION_HASH = "gorgo.session_hash"
A_WEIGHT_RTT = "gorgo.weights.rtt"
A_WEIGHT_QUEUE = "gorgo.weights.queue"
A_WEIGHTS_VERSION = "gorgo.weights.version"
A_TUNER_ARM = "gorgo.tuner.arm"
A_REQUEST_ID = "gorgo.request_id"
A_CANDIDATE = "gorgo.candidate.{backend}.{field}"
A_TTFT_MS = "gorgo.ttft_ms"
A_E2E_MS = "gorgo.e2e_ms"
A_STATUS = "gorgo.status"
# The chosen backend's prefix state at the decision, and what it predicted was cached.
A_PREFIX_STATE = "gorgo.prefix_state"
A_PREDICTED_CACHED = "gorgo.predicted_cached_tokens"
A_KV_EVENT_AGE_S = "gorgo.kv_events.age_s"
A_KV_EVENT_GAPS = "gorgo.kv_events.gaps"
A_KV_EVENT_RESETS = "gorgo.kv_events.resets"
A_ENGINE_REPORT_AGE_S = "gorgo.engine_report.age_s"
# At close, when the engine reported its cached tokens: the report and the error.
A_ENGINE_CACHED = "gorgo.engine_cached_tokens"
A_PREDICTION_ERROR_TOKENS = "gorgo.prediction_error_tokens"
A_PREDICTION_ERROR_RATIO = "gorgo.prediction_error_ratio"
# The chosen backend's predicted TTFT and E2E (beside gorgo.ttft_ms and gorgo.e2e_ms).
A_PREDICTED_TTFT_MS = "gorgo.predicted_ttft_ms"
A_PREDICTED_E2E_MS = "gorgo.predicted_e2e_ms"
# Backends left out of the decision because they are draining (only when there are some).
A_DRAINING_BACKENDS = "gorgo.draining_backends"
# How long dispatch pacing held the request before it was sent on (only when it did).
A_PACE_HOLD_MS = "gorgo.pace_hold_ms"
# Each candidate's fields besides its cost terms (one attribute per registered term,
# `<name>_<unit>`: vocab.terms).
CANDIDATE_FIELDS = ("cached_tokens", "cost", "predicted_ttft_ms", "predicted_e2e_ms")

# Buckets (seconds / ms) sized for LLM latencies: TTFT from 10 ms to minutes.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TERM_BUCKETS_MS = (0.5, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
# Prediction error as a share of the prompt: the target for precise state is a 2 % mean,
# the simulator's figures are fractions of a percent; a whole prompt wrong is 1.
ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def session_hash(key: str | None) -> str:
    """A stable, non-reversible tag for a session key (never the key itself)."""
    return "" if not key else hashlib.sha256(key.encode()).hexdigest()[:16]


class _LiveGauges(Collector):
    """Gauges read from the router at scrape time (no bookkeeping on the request path)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily("gorgo_in_flight", "Requests in flight", labels=["backend"])
        rtt = GaugeMetricFamily("gorgo_rtt_ms", "Smoothed probe RTT (ms)", labels=["backend"])
        suspect = GaugeMetricFamily("gorgo_suspect", "1 if probes fail", labels=["backend"])
        ejected = GaugeMetricFamily(
            "gorgo_ejected", "1 while ejected for failing requests", labels=["backend"]
        )
        ejections = CounterMetricFamily(
            "gorgo_ejections", "Ejections for failing requests", labels=["backend"]
        )
        now_s = self.router.clock()
        for b in self.router.backends.values():
            in_flight.add_metric([b.id], b.load.in_flight)
            rtt.add_metric([b.id], b.health.rtt_ms)
            suspect.add_metric([b.id], 1.0 if b.health.suspect else 0.0)
            # An ejection ends by itself (the state clears it at the next decision).
            ejected.add_metric([b.id], 1.0 if b.health.ejected_at(now_s) else 0.0)
            ejections.add_metric([b.id], b.health.ejections)
        report_age = GaugeMetricFamily(
            "gorgo_engine_report_age_seconds",
            "Seconds since the engine's last load report (/metrics) was read",
            labels=["backend"],
        )
        for b in self.router.backends.values():
            if b.engine.report_at_s is not None:
                report_age.add_metric([b.id], max(0.0, now_s - b.engine.report_at_s))
        weights = GaugeMetricFamily("gorgo_weight", "Current cost weights", labels=["name"])
        w = self.router.weights
        if w is not None:
            weights.add_metric(["rtt"], w.rtt)
            weights.add_metric(["queue"], w.queue)
        yield from (in_flight, rtt, suspect, ejected, ejections, report_age, weights)
        yield from self._tuner()
        yield from self._prefix_state()
        yield from latency_prediction_gauges(self.router.backends.values())
        yield from served_model_gauges(self.router.backends.values())
        yield self._lifecycle()

    def _lifecycle(self) -> GaugeMetricFamily:
        """Per backend, 1 for its lifecycle now and 0 for the others; the backends removed
        lately (Fleet.removed) show removed = 1."""
        g = GaugeMetricFamily(
            "gorgo_backend_lifecycle",
            "1 for the backend's lifecycle now (pending, active, draining, removed)",
            labels=["backend", "state"],
        )
        current = {b.id: b.lifecycle for b in self.router.backends.values()}
        for r in self.router.fleet.removed:
            current.setdefault(r["id"], BackendLifecycle.REMOVED)
        for backend, now in current.items():
            for state in BackendLifecycle:
                g.add_metric([backend, str(state)], 1.0 if state is now else 0.0)
        return g

    def _tuner(self) -> Iterable[Metric]:
        """The tuner's progress (nothing without a tuner)."""
        tuner = self.router.tuner
        if tuner is None:
            return
        steps = CounterMetricFamily(
            "gorgo_tuner_steps",
            "Tuner steps (rounds decided) by this process, by outcome",
            labels=["outcome"],
        )
        steps.add_metric(["accepted"], tuner.steps_accepted)
        steps.add_metric(["rejected"], tuner.steps_rejected)
        # the arms decided alike: no verdict (TunerSettings.tie_decisions)
        steps.add_metric(["tied"], tuner.steps_tied)
        samples = CounterMetricFamily(
            "gorgo_tuner_samples", "Completions the tuner scored (restored from its state file)"
        )
        samples.add_metric([], tuner.state.samples)
        frozen = GaugeMetricFamily(
            "gorgo_tuner_frozen", "1 while the tuner is frozen (parent serves all traffic)"
        )
        frozen.add_metric([], 1.0 if tuner.state.frozen else 0.0)
        sigma = GaugeMetricFamily("gorgo_tuner_sigma", "The tuner's mutation step size (log space)")
        sigma.add_metric([], tuner.state.sigma)
        yield from (steps, samples, frozen, sigma)

    def _prefix_state(self) -> Iterable[Metric]:
        """Per backend: whether its prefix state is the engine's own, and its event stream."""
        precise = GaugeMetricFamily(
            "gorgo_prefix_state_precise",
            "1 while the prefix state comes from the engine's KV events, 0: the router's own",
            labels=["backend"],
        )
        blocks = GaugeMetricFamily(
            "gorgo_kv_event_blocks", "Blocks the engine reports holding", labels=["backend"]
        )
        gaps = GaugeMetricFamily(
            "gorgo_kv_event_gaps", "Gaps seen in the engine's event sequence", labels=["backend"]
        )
        resets = GaugeMetricFamily(
            "gorgo_kv_event_resets", "Times the engine's state was reset", labels=["backend"]
        )
        lag = GaugeMetricFamily(
            "gorgo_kv_event_age_seconds",
            "Seconds since the engine's last event batch was stamped",
            labels=["backend"],
        )
        tokens_ok = GaugeMetricFamily(
            "gorgo_backend_tokens_ok",
            "1 while the router's token ids are known to be the engine's (events can match); "
            "0: they are not (no tokenizer, a mismatch, or not checked yet)",
            labels=["backend"],
        )
        warming = GaugeMetricFamily(
            "gorgo_prefix_state_warming",
            "1 while the engine's events are used but its earlier history may be missing "
            "(predictions are the events' or the router's own, whichever is more)",
            labels=["backend"],
        )
        unsupported = GaugeMetricFamily(
            "gorgo_kv_event_unsupported",
            "1 while the engine's event stream has a shape the router cannot key",
            labels=["backend"],
        )
        unknown = GaugeMetricFamily(
            "gorgo_kv_event_unknown_parents",
            "Stored blocks dropped because their parent was never seen (the warm-start blind spot)",
            labels=["backend"],
        )
        now = time.time()  # event batches carry the engine's wall-clock stamp
        for b, st in self.router.backends.items():
            state = prefix_state(st)
            precise.add_metric([b], 1.0 if state is PrefixState.PRECISE else 0.0)
            engine = st.engine.blocks
            if engine is None:
                continue
            warming.add_metric([b], 1.0 if state is PrefixState.WARMING else 0.0)
            unsupported.add_metric([b], 0.0 if engine.unsupported is None else 1.0)
            unknown.add_metric([b], engine.health.unknown_parent_blocks)
            tokens_ok.add_metric([b], 1.0 if st.engine.tokens.ok else 0.0)
            blocks.add_metric([b], engine.blocks)
            gaps.add_metric([b], engine.gaps)
            resets.add_metric([b], engine.resets)
            if engine.last_ts is not None:
                lag.add_metric([b], max(0.0, now - engine.last_ts))
        yield from (precise, warming, blocks, gaps, resets, lag, tokens_ok, unsupported, unknown)


class Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "gorgo_decisions", "Routing decisions", ["backend", "policy", "model"], registry=r
        )
        self.ttft = Histogram(
            "gorgo_ttft_seconds",
            "TTFT seen at the proxy",
            ["backend"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "gorgo_e2e_seconds",
            "End-to-end time",
            ["backend"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.term = Histogram(
            "gorgo_cost_term_ms",
            "Cost terms of the chosen backend (ms)",
            ["term"],
            buckets=TERM_BUCKETS_MS,
            registry=r,
        )
        self.prompt_tokens = Counter("gorgo_prompt_tokens", "Prompt tokens routed", registry=r)
        self.cached_tokens = Counter(
            "gorgo_prefix_cached_tokens",
            "Prompt tokens the chosen backend held (index)",
            registry=r,
        )
        self.prediction_error = Histogram(
            "gorgo_prefix_prediction_error_ratio",
            "|predicted - engine-reported cached tokens| / prompt tokens, per request the "
            "engine reported on",
            ["backend", "prefix_state"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.completions = Counter(
            "gorgo_completions", "Requests closed, by status", ["backend", "status"], registry=r
        )
        self.fallback = Counter(
            "gorgo_fallback", "Requests the fail-open route served", ["backend"], registry=r
        )
        self.reloads = Counter(
            "gorgo_config_reloads",
            "Config reloads (SIGHUP, file change), by result: ok or error (refused)",
            ["result"],
            registry=r,
        )
        r.register(_LiveGauges(router))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
        m.prompt_tokens.inc(d.input_tokens)
        m.cached_tokens.inc(chosen.cached_tokens)
        if self._tracer is None:
            return
        ctx = TraceContextTextMapPropagator().extract(dict(e.request.trace_context))
        attributes = {**self._attributes(d, e.request.session_key), **self._prefix_attributes(e)}
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

    # -- attributes ---------------------------------------------------------------------

    def _prefix_attributes(self, e: Dispatched) -> dict[str, Any]:
        """The chosen backend's prefix state: where the prediction came from, and how
        fresh the engine's events and load report were."""
        rec = e.record
        attrs: dict[str, Any] = {
            A_PREFIX_STATE: str(rec.prefix_state),
            A_PREDICTED_CACHED: rec.cached_tokens,
        }
        b = self.router.backends[rec.backend]
        engine = b.engine.blocks
        if engine is not None:
            attrs[A_KV_EVENT_GAPS] = engine.gaps
            attrs[A_KV_EVENT_RESETS] = engine.resets
            if engine.last_ts is not None:  # the engine's wall-clock stamp
                attrs[A_KV_EVENT_AGE_S] = round(max(0.0, time.time() - engine.last_ts), 3)
        if b.engine.report_at_s is not None:
            attrs[A_ENGINE_REPORT_AGE_S] = round(e.now_s - b.engine.report_at_s, 3)
        return attrs

    def _attributes(self, d: Decision, session_key: str | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            A_REQUEST_ID: d.request_id,
            A_POLICY: d.policy,
            A_BACKEND: d.backend,
            A_INPUT_TOKENS: d.input_tokens,
            A_MODEL: d.model or "",
            A_SESSION_HASH: session_hash(session_key),
            A_PREDICTED_TTFT_MS: round(d.chosen.predicted_ttft_ms, 3),
            A_PREDICTED_E2E_MS: round(d.chosen.predicted_e2e_ms, 3),
        }
        if d.draining:
            attrs[A_DRAINING_BACKENDS] = list(d.draining)
        if d.hold_ms:
            attrs[A_PACE_HOLD_MS] = round(d.hold_ms, 3)
        if d.weights is not None:
            attrs[A_WEIGHT_RTT] = d.weights.rtt
            attrs[A_WEIGHT_QUEUE] = d.weights.queue
        tuner = self.router.tuner
        if tuner is not None:
            attrs[A_WEIGHTS_VERSION] = len(tuner.state.history)
            attrs[A_TUNER_ARM] = d.arm or ""
        for c in d.candidates:
            values: dict[str, float | int] = {
                TERMS[name].key if name in TERMS else name: value for name, value in c.terms.items()
            }
            values.update(
                cached_tokens=c.cached_tokens,
                cost=d.scores.get(c.backend_id, 0.0),
                predicted_ttft_ms=c.predicted_ttft_ms,
                predicted_e2e_ms=c.predicted_e2e_ms,
            )
            for f, v in values.items():
                attrs[A_CANDIDATE.format(backend=c.backend_id, field=f)] = (
                    round(v, 3) if isinstance(v, float) else v
                )
        return attrs
