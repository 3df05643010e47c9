"""One request's lifecycle as events: dispatched, first byte, closed; and a backend's
(added, draining, removed) as `BackendChanged`.

The router emits them; everything that learns from outcomes (the prefix index, the
prefill model, ejection, the tuner) and telemetry subscribes as a `Listener`, in the
spirit of llm-d's request-control hooks (PreRequest, ResponseComplete). Every request the
router dispatched is closed exactly once, whatever ends it, and every listener hears it.
The shell hears a backend's changes the same way and starts or stops its tasks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ext_proc.config import Backend
    from ext_proc.policy import RouteRequest
    from ext_proc.router import Decision
    from ext_proc.state import InFlight


class Status(enum.StrEnum):
    """How a request was closed."""

    OK = "ok"
    # The backend failed it (5xx, reset, an error inside the stream).
    ERROR = "error"
    # The backend answered 4xx: the request's fault, not the backend's.
    CLIENT_ERROR = "client_error"
    # The client went away: says nothing about the backend.
    CANCELLED = "cancelled"
    # No completion arrived within request_timeout_s (a lost access-log entry).
    EXPIRED = "expired"
    # Envoy could not connect to the chosen backend and another one served it.
    FAILED_OVER = "failed_over"


class PrefixState(enum.StrEnum):
    """Where a backend's cached-token prediction comes from."""

    # The engine's own KV events (the stream is up and caught up).
    PRECISE = "precise"
    # The router's own prefix index (no events, or their stream is down).
    APPROXIMATE = "approximate"


class BackendLifecycle(enum.StrEnum):
    """Where a backend is in its life: (pending ->) active -> draining -> removed."""

    # Added, not yet a candidate: the shell waits until Envoy can route to it (with
    # envoy.xds_dir), so no decision names a cluster Envoy does not have yet.
    PENDING = "pending"
    # A candidate of every decision (while healthy).
    ACTIVE = "active"
    # No new decisions; its requests in flight finish, then it is removed.
    DRAINING = "draining"
    # Gone from the router's state (its requests in flight had all closed).
    REMOVED = "removed"


class BackendChange(enum.StrEnum):
    """What happened to a backend (`BackendChanged`)."""

    ADDED = "added"
    # Pending, now active (Envoy has its cluster).
    ACTIVATED = "activated"
    DRAINING = "draining"
    # Draining, and back in rotation before it was removed (a reload named it again).
    REACTIVATED = "reactivated"
    # Its fields changed in place (a reload); `reset`: what the router knew of the engine
    # behind it was forgotten (address, engine or kv_events changed).
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True)
class Dispatched:
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
