"""How right the router's prefix state was: per request, the cached tokens it predicted on
the backend it chose against what that engine reported at completion, by where the
prediction came from (`PrefixState`: the engine's KV events, or the router's own index).

Pure; a backend's `PredictionStats` sit in its record. Only a request that completed and whose
engine reported its cached tokens counts: a failure, or a response without a cached-token
report, says nothing about the prediction.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ext_proc.vocab.events import Closed
from ext_proc.vocab.types import PrefixState, Status

# /state's mean is over the last 128 reports per backend and prefix state: a few minutes
# of one backend's traffic, so a stream gone stale shows within minutes, not hours.
PREDICTION_WINDOW = 128


@dataclass(frozen=True)
class PredictionError:
    """One request's cached tokens on its chosen backend: predicted at the decision against
    what the engine reported at completion, with the prompt's length to scale the error."""

    predicted_tokens: int
    reported_tokens: int
    prompt_tokens: int

    @property
    def error_tokens(self) -> int:
        """Predicted minus reported: > 0 the router believed more cached than there was."""
        return self.predicted_tokens - self.reported_tokens

    @property
    def error_ratio(self) -> float:
        """|error| as a share of the prompt (the simulator's `prediction_error` per row)."""
        return abs(self.error_tokens) / self.prompt_tokens


def prediction_error(e: Closed) -> PredictionError | None:
    """The request's prediction error, or None when it is not known."""
    rec = e.record
    if e.status != Status.OK or e.cached_tokens is None or rec.input_tokens <= 0:
        return None
    return PredictionError(rec.cached_tokens, e.cached_tokens, rec.input_tokens)


class PredictionStats:
    """One backend's figures per prefix state: requests with a known error, and the mean
    error share over the last `window` of them (fed by `learn.learners.PredictionLearner`)."""

    def __init__(self, window: int = PREDICTION_WINDOW) -> None:
        self.window = window
        self._requests: dict[PrefixState, int] = {}
        self._recent: dict[PrefixState, deque[float]] = {}

    def add(self, state: PrefixState, err: PredictionError) -> None:
        self._requests[state] = self._requests.get(state, 0) + 1
        self._recent.setdefault(state, deque(maxlen=self.window)).append(err.error_ratio)

    def as_json(self) -> dict[str, Any]:
        """{prefix state: {"requests": n, "mean_error_ratio": m}} for the states seen."""
        out: dict[str, Any] = {}
        for state in PrefixState:
            recent = self._recent.get(state)
            if recent:
                out[str(state)] = {
                    "requests": self._requests[state],
                    "mean_error_ratio": round(sum(recent) / len(recent), 6),
                }
        return out
