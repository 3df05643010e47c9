"""Baselines from the GORGO paper's comparison: load-only, affinity and cache-only."""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.policy.base import NoParams, pick_min, register
from ext_proc.prompt.tokens import BYTES_PER_TOKEN
from ext_proc.vocab.params import bounded
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights


@register("round_robin")
class RoundRobin:
    """The candidates in turn, blind to load, RTT and cache: a baseline."""

    name = "round_robin"

    def __init__(self, rng: random.Random, params: NoParams) -> None:
        self._next = 0

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Choice(chosen.backend_id, {})


@register("random")
class UniformRandom:
    """A candidate drawn uniformly at random, blind to load, RTT and cache: a baseline."""

    name = "random"

    def __init__(self, rng: random.Random, params: NoParams) -> None:
        self._rng = rng

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        return Choice(self._rng.choice(candidates).backend_id, {})


@register("least_request")
class LeastRequest:
    """Fewest requests in flight; ties broken at random."""

    name = "least_request"

    def __init__(self, rng: random.Random, params: NoParams) -> None:
        self._rng = rng

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        scores = {c.backend_id: float(c.in_flight) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)


@register("least_load")
class LeastLoad:
    """Fewest prompt tokens in flight (work, not request count); ties at random."""

    name = "least_load"

    def __init__(self, rng: random.Random, params: NoParams) -> None:
        self._rng = rng

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        scores = {c.backend_id: float(c.in_flight_tokens) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)


@dataclass(frozen=True)
class SessionAffinityParams:
    """`policies.session_affinity`: how much of the prompt stands in for a missing session
    key."""

    # Without a session key: hash the first this-many prompt tokens.
    prefix_tokens: int = bounded(256, gt=0)


@register("session_affinity", params=SessionAffinityParams)
class SessionAffinity:
    """Rendezvous hashing of the session key (else the prompt's head) over the healthy
    backends: a session stays put, and only its share moves when a backend leaves."""

    name = "session_affinity"

    def __init__(self, rng: random.Random, params: SessionAffinityParams) -> None:
        self._p = params

    def affinity_key(self, request: RouteRequest) -> str:
        if request.session_key:
            return request.session_key
        if request.llm is None:
            return request.request_id
        first = request.llm.prompts[0]
        if isinstance(first, tuple):  # token ids
            head = array("q", first[: self._p.prefix_tokens]).tobytes()
        else:
            head = first[: self._p.prefix_tokens * BYTES_PER_TOKEN].encode()
        return f"prompt:{zlib.crc32(head):08x}"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        key = self.affinity_key(request).encode()
        # crc32, not hash(): the same session maps the same way in every process.
        scores = {
            c.backend_id: -float(zlib.crc32(c.backend_id.encode(), zlib.crc32(key)))
            for c in candidates
        }
        return Choice(min(scores, key=lambda b: scores[b]), scores)


@dataclass(frozen=True)
class PrefixCacheParams:
    """`policies.prefix_cache`: when the best cache match is followed, and what load
    imbalance overrides it."""

    # Follow the best cache match when it covers at least this share of the prompt,
    # unless load is imbalanced (max - min in flight > balance_abs and max > balance_rel
    # x min); then least request.
    min_fraction: float = bounded(0.5, ge=0.0, le=1.0)
    balance_abs: int = bounded(4, ge=0)
    balance_rel: float = bounded(1.5, gt=0.0)


@register("prefix_cache", params=PrefixCacheParams)
class PrefixCache:
    """The paper's cache baseline: the longest cached prefix, unless load is imbalanced
    or the best match covers too little of the prompt; then fewest requests in flight."""

    name = "prefix_cache"

    def __init__(self, rng: random.Random, params: PrefixCacheParams) -> None:
        self._rng = rng
        self._p = params

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        loads = [c.in_flight for c in candidates]
        lo, hi = min(loads), max(loads)
        imbalanced = hi - lo > self._p.balance_abs and hi > self._p.balance_rel * lo
        best = max(candidates, key=lambda c: c.cached_tokens)
        tokens = best.cached_tokens + best.uncached_tokens
        if not imbalanced and tokens and best.cached_tokens >= self._p.min_fraction * tokens:
            scores = {c.backend_id: -float(c.cached_tokens) for c in candidates}
            return Choice(pick_min(scores, self._rng), scores)
        scores = {c.backend_id: float(c.in_flight) for c in candidates}
        return Choice(pick_min(scores, self._rng), scores)
