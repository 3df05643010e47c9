"""How right the router's latency predictions were: per request, the TTFT and E2E it
predicted on the backend it chose (`Candidate.predicted_ttft_ms`, `predicted_e2e_ms`)
against what it measured at the close; per backend, the mean absolute percentage error
(MAPE, a fraction) and the bias (mean of predicted - measured, ms) over a window.

Pure. Only a request that completed counts: a failure, an expiry or a failover says
nothing about the prediction. TTFT counts only for a streamed request (without a stream
the first byte comes when generation ends: it is not the first token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ext_proc.vocab.events import Closed
from ext_proc.vocab.types import Status

# The window of /state's and the metrics' figures per backend: the last 128 completions
# there, a few minutes of one backend's traffic, so a backend that changes shows within
# minutes, while one slow request moves the MAPE by under 1 % of its own error.
LATENCY_WINDOW = 128


@dataclass(frozen=True)
class LatencyError:
    """One request's TTFT or E2E on its chosen backend: predicted at the decision against
    measured at the close, both in ms."""

    predicted_ms: float
    measured_ms: float

    @property
    def error_ms(self) -> float:
        """Predicted minus measured: > 0 the router expected it slower than it was."""
        return self.predicted_ms - self.measured_ms

    @property
    def abs_pct_error(self) -> float:
        """|error| as a fraction of the measured time (1.0: off by the whole of it)."""
        return abs(self.error_ms) / self.measured_ms


def ttft_error(e: Closed) -> LatencyError | None:
    """The request's TTFT prediction error, or None when it is not known."""
    rec = e.record
    if (
        e.status != Status.OK
        or not rec.streaming
        or rec.predicted_ttft_ms is None
        or e.ttft_ms is None
        or e.ttft_ms <= 0
    ):
        return None
    # both from its arrival: the wait in the gateway queue was known when it was sent on
    return LatencyError(rec.predicted_ttft_ms + rec.waited_ms, e.ttft_ms)


def e2e_error(e: Closed) -> LatencyError | None:
    """The request's E2E prediction error, or None when it is not known."""
    predicted = e.record.predicted_e2e_ms
    if e.status != Status.OK or predicted is None or e.e2e_ms <= 0:
        return None
    return LatencyError(predicted + e.record.waited_ms, e.e2e_ms)


def _means(errs: Sequence[LatencyError]) -> tuple[float | None, float | None]:
    """(MAPE as a fraction, bias in ms) of the errors; None for each when there are none."""
    if not errs:
        return None, None
    n = len(errs)
    return sum(e.abs_pct_error for e in errs) / n, sum(e.error_ms for e in errs) / n


def error_summary(errors: Iterable[LatencyError]) -> dict[str, Any]:
    """{"mape": fraction, "bias_ms": ms, "requests": n} (None figures: no request)."""
    errs = list(errors)
    mape, bias_ms = _means(errs)
    return {
        "mape": None if mape is None else round(mape, 6),
        "bias_ms": None if bias_ms is None else round(bias_ms, 3),
        "requests": len(errs),
    }


class ErrorWindow:
    """One measure's errors on one backend: how many requests had one, and the last
    `window` of them (the figures are computed when read: nothing on the request path
    beyond an append)."""

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self.requests = 0
        self._recent: deque[LatencyError] = deque(maxlen=window)

    def add(self, err: LatencyError) -> None:
        self.requests += 1
        self._recent.append(err)

    @property
    def mape(self) -> float | None:
        """Mean |predicted - measured| / measured over the window (None: empty)."""
        return _means(self._recent)[0]

    @property
    def bias_ms(self) -> float | None:
        """Mean predicted - measured over the window, ms (None: empty)."""
        return _means(self._recent)[1]

    def as_json(self) -> dict[str, Any]:
        """The window's figures, and `requests`: every request with a measure so far."""
        return {
            **error_summary(self._recent),
            "window": len(self._recent),
            "requests": self.requests,
        }


class LatencyStats:
    """One backend's TTFT and E2E prediction errors (fed by
    `learn.learners.PredictionLearner` at each close)."""

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self.ttft = ErrorWindow(window)
        self.e2e = ErrorWindow(window)

    def observe(self, e: Closed) -> None:
        if (t := ttft_error(e)) is not None:
            self.ttft.add(t)
        if (d := e2e_error(e)) is not None:
            self.e2e.add(d)

    def as_json(self) -> dict[str, Any]:
        return {"ttft": self.ttft.as_json(), "e2e": self.e2e.as_json()}
