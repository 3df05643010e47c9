"""Load-only baselines: round robin, uniform random, fewest requests in flight."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ext_proc.policy import Candidate, RouteRequest, register


@register("round_robin")
class RoundRobin:
    name = "round_robin"

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> str:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen.backend_id


@register("random")
class UniformRandom:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> str:
        return self._rng.choice(candidates).backend_id


@register("least_request")
class LeastRequest:
    """Fewest requests in flight; ties broken at random so equal backends share load."""

    name = "least_request"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> str:
        fewest = min(c.in_flight for c in candidates)
        return self._rng.choice([c for c in candidates if c.in_flight == fewest]).backend_id
