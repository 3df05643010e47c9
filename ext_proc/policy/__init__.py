"""The one plugin seam: a registry of named routing policies.

The framework builds one `Candidate` per backend with its features; a policy only chooses
among them. Register a policy class with `@register("name")`; it is then selectable as
`policy: name` in the config.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ext_proc.parse import LlmRequest


@dataclass(frozen=True)
class Candidate:
    backend_id: str
    in_flight: int
    waiting_first_byte: int


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    # None when the request is not an LLM call or its body could not be read.
    llm: LlmRequest | None
    session_key: str | None


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> str:
        """Return the backend_id of one of `candidates` (never empty)."""
        ...


PolicyFactory = Callable[[random.Random], Policy]
POLICIES: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def add(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = factory
        return factory

    return add


def make_policy(name: str, rng: random.Random) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None
    return factory(rng)


# Built-in policies register themselves on import.
from ext_proc.policy import basic  # noqa: E402,F401
