"""Fleet state as the router sees it: per-backend counters and the in-flight table.

Pure and synchronous; every time comes from the caller (seconds on one monotonic clock).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# How many recent TTFT/E2E samples /state shows per backend.
RECENT_SAMPLES = 16

OK = "ok"
ERROR = "error"
CANCELLED = "cancelled"
EXPIRED = "expired"


@dataclass
class InFlight:
    request_id: str
    backend: str
    dispatched_s: float
    input_tokens: int
    first_byte_s: float | None = None


@dataclass
class BackendState:
    id: str
    in_flight: int = 0
    # Dispatched and not yet past the first response byte (still queued or prefilling).
    waiting_first_byte: int = 0
    completed: int = 0
    errors: int = 0
    # Requests that reached this backend by Envoy's fallback route, not by our decision.
    fallback_completed: int = 0
    recent_ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))
    recent_e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))

    def as_json(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "waiting_first_byte": self.waiting_first_byte,
            "completed": self.completed,
            "errors": self.errors,
            "fallback_completed": self.fallback_completed,
            "last_ttft_ms": [round(v, 3) for v in self.recent_ttft_ms],
            "last_e2e_ms": [round(v, 3) for v in self.recent_e2e_ms],
        }


@dataclass(frozen=True)
class Completion:
    request_id: str
    backend: str
    status: str
    ttft_ms: float | None
    e2e_ms: float


class FleetState:
    """Per-backend counters plus the in-flight table, kept consistent with each other."""

    def __init__(self, backend_ids: Iterable[str]) -> None:
        self.backends: dict[str, BackendState] = {b: BackendState(b) for b in backend_ids}
        # Insertion order = dispatch order, so the oldest records expire first.
        self.in_flight: OrderedDict[str, InFlight] = OrderedDict()

    def dispatch(self, rec: InFlight) -> None:
        old = self.in_flight.pop(rec.request_id, None)
        if old is not None:  # a reused request id: the older record can no longer complete
            self._release(old)
        self.in_flight[rec.request_id] = rec
        b = self.backends[rec.backend]
        b.in_flight += 1
        b.waiting_first_byte += 1

    def first_byte(self, request_id: str, now_s: float) -> float | None:
        """Mark the first response byte; returns TTFT in ms (None if unknown or repeated)."""
        rec = self.in_flight.get(request_id)
        if rec is None or rec.first_byte_s is not None:
            return None
        rec.first_byte_s = now_s
        b = self.backends[rec.backend]
        b.waiting_first_byte -= 1
        ttft_ms = (now_s - rec.dispatched_s) * 1000.0
        b.recent_ttft_ms.append(ttft_ms)
        return ttft_ms

    def complete(
        self, request_id: str, now_s: float, status: str, e2e_ms: float | None = None
    ) -> Completion | None:
        """Close a request's record. Returns None if it was not in flight (already closed)."""
        rec = self.in_flight.pop(request_id, None)
        if rec is None:
            return None
        self._release(rec)
        b = self.backends[rec.backend]
        measured_e2e_ms = e2e_ms if e2e_ms is not None else (now_s - rec.dispatched_s) * 1000.0
        if status == OK:
            b.completed += 1
            b.recent_e2e_ms.append(measured_e2e_ms)
        else:
            b.errors += 1
        ttft_ms = None if rec.first_byte_s is None else (rec.first_byte_s - rec.dispatched_s) * 1e3
        return Completion(request_id, rec.backend, status, ttft_ms, measured_e2e_ms)

    def record_fallback(self, backend: str) -> None:
        if backend in self.backends:
            self.backends[backend].fallback_completed += 1

    def expire(self, now_s: float, timeout_s: float) -> list[Completion]:
        """Close records older than timeout_s (their completion was lost)."""
        expired: list[Completion] = []
        while self.in_flight:
            rec = next(iter(self.in_flight.values()))
            if now_s - rec.dispatched_s < timeout_s:
                break
            done = self.complete(rec.request_id, now_s, EXPIRED)
            if done is not None:
                expired.append(done)
        return expired

    def _release(self, rec: InFlight) -> None:
        b = self.backends[rec.backend]
        b.in_flight -= 1
        if rec.first_byte_s is None:
            b.waiting_first_byte -= 1
