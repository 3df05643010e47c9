"""The routing core: decide, observe the first byte, observe completion.

Pure and synchronous with an injected clock, so the live service and (later) the offline
simulator drive the very same object.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ext_proc.policy import Candidate, Policy, RouteRequest
from ext_proc.state import Completion, FleetState, InFlight

# How many recent decisions /state shows.
RECENT_DECISIONS = 8


@dataclass(frozen=True)
class Decision:
    request_id: str
    backend: str
    policy: str
    input_tokens: int
    candidates: tuple[Candidate, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "policy": self.policy,
            "input_tokens": self.input_tokens,
            "candidates": [
                {"backend": c.backend_id, "in_flight": c.in_flight} for c in self.candidates
            ],
        }


class Router:
    def __init__(
        self,
        backend_ids: Sequence[str],
        policy: Policy,
        clock: Callable[[], float],
        request_timeout_s: float,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.state = FleetState(backend_ids)
        self.decisions = 0
        self.recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)

    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(
            Candidate(b.id, b.in_flight, b.waiting_first_byte) for b in self.state.backends.values()
        )

    def decide(self, request: RouteRequest) -> Decision:
        """Choose a backend and record the dispatch."""
        candidates = self.candidates()
        backend = self.policy.choose(request, candidates)
        if backend not in self.state.backends:
            raise ValueError(f"policy {self.policy.name!r} chose unknown backend {backend!r}")
        tokens = request.llm.input_tokens if request.llm else 0
        self.state.dispatch(InFlight(request.request_id, backend, self.clock(), tokens))
        decision = Decision(request.request_id, backend, self.policy.name, tokens, candidates)
        self.decisions += 1
        self.recent.append(decision)
        return decision

    def first_byte(self, request_id: str) -> float | None:
        """First response body byte seen: returns TTFT in ms as the proxy saw it."""
        return self.state.first_byte(request_id, self.clock())

    def complete(
        self, request_id: str, status: str, e2e_ms: float | None = None
    ) -> Completion | None:
        """Close the loop for one request; idempotent (a second call returns None)."""
        return self.state.complete(request_id, self.clock(), status, e2e_ms)

    def record_fallback(self, backend: str) -> None:
        self.state.record_fallback(backend)

    def expire(self) -> list[Completion]:
        return self.state.expire(self.clock(), self.request_timeout_s)

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "decisions": self.decisions,
            "in_flight": len(self.state.in_flight),
            "backends": {b.id: b.as_json() for b in self.state.backends.values()},
            "recent_decisions": [d.as_json() for d in self.recent],
        }
