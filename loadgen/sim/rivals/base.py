"""What a rival router's rule is in the simulator: a `RivalPolicy` (the product's policy shape,
`choose(request, candidates, weights)`, plus what it hears), the `RivalView` the simulator
hands it (what that router can know of a request and of the engines), and the registry.

A rival hears the router's lifecycle (it is a `Listener`: its dispatches, first bytes and
closes, as the rival's own books would), the engines' load at its own poll interval
(`on_poll`, a WAN half-trip after the reading) and, if it asks, the engines' KV events
(`on_kv_events`, likewise). From the candidates it reads only `in_flight` (its own count of
requests sent and not yet answered: SMG's and vllm-router's `load()`), never gorgo's terms,
cached-token estimates or waiting counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ext_proc.vocab.events import Listener
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load as a poll read it (SGLang GET /v1/loads; vLLM /metrics)."""

    # Requests whose prefill has not begun, and those running (SGLang num_queue_reqs,
    # num_running_reqs; vLLM num_requests_waiting, num_requests_running).
    waiting_reqs: int
    running_reqs: int
    # KV in use / KV capacity (SGLang token_usage; vLLM kv_cache_usage_perc).
    kv_usage: float
    # Generated tokens/s since the engine's previous reading (SGLang gen_throughput); 0.0:
    # none measured (idle).
    gen_throughput_tok_s: float = 0.0
    # Prompt tokens still to prefill (SGLang num_waiting_uncached_tokens); read only by
    # the rivals that ask for it (`RivalPolicy.poll_tokens`), else 0.
    waiting_uncached_tokens: int = 0


@dataclass(frozen=True)
class Prompt:
    """What a rival can know of a request's prompt: the trace's blocks (stand-ins for its
    text: an id names its block and the whole prefix before it), their size in tokens,
    the prompt's and the answer's lengths, and its session key."""

    blocks: tuple[int, ...]
    block_tokens: int
    input_tokens: int
    output_tokens: int
    session: str | None

    def block_len(self, i: int) -> int:
        """Tokens of block i (the last one may be partial)."""
        return min(self.block_tokens, self.input_tokens - i * self.block_tokens)


class RivalView(Protocol):
    """What the simulator tells a rival beyond the candidates (loadgen/sim/simulate.py)."""

    def now_s(self) -> float: ...

    def prompt(self, request_id: str) -> Prompt: ...

    def engine_keys(self, request_id: str) -> Sequence[int]:
        """The prompt's blocks as the engines key them (what their KV events name)."""
        ...

    def engine_block_tokens(self) -> int: ...

    def kv_capacity_tokens(self, backend: str) -> int: ...

    def region_of(self, backend: str) -> str:
        """The region a backend's engine is in (what a P/D router's topology knows)."""
        ...

    def decode_throughput_tok_s(self) -> float:
        """An engine's generated tokens/s at its full batch, from the engine profile the
        user configures (what SMG's --least-load-default-throughput is set to)."""
        ...


class RivalPolicy(Listener):
    """A rival router's rule. Subclasses set `name`, what they hear (`poll_interval_s`: the
    engine-load poll, None: none; `poll_tokens`: the poll reads waiting prompt tokens too;
    `kv_events`: the engines' KV events) and implement `choose`."""

    name = ""
    poll_interval_s: float | None = None
    poll_tokens = False
    kv_events = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._view: RivalView | None = None

    @property
    def view(self) -> RivalView:
        if self._view is None:
            raise RuntimeError(f"rival policy {self.name!r} decides only in the simulator (bind)")
        return self._view

    def bind(self, view: RivalView) -> None:
        self._view = view

    def on_poll(self, backend: str, load: EngineLoad) -> None:
        """An engine-load poll's answer arrived."""

    def on_kv_events(self, backend: str, changes: Sequence[tuple[Any, ...]]) -> None:
        """The engine's KV events arrived: ("stored", key, parent), ("removed", key),
        ("cleared",) in order (emulator/engine/model/scheduler.py PrefixCache.events)."""

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        raise NotImplementedError


def argmin_random(scores: dict[str, float], rng: random.Random, tie: float = 0.0) -> str:
    """The lowest score; those within `tie` of it are drawn uniformly."""
    best = min(scores.values())
    return rng.choice([b for b, s in scores.items() if s <= best + tie])


def argmax_random(scores: dict[str, float], rng: random.Random) -> str:
    """The highest score; ties drawn uniformly (llm-d's max-score picker)."""
    best = max(scores.values())
    return rng.choice([b for b, s in scores.items() if s >= best])


RivalFactory = Callable[[random.Random], RivalPolicy]
RIVALS: dict[str, RivalFactory] = {}


def register_rival(name: str) -> Callable[[RivalFactory], RivalFactory]:
    def add(factory: RivalFactory) -> RivalFactory:
        if name in RIVALS:
            raise ValueError(f"rival policy {name!r} registered twice")
        RIVALS[name] = factory
        return factory

    return add
