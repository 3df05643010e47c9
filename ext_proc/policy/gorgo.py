"""GORGO: the backend with the lowest estimated time to first token.

`gorgo` (default) compares w_rtt * RTT + w_queue * Tqueue + Tprefill(uncached), all in ms.
`gorgo_tokens` is the paper's implementation, in token units:
w_rtt * rtt_ms + uncached_tokens + w_queue * queued_tokens. Both break near-ties at random.
The weights are attributes so the online tuner can move them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ext_proc.config import Config
from ext_proc.cost import Weights, time_cost_ms, token_cost
from ext_proc.policy import Candidate, Choice, RouteRequest, near_ties, pick_min, register


@register("gorgo")
class Gorgo:
    name = "gorgo"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng
        self.weights = Weights(cfg.weights.rtt, cfg.weights.queue)
        self._tie_ms = cfg.routing.tie_ms
        self._tie_frac = cfg.routing.tie_fraction

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        w = self.weights
        scores = {
            c.backend_id: time_cost_ms(w, c.rtt_ms, c.queue_ms, c.prefill_ms) for c in candidates
        }
        # Costs this close are within the estimates' error: among them take the backend
        # with the fewest requests in flight (its decode batch, hence everyone's ITL and
        # E2E, grows least), at random among equals.
        tied_ids = set(near_ties(scores, self._tie_ms, self._tie_frac))
        tied = [c for c in candidates if c.backend_id in tied_ids]
        fewest = min(c.in_flight for c in tied)
        chosen = self._rng.choice([c for c in tied if c.in_flight == fewest])
        return Choice(chosen.backend_id, scores)


@register("gorgo_tokens")
class GorgoTokens:
    name = "gorgo_tokens"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng
        self.weights = Weights(cfg.token_weights.rtt, cfg.token_weights.queue)
        self._tie_frac = cfg.routing.tie_fraction

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        w = self.weights
        scores = {
            c.backend_id: token_cost(w, c.rtt_ms, c.uncached_tokens, c.queued_tokens)
            for c in candidates
        }
        # Token units: a 1-token tie band would be no band; use the relative one only.
        return Choice(pick_min(scores, self._rng, 0.0, self._tie_frac), scores)
