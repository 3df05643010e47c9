"""The router's Prometheus metrics: counters and histograms updated on each request's
lifecycle, and the live gauges (gauges.py), in one registry (/metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ext_proc.core.router import Router
from ext_proc.service.telemetry.gauges import BuildInfo, LiveGauges

# Buckets (seconds, as every time the router exports) sized for LLM latencies: TTFT from
# 10 ms to minutes; a cost term from half a millisecond (an RTT on one host) to 30 s.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TERM_BUCKETS_S = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Prediction error as a share of the prompt: the target for precise state is a 2 % mean,
# the simulator's figures are fractions of a percent; a whole prompt wrong is 1.
ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class Children(dict[tuple[str, ...], Any]):
    """A labelled metric's children by their label values, each looked up once:
    prometheus_client's `labels()` validates and locks on every call, a dozen times a
    request."""

    def __init__(self, metric: Counter | Histogram) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: tuple[str, ...]) -> Any:
        child = self[key] = self.metric.labels(*key)
        return child


class Metrics:
    """The router's Prometheus registry, served on /metrics: counters and histograms that
    Telemetry and the reloader update as requests and reloads happen, and the gauges read
    from the router at scrape time (gauges.py)."""

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
            "gorgo_cost_term_seconds",
            "Cost terms of the chosen backend (those in ms), and the dispatch pacing's hold",
            ["term"],
            buckets=TERM_BUCKETS_S,
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
        self.flow_wait = Histogram(
            "gorgo_flow_wait_seconds",
            "Wait in the gateway queue before the decision (flow control; 0: straight through)",
            buckets=(0.0, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        r.register(LiveGauges(router))
        r.register(BuildInfo(router))

    def render(self) -> bytes:
        return generate_latest(self.registry)
