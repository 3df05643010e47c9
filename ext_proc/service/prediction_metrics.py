"""The latency predictions' error as Prometheus gauges, per backend and measure: the MAPE
(a fraction) and the bias (mean predicted - measured, ms) over each backend's last
completions (`estimate.latency_error.LATENCY_WINDOW`), read from the router at scrape time.
A backend without a measured completion yet has no sample (not a 0 that reads as exact).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from ext_proc.core.state import BackendState
from ext_proc.estimate.latency_error import ErrorWindow

# (measure, what it measures): the metric names are gorgo_{measure}_prediction_mape and
# gorgo_{measure}_prediction_bias_ms.
MEASURES = (
    ("ttft", "TTFT (streamed requests, from the decision to the first byte)"),
    ("e2e", "E2E (from the decision to the end of the response)"),
)


def _window(b: BackendState, measure: str) -> ErrorWindow:
    return b.latency.ttft if measure == "ttft" else b.latency.e2e


def latency_prediction_gauges(backends: Iterable[BackendState]) -> Iterable[Metric]:
    shown = list(backends)
    for measure, what in MEASURES:
        mape = GaugeMetricFamily(
            f"gorgo_{measure}_prediction_mape",
            f"Mean |predicted - measured| / measured {what}, over the backend's last "
            "completions (a fraction)",
            labels=["backend"],
        )
        bias = GaugeMetricFamily(
            f"gorgo_{measure}_prediction_bias_ms",
            f"Mean predicted - measured {what}, ms, over the backend's last completions "
            "(> 0: predicted slower than it came)",
            labels=["backend"],
        )
        for b in shown:
            w = _window(b, measure)
            m, bias_ms = w.mape, w.bias_ms
            if m is not None and bias_ms is not None:
                mape.add_metric([b.id], m)
                bias.add_metric([b.id], bias_ms)
        yield from (mape, bias)
