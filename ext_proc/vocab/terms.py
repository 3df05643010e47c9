"""What a cost term is: one thing the router estimates for a request on a candidate
backend (its RTT, the queue ahead of it, its prefill, what it does to the requests there),
in one unit, computed by one function, registered by name like a policy. Each candidate
carries every registered term by name (`Candidate.terms`, in registration order); a
weighted policy scores a weighted sum of them; spans, metrics, /state and the operator's
page show each one.

The built-in terms are modules of `ext_proc/core/terms/`; one more is one more module
with a `@register_term(...)` function (docs/architecture.md, "Adding a cost term").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# A term's computation: (what it may read of one backend for one request, the terms of
# that candidate computed before it) -> its value.
Compute = Callable[[Any, Mapping[str, float]], float]


@dataclass(frozen=True)
class TermInfo:
    """A registered cost term (`register_term`): its name and unit, how it is computed, its
    default weight, whether it is part of the predicted TTFT, and how it is shown."""

    name: str
    # Its unit ("ms"): the JSON key of its value is f"{name}_{unit}".
    unit: str
    compute: Compute
    # Its weight in a weighted policy's score, when the policy does not weigh it itself
    # (gorgo weighs the built-in ones by the router's and its own weights): 0 = shown and
    # traced, not scored.
    weight: float = 0.0
    # Part of the newcomer's own predicted TTFT (summed with the others that are).
    ttft: bool = False
    # Shown as (the operator's page, docs).
    label: str = ""
    # A cost a policy may weigh, drawn on the operator's page; False: a prediction only
    # (the request's own decode, for its predicted E2E).
    cost: bool = True

    @property
    def key(self) -> str:
        return f"{self.name}_{self.unit}"


# Every registered term, in registration order (the order their values are summed in).
TERMS: dict[str, TermInfo] = {}


def register_term(
    name: str,
    unit: str = "ms",
    weight: float = 0.0,
    ttft: bool = False,
    label: str = "",
    cost: bool = True,
) -> Callable[[Compute], Compute]:
    def add(compute: Compute) -> Compute:
        if name in TERMS:
            raise ValueError(f"cost term {name!r} registered twice")
        TERMS[name] = TermInfo(name, unit, compute, weight, ttft, label or name, cost)
        return compute

    return add


def unregister_term(name: str) -> None:
    """Forget a term (a test's own)."""
    TERMS.pop(name, None)
