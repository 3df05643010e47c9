"""What a routing policy is: it chooses one of the candidates the framework built, with the
router's cost weights when it weighs cost terms (`ext_proc/policy/` registers them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ext_proc.vocab.types import Candidate, RouteRequest, Weights


@dataclass(frozen=True)
class Choice:
    """A policy's pick, with its score per backend (lower is better) for the decision's
    explanation."""

    backend_id: str
    # The policy's score per backend (lower is better), for the decision's explanation.
    scores: dict[str, float]


@dataclass(frozen=True)
class PairPick:
    """A disaggregated fleet's pair, picked by a `PairPolicy`: the decode engine, and the
    prefill engine (None: the decode engine prefills the prompt itself)."""

    decode: str
    prefill: str | None


class Policy(Protocol):
    """A routing policy: picks one of the candidates the framework built (registered with
    `policy.base.register`)."""

    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        """Pick one of `candidates` (never empty). `weights`: the router's current cost
        weights for a weighted policy, None for the others."""
        ...


class PairPolicy(Policy, Protocol):
    """A policy that picks a disaggregated fleet's pair itself, each leg by its own rule
    (the P/D routers gorgo is measured against). Without `choose_pair`, the router offers
    each decode engine with its best-priced prefill partner (core.pairs) to `choose`."""

    def choose_pair(
        self,
        request: RouteRequest,
        decodes: Sequence[Candidate],
        prefills: Sequence[Candidate],
    ) -> PairPick:
        """Pick one of `decodes` (never empty) and one of `prefills` (may be empty) or
        None."""
        ...
