"""One request's lifecycle as events: dispatched, first byte, closed; and a backend's
(added, draining, removed) as `BackendChanged`.

The router emits them; everything that learns from outcomes (the prefix index, the
prefill model, ejection, the tuner) and telemetry subscribes as a `Listener`, in the
spirit of llm-d's request-control hooks (PreRequest, ResponseComplete). Every request the
router dispatched is closed exactly once, whatever ends it, and every listener hears it.
The shell hears a backend's changes the same way and starts or stops its tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.vocab.backend import Backend
from ext_proc.vocab.types import (
    BackendChange,
    BackendLifecycle,
    Decision,
    InFlight,
    RouteRequest,
    Status,
)


@dataclass(frozen=True)
class Dispatched:
    """The router chose a backend for a request: the decision, and the in-flight record the
    listeners learn from at its close (`now_s` on the router's clock)."""

    request: RouteRequest
    decision: Decision
    record: InFlight
    now_s: float


@dataclass(frozen=True)
class FirstByte:
    """The first response byte reached the proxy: for a stream, the first token."""

    request_id: str
    backend: str
    ttft_ms: float
    now_s: float


@dataclass(frozen=True)
class Closed:
    """A dispatched request ended, however it ended (once per request): its status, its TTFT
    and E2E in ms (TTFT None: no first byte seen), and its in-flight record."""

    request_id: str
    backend: str
    status: Status
    ttft_ms: float | None
    e2e_ms: float
    record: InFlight
    now_s: float
    # The backend that answered when it was not the chosen one (status FAILED_OVER).
    served_by: str | None = None
    # Prompt tokens the engine reported it had cached, when it reports them.
    cached_tokens: int | None = None
    # What ended it, as Envoy said it (code, flags, details) or the router's own reason.
    reason: str = ""
    # FAILED_OVER: the backend that served it (`served_by`) answered with success, so its
    # E2E is that backend's.
    served_ok: bool = False


@dataclass(frozen=True)
class BackendChanged:
    """A backend was added, began draining, came back, changed or was removed."""

    backend: str
    change: BackendChange
    # Its lifecycle after the change.
    lifecycle: BackendLifecycle
    # Its config (for REMOVED: the last one it had).
    config: Backend
    now_s: float
    # Who asked: "admin", "reload", "envoy" (activated), "drained" (removed).
    reason: str = ""
    reset: bool = False


class Listener:
    """Subscribe to the lifecycle: override what you need (the rest do nothing)."""

    def on_dispatch(self, e: Dispatched) -> None:
        pass

    def on_first_byte(self, e: FirstByte) -> None:
        pass

    def on_close(self, e: Closed) -> None:
        pass

    def on_backend(self, e: BackendChanged) -> None:
        pass
