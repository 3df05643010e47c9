"""GORGO: the backend with the lowest estimated time to first token.

`gorgo` (default) compares w_rtt * RTT + w_queue * Tqueue + Tprefill(uncached), all in ms.
`gorgo_tokens` is the paper's implementation, in token units:
w_rtt * rtt_ms + uncached_tokens + w_queue * in_flight_tokens. Both break near-ties at
random. The router hands each decision its current weights (it owns and tunes them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ext_proc.config import bounded
from ext_proc.cost import Weights, time_cost_ms, token_cost
from ext_proc.policy import (
    Candidate,
    Choice,
    RouteRequest,
    WeightedParams,
    near_ties,
    pick_min,
    register,
)


@dataclass(frozen=True)
class TimeWeights(Weights):
    """Both terms are ms of TTFT, so 1.0 each is the physical starting point."""

    rtt: float = bounded(1.0, gt=0.0)
    queue: float = bounded(1.0, gt=0.0)


@dataclass(frozen=True)
class TokenWeights(Weights):
    """The paper's initial weights for its token-form cost."""

    rtt: float = bounded(0.5, gt=0.0)
    queue: float = bounded(0.1, gt=0.0)


@dataclass(frozen=True)
class GorgoParams(WeightedParams):
    weights: TimeWeights = field(default_factory=TimeWeights)
    # Costs within tie_ms, or within tie_fraction of the best, count as a tie (a fixed
    # order herds requests onto one backend). Among them gorgo takes the fewest in
    # flight: cost estimates err by tens of percent under load (queueing), and within
    # that band the lighter decode batch protects E2E; measured on the Mooncake trace,
    # 20 % lowered p95 TTFT and p95 E2E against 2 % (docs/results.md).
    tie_ms: float = bounded(1.0, ge=0.0)
    tie_fraction: float = bounded(0.2, ge=0.0)


@dataclass(frozen=True)
class GorgoTokensParams(WeightedParams):
    weights: TokenWeights = field(default_factory=TokenWeights)
    # Token units: a 1-token tie band would be no band; only the relative one.
    tie_fraction: float = bounded(0.2, ge=0.0)
    # The paper's bounds, in its token units.
    TUNER_BOUNDS: ClassVar[tuple[tuple[float, float], tuple[float, float]] | None] = (
        (0.05, 2.0),
        (0.05, 0.5),
    )


def _weights(weights: Weights | None) -> Weights:
    if weights is None:
        raise ValueError("a weighted policy needs the router's weights")
    return weights


@register("gorgo", params=GorgoParams)
class Gorgo:
    name = "gorgo"

    def __init__(self, rng: random.Random, params: GorgoParams) -> None:
        self._rng = rng
        self._p = params

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        w = _weights(weights)
        scores = {
            c.backend_id: time_cost_ms(w, c.rtt_ms, c.queue_ms, c.prefill_ms) for c in candidates
        }
        tied_ids = set(near_ties(scores, self._p.tie_ms, self._p.tie_fraction))
        tied = [c for c in candidates if c.backend_id in tied_ids]
        fewest = min(c.in_flight for c in tied)
        chosen = self._rng.choice([c for c in tied if c.in_flight == fewest])
        return Choice(chosen.backend_id, scores)


@register("gorgo_tokens", params=GorgoTokensParams)
class GorgoTokens:
    name = "gorgo_tokens"

    def __init__(self, rng: random.Random, params: GorgoTokensParams) -> None:
        self._rng = rng
        self._p = params

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        w = _weights(weights)
        scores = {
            c.backend_id: token_cost(w, c.rtt_ms, c.uncached_tokens, c.in_flight_tokens)
            for c in candidates
        }
        return Choice(pick_min(scores, self._rng, 0.0, self._p.tie_fraction), scores)
