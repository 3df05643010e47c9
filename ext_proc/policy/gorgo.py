"""GORGO: the backend with the lowest estimated time to first token, counting what sending
the request there does to the requests already there.

`gorgo` (default) compares, all in ms (docs/cost-model.md):

    w_rtt * RTT + w_queue * Tqueue + Tprefill        the newcomer's own TTFT
    + decode_stall_weight * Tstall                   its prefill stalls every request there
    + kv_weight * Tkv                                the KV pool there is nearly full

`gorgo_time3` is the paper's three-term time form alone (what `gorgo` was before it priced
what a decision does to the others);
`gorgo_tokens` the paper's implementation, in token units: w_rtt * rtt_ms +
uncached_tokens + w_queue * in_flight_tokens. The router hands each decision its current
(w_rtt, w_queue) (it owns and tunes them); the other weights are the policy's parameters.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

from ext_proc.estimate.cost import token_cost
from ext_proc.estimate.transfer import PairKnobs
from ext_proc.policy.base import WeightedParams, near_ties, pick_min, register
from ext_proc.vocab.params import bounded
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.terms import TERMS
from ext_proc.vocab.types import Candidate, RouteRequest, Weights

P = TypeVar("P")


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
class GorgoTime3Params(WeightedParams):
    """`policies.gorgo_time3`: its starting time weights and its near-tie band."""

    weights: TimeWeights = field(default_factory=TimeWeights)
    # Costs within tie_ms, or within tie_fraction of the best, count as a tie (a fixed
    # order herds requests onto one backend). Among them the fewest in flight: cost
    # estimates err by tens of percent under load (queueing), and within that band the
    # lighter decode batch protects E2E; measured on the Mooncake trace, 20 % lowered p95
    # TTFT and p95 E2E against 2 % (docs/results.md).
    tie_ms: float = bounded(1.0, ge=0.0)
    tie_fraction: float = bounded(0.2, ge=0.0)


@dataclass(frozen=True)
class GorgoParams(WeightedParams):
    """`policies.gorgo`: its starting time weights (the router owns them from then on), the
    weights of the decode-stall and KV terms, and its near-tie rule."""

    weights: TimeWeights = field(default_factory=TimeWeights)
    # ms of the others' E2E per ms of the newcomer's TTFT. Measured on the Mooncake
    # trace's windows (time_scale 3-6, both RTT profiles; docs/cost-model.md): 0.1 left p95
    # E2E 6 % above 0.3's, 1.0 cost 7 % of p95 TTFT, 0.2-0.5 were alike.
    decode_stall_weight: float = bounded(0.3, ge=0.0)
    # The wait within the KV margin is a wait like the queue's.
    kv_weight: float = bounded(1.0, ge=0.0)
    # ms of score per ms of the newcomer's own predicted decode (its E2E after the first
    # token): where backends decode at different speeds.
    decode_weight: float = bounded(0.0, ge=0.0)
    # Near-ties, then the fewest in flight. Only exact ties: the decode-stall term already
    # steers a long prompt off a crowded backend (what gorgo_time3's 20 % band was for),
    # and a band gives TTFT away (0.2 instead of 0: p95 TTFT +3 %, docs/cost-model.md).
    tie_ms: float = bounded(1.0, ge=0.0)
    tie_fraction: float = bounded(0.0, ge=0.0)
    # A disaggregated fleet (docs/cost-model.md, "The pair's price"): what the model cannot
    # know, the tuner's to own later. A prompt with fewer uncached tokens than this is
    # prefilled in its decode engine's region (or on an aggregated engine); a prefill in
    # another region must beat the best local choice by remote_margin_ms. 0 and 0: the
    # price alone decides.
    local_threshold_tokens: int = bounded(0, ge=0)
    remote_margin_ms: float = bounded(0.0, ge=0.0)


@dataclass(frozen=True)
class GorgoTokensParams(WeightedParams):
    """`policies.gorgo_tokens`: the paper's token-unit weights, a relative tie band, and the
    paper's tuner bounds in those units."""

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


def _fewest_in_flight(
    rng: random.Random,
    candidates: Sequence[Candidate],
    scores: dict[str, float],
    tie_ms: float,
    tie_fraction: float,
) -> Choice:
    """The lowest score; among near-ties the fewest in flight, then at random."""
    tied_ids = set(near_ties(scores, tie_ms, tie_fraction))
    tied = [c for c in candidates if c.backend_id in tied_ids]
    fewest = min(c.in_flight for c in tied)
    chosen = rng.choice([c for c in tied if c.in_flight == fewest])
    return Choice(chosen.backend_id, scores)


class _Scored(Generic[P]):
    """A GORGO form: a score per candidate from the router's weights (lowest wins), and a
    rule for near-ties."""

    name = ""

    def __init__(self, rng: random.Random, params: P) -> None:
        self._rng = rng
        self._p = params

    def scores(self, candidates: Sequence[Candidate], w: Weights) -> dict[str, float]:
        raise NotImplementedError

    def pick(self, candidates: Sequence[Candidate], scores: dict[str, float]) -> Choice:
        raise NotImplementedError

    def would_pick(self, candidates: Sequence[Candidate], weights: Weights, backend: str) -> bool:
        """Whether `weights` would choose `backend` too (it is among their near-ties; no
        RNG drawn): the tuner asks it with the other arm's weights at each decision."""
        scores = self.scores(candidates, weights)
        tie_ms = getattr(self._p, "tie_ms", 0.0)
        return backend in near_ties(scores, tie_ms, getattr(self._p, "tie_fraction", 0.0))

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        return self.pick(candidates, self.scores(candidates, _weights(weights)))


def weighted_sum(c: Candidate, weights: Mapping[str, float]) -> float:
    """A candidate's terms, each times its weight (in the terms' order: the sum is the
    same float whichever way it is asked for)."""
    total = 0.0
    for name, value in c.terms.items():
        weight = weights.get(name)
        if weight:
            total += weight * value
    return total


class _TieRule(Protocol):
    @property
    def tie_ms(self) -> float: ...

    @property
    def tie_fraction(self) -> float: ...


T = TypeVar("T", bound=_TieRule)


class _Weighted(_Scored[T]):
    """A score that is a weighted sum of the cost terms (vocab.terms)."""

    def term_weights(self, w: Weights) -> dict[str, float]:
        """Each registered term's weight in the score: the operator page draws each term
        at its weight, so a bar's length is the score."""
        raise NotImplementedError

    def scores(self, candidates: Sequence[Candidate], w: Weights) -> dict[str, float]:
        weights = self.term_weights(w)
        return {c.backend_id: weighted_sum(c, weights) for c in candidates}

    def pick(self, candidates: Sequence[Candidate], scores: dict[str, float]) -> Choice:
        p = self._p
        return _fewest_in_flight(self._rng, candidates, scores, p.tie_ms, p.tie_fraction)


def _own_ttft(w: Weights) -> dict[str, float]:
    """The newcomer's own TTFT: its trip weighed by w_rtt, the waits ahead of it by
    w_queue, its prefill as it is; any other registered term at its own weight."""
    weights = {name: info.weight for name, info in TERMS.items()}
    weights.update(rtt=w.rtt, queue=w.queue, lora_wait=w.queue, prefill=1.0)
    return weights


@register("gorgo", params=GorgoParams)
class Gorgo(_Weighted[GorgoParams]):
    """The default policy: the newcomer's own estimated TTFT, plus the stall its prefill
    causes the requests already there and the wait a nearly full KV pool adds, all in ms
    (the module's docstring); near-ties go to the fewest in flight."""

    name = "gorgo"

    @property
    def pair_knobs(self) -> PairKnobs:
        """Its knobs for choosing a (prefill, decode) pair (core.pairs)."""
        return PairKnobs(self._p.local_threshold_tokens, self._p.remote_margin_ms)

    def term_weights(self, w: Weights) -> dict[str, float]:
        return {
            **_own_ttft(w),
            "decode_stall": self._p.decode_stall_weight,
            "kv": self._p.kv_weight,
            "decode": self._p.decode_weight,
        }


@register("gorgo_time3", params=GorgoTime3Params)
class GorgoTime3(_Weighted[GorgoTime3Params]):
    """The paper's three-term time form: the newcomer's own TTFT only."""

    name = "gorgo_time3"

    def term_weights(self, w: Weights) -> dict[str, float]:
        return {**_own_ttft(w), "decode_stall": 0.0, "kv": 0.0}


@register("gorgo_tokens", params=GorgoTokensParams)
class GorgoTokens(_Scored[GorgoTokensParams]):
    """The paper's implementation, in token units: w_rtt * rtt_ms + uncached_tokens +
    w_queue * in_flight_tokens; near-ties are drawn at random."""

    name = "gorgo_tokens"

    def scores(self, candidates: Sequence[Candidate], w: Weights) -> dict[str, float]:
        return {
            c.backend_id: token_cost(w, c.rtt_ms, c.uncached_tokens, c.in_flight_tokens)
            for c in candidates
        }

    def pick(self, candidates: Sequence[Candidate], scores: dict[str, float]) -> Choice:
        return Choice(pick_min(scores, self._rng, 0.0, self._p.tie_fraction), scores)
