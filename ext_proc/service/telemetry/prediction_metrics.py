"""Per-backend gauges read from the router at scrape time: the latency predictions' error
per measure, the MAPE (a fraction) and the bias (mean predicted - measured, seconds) over each
backend's last completions (`estimate.latency_error.LATENCY_WINDOW`; a backend without a
measured completion yet has no sample, not a 0 that reads as exact); and the models each
backend serves.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from ext_proc.core.backend import BackendState
from ext_proc.estimate.latency_error import ErrorWindow

# (measure, what it measures): the metric names are gorgo_{measure}_prediction_mape_ratio
# and gorgo_{measure}_prediction_bias_seconds.
MEASURES = (
    ("ttft", "TTFT (streamed requests, from the decision to the first byte)"),
    ("e2e", "E2E (from the decision to the end of the response)"),
)


def _window(b: BackendState, measure: str) -> ErrorWindow:
    return b.learned.latency.ttft if measure == "ttft" else b.learned.latency.e2e


def latency_prediction_gauges(backends: Iterable[BackendState]) -> Iterable[Metric]:
    shown = list(backends)
    for measure, what in MEASURES:
        mape = GaugeMetricFamily(
            f"gorgo_{measure}_prediction_mape_ratio",
            f"Mean |predicted - measured| / measured {what}, over the backend's last "
            "completions (a fraction)",
            labels=["backend"],
        )
        bias = GaugeMetricFamily(
            f"gorgo_{measure}_prediction_bias_seconds",
            f"Mean predicted - measured {what}, seconds, over the backend's last completions "
            "(> 0: predicted slower than it came)",
            labels=["backend"],
        )
        for b in shown:
            w = _window(b, measure)
            m, bias_ms = w.mape, w.bias_ms
            if m is not None and bias_ms is not None:
                mape.add_metric([b.id], m)
                bias.add_metric([b.id], bias_ms / 1000)
        yield from (mape, bias)


def step_model_gauges(backends: Iterable[BackendState]) -> Iterable[Metric]:
    """gorgo_step_model_fit_in_use{backend}: 1 while the replay uses the backend's fitted
    step model, 0 while it fell back to the profile's coefficients (its fit's recent error
    worse than the profile's); no sample where the replay is not in use."""
    in_use = GaugeMetricFamily(
        "gorgo_step_model_fit_in_use",
        "1 while the replay uses the backend's fitted step model, 0 while it fell back to "
        "the profile (routing.ttft_model: replay)",
        labels=["backend"],
    )
    for b in backends:
        if b.learned.step is not None:
            in_use.add_metric([b.id], 1 if b.learned.step.using_fit else 0)
    yield in_use


def served_model_gauges(backends: Iterable[BackendState]) -> Iterable[Metric]:
    """gorgo_backend_model{backend, model, kind}: 1 per model a backend may be sent (its
    engine's /v1/models or config), kind "base" or "adapter" (a LoRA adapter)."""
    served = GaugeMetricFamily(
        "gorgo_backend_model",
        "1 per model a backend serves (its engine's /v1/models, or backends[].models)",
        labels=["backend", "model", "kind"],
    )
    for b in backends:
        models = b.models
        if models is None:
            continue
        for name in sorted(models.base):
            served.add_metric([b.id, name, "base"], 1)
        for name in sorted(models.adapters):
            served.add_metric([b.id, name, "adapter"], 1)
    yield served
