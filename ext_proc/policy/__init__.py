"""The one plugin seam: a registry of named routing policies.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ext_proc.cost import Weights
from ext_proc.parse import LlmRequest


@dataclass(frozen=True)
class Candidate:
    backend_id: str
    in_flight: int
    waiting_first_byte: int
    # Prompt tokens of the requests in flight there, decoding ones included (the paper's
    # load, in tokens).
    in_flight_tokens: int = 0
    rtt_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    # What sending the request there does to the others (ms, summed over them;
    # docs/cost-model.md): its prefill stalls the requests there (ext_proc.cost.
    # decode_stall_ms); and the wait beyond queue_ms when the KV pool is nearly full (kv_ms).
    decode_stall_ms: float = 0.0
    kv_ms: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend_id,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "rtt_ms": round(self.rtt_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "cached_tokens": self.cached_tokens,
            "uncached_tokens": self.uncached_tokens,
            "decode_stall_ms": round(self.decode_stall_ms, 3),
            "kv_ms": round(self.kv_ms, 3),
        }


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    # None when the request is not an LLM call or its body could not be read.
    llm: LlmRequest | None
    # x-session-id, else the OpenAI `user` field.
    session_key: str | None
    # The prompt's prefix-block hashes when the caller already has them (the simulator
    # derives them from a trace's block ids); None: the router hashes the prompt text.
    blocks: Any = None
    # The prompt's blocks as the engine keys them, when the caller knows (the simulator,
    # whose engine models key blocks by trace ids); None: derived from the prompt's tokens.
    engine_keys: Any = None
    # The caller's W3C trace context (traceparent, tracestate), passed through untouched
    # to the telemetry listener so the decision span joins Envoy's trace.
    trace_context: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Choice:
    backend_id: str
    # The policy's score per backend (lower is better), for the decision's explanation.
    scores: dict[str, float]


class Policy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        """Pick one of `candidates` (never empty). `weights`: the router's current cost
        weights for a weighted policy, None for the others."""
        ...


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


def policy_info(name: str) -> PolicyInfo:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None


def make_policy(name: str, rng: random.Random, params: Any = None) -> Policy:
    """The named policy with `params` (None: its defaults)."""
    info = policy_info(name)
    return info.factory(rng, params if params is not None else info.params())


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
