"""Envoy's gRPC access log: each completion (E2E, status, the backend that answered) closes
its request in the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ext_proc.common.names import ACCESS_LOG_STARTS, ROUTE_FALLBACK
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.outcome import outcome_of
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.vocab.types import Status

log = logging.getLogger("gorgo.access_log")

# How long a streamed request's completion waits for its first-chunk message when the
# access-log entry arrives first (they travel over two gRPC streams).
COMPLETION_GRACE_S = 0.25


# Hands what this router saw of another router's request to the router that decided it
# (ext_proc.service.loops.fleet_bus.FleetBus.forward; None: a single router).
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
        flags=tuple(sorted(e.flags)),
        details=e.details,
    )


def first_chunk_event(request_id: str, error: bool) -> PeerEvent:
    return PeerEvent(PeerKind.FIRST_CHUNK, "", request_id, "", error=error)


def entry_of(e: PeerEvent) -> codec.AccessLogEntry:
    return codec.AccessLogEntry(
        e.request_id,
        e.backend,
        e.route_name,
        e.response_code,
        e.e2e_ms,
        e.attempts,
        frozenset(e.flags),
        e.details,
    )


class AccessLogService:
    """Receives Envoy's access-log entries: the completion of every request. With several
    routers behind one Envoy, an entry for another router's request is forwarded to it.

    Each Envoy keeps its access-log streams open for as long as it runs (one per worker
    and log, named by its node id), from its first request on (the log of requests'
    starts, filters.access_logs). When the last stream of an Envoy ends, that Envoy is gone
    (killed, restarted): the requests it carried will never be reported, and are closed
    as lost at once instead of loading their backends' queues until they expire."""

    def __init__(
        self,
        router: Router,
        on_fallback: Callable[[str], None] | None = None,
        forward: Forward | None = None,
    ):
        """`on_fallback`: told of each request a backend served by Envoy's fallback route
        (telemetry counts them)."""
        self.router = router
        self.on_fallback = on_fallback
        self.forward = forward
        # The open streams' Envoy node ids (one entry per stream).
        self.streams: list[str] = []

    async def stream_access_logs(
        self, requests: AsyncIterator[codec.StreamAccessLogsMessage], context: Any
    ) -> codec.StreamAccessLogsResponse:
        node: str | None = None
        starts = False
        try:
            async for msg in requests:
                if node is None:  # the first message names the Envoy and the log
                    node = codec.access_log_node(msg)
                    starts = codec.access_log_name(msg) == ACCESS_LOG_STARTS
                    self.streams.append(node)
                if starts:  # requests' starts: the stream itself is what counts
                    continue
                for e in codec.access_log_entries(msg):
                    self.observe(e)
        finally:
            if node is not None:
                self.streams.remove(node)
                self._stream_ended(node)
        return codec.StreamAccessLogsResponse()

    def _stream_ended(self, node: str) -> None:
        """An Envoy whose last stream ended is gone: its requests are lost (and, once no
        Envoy is left, those of an Envoy that never said its name)."""
        if node in self.streams:
            return
        nodes = {node} if self.streams else {node, ""}
        for c in self.router.lose(nodes):
            log.warning("request %s on %s: its Envoy went away, lost", c.request_id, c.backend)

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
        outcome = outcome_of(e.response_code, e.flags, e.details)
        if outcome.status == Status.OK:
            self.router.inputs.response_size(e.request_id, e.response_body_bytes)
        closed = self.router.close(
            e.request_id, outcome.status, e.e2e_ms, served_by=served_by, reason=outcome.reason
        )
        if closed is not None or forwarded:
            return
        if e.route_name == ROUTE_FALLBACK:
            self.router.inputs.record_fallback(e.backend)
            if self.on_fallback is not None:
                self.on_fallback(e.backend)
        elif self.forward is not None:  # routed, by another router: its to learn from
            self.forward(completed_event(e))
