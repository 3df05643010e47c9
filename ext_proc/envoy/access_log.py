"""Envoy's gRPC access log: each completion (E2E, status, the backend that answered) closes
its request in the router.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from ext_proc.common.names import (
    ROUTE_FALLBACK,
)
from ext_proc.core.router import Router
from ext_proc.core.types import Status
from ext_proc.envoy import codec
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.service.telemetry import Telemetry

# How long a streamed request's completion waits for its first-chunk message when the
# access-log entry arrives first (they travel over two gRPC streams).
COMPLETION_GRACE_S = 0.25


# Hands what this router saw of another router's request to the router that decided it
# (ext_proc.feeds.fleet_bus.FleetBus.forward; None: a single router).
Forward = Callable[[PeerEvent], None]


def completed_event(e: codec.AccessLogEntry) -> PeerEvent:
    return PeerEvent(
        PeerKind.COMPLETED,
        "",
        e.request_id,
        e.backend,
        response_code=e.response_code,
        e2e_ms=e.e2e_ms,
        attempts=e.attempts,
        route_name=e.route_name,
    )


def first_chunk_event(request_id: str, error: bool) -> PeerEvent:
    return PeerEvent(PeerKind.FIRST_CHUNK, "", request_id, "", error=error)


def entry_of(e: PeerEvent) -> codec.AccessLogEntry:
    return codec.AccessLogEntry(
        e.request_id, e.backend, e.route_name, e.response_code, e.e2e_ms, e.attempts
    )


class AccessLogService:
    """Receives Envoy's access-log entries: the completion of every request. With several
    routers behind one Envoy, an entry for another router's request is forwarded to it."""

    def __init__(self, router: Router, telemetry: Telemetry, forward: Forward | None = None):
        self.router = router
        self.telemetry = telemetry
        self.forward = forward

    async def stream_access_logs(
        self, requests: AsyncIterator[codec.StreamAccessLogsMessage], context: Any
    ) -> codec.StreamAccessLogsResponse:
        async for msg in requests:
            for e in codec.access_log_entries(msg):
                self.observe(e)
        return codec.StreamAccessLogsResponse()

    def apply_forwarded(self, e: PeerEvent) -> None:
        """What another router behind the same Envoy saw of one of our requests: its first
        response chunk (timed now, a NATS hop later) or its access-log entry."""
        if e.kind == PeerKind.FIRST_CHUNK:
            if e.error:
                self.router.close(e.request_id, Status.ERROR)
            else:
                self.router.first_byte(e.request_id)
        elif e.kind == PeerKind.COMPLETED:
            self.observe(entry_of(e), forwarded=True)

    def observe(self, e: codec.AccessLogEntry, forwarded: bool = False) -> None:
        """`forwarded`: the entry came from another router (never sent on again)."""
        answered = 200 <= e.response_code < 300  # a body went out: its first chunk may lag
        if answered and self.router.response_ended(e.request_id, e.e2e_ms):
            # The entry travels over another gRPC stream than the observer's first-chunk
            # message and can overtake it (a response over within milliseconds): close a
            # moment later so the TTFT is not lost; the first byte came before the end.
            with contextlib.suppress(RuntimeError):  # no loop (a test calling directly)
                loop = asyncio.get_running_loop()
                loop.call_later(COMPLETION_GRACE_S, self._close, e, forwarded)
                return
        self._close(e, forwarded)

    def _close(self, e: codec.AccessLogEntry, forwarded: bool = False) -> None:
        # Another backend than the one decided can answer because Envoy retried a connect
        # failure (a failover), or because the router answered too late and Envoy failed
        # open (not the backend's fault): only the first takes several attempts.
        served_by = e.backend if e.attempts > 1 else None
        closed = self.router.close(
            e.request_id, status_for(e.response_code), e.e2e_ms, served_by=served_by
        )
        if closed is not None or forwarded:
            return
        if e.route_name == ROUTE_FALLBACK:
            self.router.record_fallback(e.backend)
            self.telemetry.fallback(e.backend)
        elif self.forward is not None:  # routed, by another router: its to learn from
            self.forward(completed_event(e))


def status_for(code: int) -> Status:
    if 200 <= code < 300:
        return Status.OK
    if 400 <= code < 500:
        return Status.CLIENT_ERROR
    # 0: nothing was sent to the client, which went away first (an upstream failure gets
    # Envoy's own 5xx). A cancellation says nothing about the backend.
    return Status.CANCELLED if code == 0 else Status.ERROR
