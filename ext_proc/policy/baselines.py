"""Baselines from the GORGO paper's comparison: load-only, affinity and cache-only."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from ext_proc.config import Config
from ext_proc.policy import Candidate, Choice, RouteRequest, pick_min, register


@register("round_robin")
class RoundRobin:
    name = "round_robin"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Choice(chosen.backend_id, {})


@register("random")
class UniformRandom:
    name = "random"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        return Choice(self._rng.choice(candidates).backend_id, {})


@register("least_request")
class LeastRequest:
    """Fewest requests in flight; ties broken at random."""

    name = "least_request"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        scores = {c.backend_id: float(c.in_flight) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)


@register("least_load")
class LeastLoad:
    """Fewest prompt tokens in flight (work, not request count); ties at random."""

    name = "least_load"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        scores = {c.backend_id: float(c.queued_tokens) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)


@register("session_affinity")
class SessionAffinity:
    """Rendezvous hashing of the session key (else the prompt's head) over the healthy
    backends: a session stays put, and only its share moves when a backend leaves."""

    name = "session_affinity"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        key = request.affinity_key.encode()
        # crc32, not hash(): the same session maps the same way in every process.
        scores = {
            c.backend_id: -float(zlib.crc32(c.backend_id.encode(), zlib.crc32(key)))
            for c in candidates
        }
        return Choice(min(scores, key=lambda b: scores[b]), scores)


@register("prefix_cache")
class PrefixCache:
    """The paper's cache baseline: the longest cached prefix, unless load is imbalanced
    or the best match covers too little of the prompt; then fewest requests in flight."""

    name = "prefix_cache"

    def __init__(self, rng: random.Random, cfg: Config) -> None:
        self._rng = rng
        self._r = cfg.routing

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        loads = [c.in_flight for c in candidates]
        lo, hi = min(loads), max(loads)
        imbalanced = hi - lo > self._r.balance_abs and hi > self._r.balance_rel * lo
        best = max(candidates, key=lambda c: c.cached_tokens)
        tokens = best.cached_tokens + best.uncached_tokens
        if not imbalanced and tokens and best.cached_tokens >= self._r.prefix_min_fraction * tokens:
            scores = {c.backend_id: -float(c.cached_tokens) for c in candidates}
            return Choice(pick_min(scores, self._rng), scores)
        scores = {c.backend_id: float(c.in_flight) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)
