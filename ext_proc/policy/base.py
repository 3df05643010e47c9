"""The one plugin seam: what a routing policy is, and the registry it joins.

The framework builds one `Candidate` per healthy backend with every feature a policy may
want (load, RTT, queue and prefill estimates, cached tokens, what the request would do to
the others there) and owns the cost weights; a policy only chooses. Register a policy
class with `@register("name", params=Params)`; it is then selectable as `policy: name` in
the config and `--policy name` in the simulator, and its parameters are decoded strictly
from `policies.<name>:` into `Params` (a frozen dataclass; errors name the key). A policy
whose parameters derive from `WeightedParams` weighs cost terms: the router starts from
its `weights`, may tune them, and hands the current ones to every `choose` call.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ext_proc.vocab.policy import Policy
from ext_proc.vocab.types import Weights


@dataclass(frozen=True)
class NoParams:
    """A policy without parameters."""


@dataclass(frozen=True)
class WeightedParams:
    """Parameters of a policy that weighs cost terms. `weights` is only the starting
    point: from then on the router owns the weights (and its tuner moves them)."""

    weights: Weights
    # The tuner's search bounds ((rtt lo, hi), (queue lo, hi)); None: the tuner's default
    # bounds for the time form.
    TUNER_BOUNDS: ClassVar[tuple[tuple[float, float], tuple[float, float]] | None] = None


PolicyFactory = Callable[[random.Random, Any], Policy]


@dataclass(frozen=True)
class PolicyInfo:
    """A registered policy: its name, how it is built (`factory`), and its parameter class
    (decoded strictly from `policies.<name>`). `weighted`: its parameters derive from
    WeightedParams, so the router owns its weights and may tune them."""

    name: str
    # Called with (rng, params).
    factory: PolicyFactory
    params: type[Any]

    @property
    def weighted(self) -> bool:
        return issubclass(self.params, WeightedParams)


POLICIES: dict[str, PolicyInfo] = {}


def register(name: str, params: type[Any] = NoParams) -> Callable[[PolicyFactory], PolicyFactory]:
    def add(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = PolicyInfo(name, factory, params)
        return factory

    return add


def near_ties(scores: dict[str, float], tie_abs: float = 0.0, tie_frac: float = 0.0) -> list[str]:
    """The backends whose score is within tie_abs or tie_frac of the lowest."""
    best = min(scores.values())
    slack = max(tie_abs, tie_frac * abs(best))
    return [b for b, s in scores.items() if s <= best + slack]


def pick_min(
    scores: dict[str, float], rng: random.Random, tie_abs: float = 0.0, tie_frac: float = 0.0
) -> str:
    """The lowest score; near-ties are drawn at random, so equal backends share load
    instead of herding onto the first."""
    return rng.choice(near_ties(scores, tie_abs, tie_frac))
