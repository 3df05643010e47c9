"""The one plugin seam: a registry of named routing policies.

The framework builds one `Candidate` per healthy backend with every feature a policy may
want (load, RTT, queue and prefill estimates, cached tokens); a policy only chooses among
them. Register a policy class with `@register("name")`; it is then selectable as
`policy: name` in the config and `--policy name` in the simulator.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ext_proc.parse import LlmRequest

if TYPE_CHECKING:
    from ext_proc.config import Config


@dataclass(frozen=True)
class Candidate:
    backend_id: str
    in_flight: int
    waiting_first_byte: int
    # Prompt tokens of the requests in flight there (the paper's load, in tokens).
    queued_tokens: int = 0
    rtt_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    cached_tokens: int = 0
    uncached_tokens: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend_id,
            "in_flight": self.in_flight,
            "queued_tokens": self.queued_tokens,
            "rtt_ms": round(self.rtt_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "cached_tokens": self.cached_tokens,
            "uncached_tokens": self.uncached_tokens,
        }


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    # None when the request is not an LLM call or its body could not be read.
    llm: LlmRequest | None
    session_key: str | None
    # What session_affinity hashes: the session key, else a digest of the prompt's head.
    affinity_key: str = ""
    # The prompt's prefix-block hashes when the caller already has them (the simulator
    # derives them from a trace's block ids); None: the router hashes the prompt text.
    blocks: Any = None


@dataclass(frozen=True)
class Choice:
    backend_id: str
    # The policy's score per backend (lower is better), for the decision's explanation.
    scores: dict[str, float]


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        """Pick one of `candidates` (never empty)."""
        ...


PolicyFactory = Callable[[random.Random, "Config"], Policy]
POLICIES: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def add(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = factory
        return factory

    return add


def make_policy(name: str, rng: random.Random, cfg: Config) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None
    return factory(rng, cfg)


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


# Built-in policies register themselves on import.
from ext_proc.policy import baselines, gorgo  # noqa: E402,F401
