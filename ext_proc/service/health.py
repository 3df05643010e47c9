"""Whether the router can route, and the standard gRPC health service that says so
(grpc.health.v1.Health, from grpcio-health-checking) on any grpc.aio server.

Services: `liveness` is SERVING while the process serves; `""` (the whole server),
`readiness`, the ext_proc service's name and `inference-extension` are SERVING while the
router can route and NOT_SERVING while it cannot (no active backend, every active one
suspect or ejected, shutting down): the endpoint-picker protocol's health services, and
what the extension's chart has its Envoy health-check. The admin port's `/readyz` reads
the same predicate.

How the status follows the router: a check every HEALTH_INTERVAL_S on the event loop (an
ejection or a failing probe ends by time, which no event announces), and at once when a
backend is added, drained or removed (a router listener) and when shutdown begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ext_proc.common.names import (
    EXT_PROC_SERVICE,
    HEALTH_INFERENCE_EXTENSION,
    HEALTH_LIVENESS,
    HEALTH_READINESS,
)
from ext_proc.core.router import Router
from ext_proc.vocab.events import BackendChanged, Listener
from ext_proc.vocab.types import BackendLifecycle

log = logging.getLogger("gorgo.health")

# How often readiness is checked on the loop: a backend ejected or back from an ejection
# shows within this (a Kubernetes probe's period is 5-10 s; the check is a pass over the
# backends' records, microseconds).
HEALTH_INTERVAL_S = 0.5
# The services whose status is readiness's ("" is the whole server's).
READINESS_SERVICES = ("", HEALTH_READINESS, EXT_PROC_SERVICE, HEALTH_INFERENCE_EXTENSION)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Readiness:
    """Whether requests can be routed now, and why (or why not) in a few words."""

    ready: bool
    reason: str


def router_readiness(router: Router, draining: bool = False) -> Readiness:
    """Whether `router` can route a request now: not shutting down (`draining`), and some
    active backend neither suspect (its probes fail) nor ejected (its requests failed)."""
    if draining:
        return Readiness(False, "shutting down: new requests are not routed")
    backends = list(router.backends.values())
    active = [b for b in backends if b.lifecycle is BackendLifecycle.ACTIVE]
    if not active:
        pending = sum(b.lifecycle is BackendLifecycle.PENDING for b in backends)
        waiting = f" ({pending} waiting for Envoy to have their clusters)" if pending else ""
        return Readiness(False, f"no active backend{waiting}")
    now_s = router.clock()
    state = router.fleet.state
    available = sum(state.available(b, now_s) for b in active)
    if not available:
        return Readiness(
            False, f"every active backend ({len(active)}) is suspect (probes fail) or ejected"
        )
    return Readiness(True, f"{available} of {len(active)} active backends available")


class HealthService(Listener):
    """The gRPC health service of one router, served on as many grpc.aio servers as it
    is attached to (they share one status), kept in step with `ready` (see the module's
    docstring). Subscribe it to the router to hear backend changes at once."""

    def __init__(self, ready: Callable[[], Readiness]) -> None:
        self.ready = ready
        self.servicer = health.aio.HealthServicer()
        self.current: Readiness | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def attach(self, server: grpc.aio.Server) -> None:
        """Serve grpc.health.v1.Health on `server` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        """Set every service's status now, then follow the router."""
        await self.servicer.set(HEALTH_LIVENESS, SERVING)
        await self.refresh()
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        """Every service NOT_SERVING (watchers are told), and no more checks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.servicer.enter_graceful_shutdown()

    async def refresh(self) -> Readiness:
        """Check readiness now; the services' status changes only when it does."""
        now = self.ready()
        if self.current is None or now.ready != self.current.ready:
            status = SERVING if now.ready else NOT_SERVING
            for service in READINESS_SERVICES:
                await self.servicer.set(service, status)
            if self.current is not None:
                log.warning("readiness: %s (%s)", "ready" if now.ready else "NOT READY", now.reason)
        self.current = now
        return now

    def poke(self) -> None:
        """Check at once (a change the loop would see only at its next tick)."""
        self._wake.set()

    def on_backend(self, e: BackendChanged) -> None:
        self.poke()

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), HEALTH_INTERVAL_S)
            self._wake.clear()
            await self.refresh()


def add_health_service(server: grpc.aio.Server, ready: Callable[[], Readiness]) -> HealthService:
    """The gRPC health service on `server`, following `ready` (e.g. `lambda:
    router_readiness(router)`); call `start()` once the loop runs and `stop()` at the end.
    Attach the same service to another server with `attach`."""
    service = HealthService(ready)
    service.attach(server)
    return service
