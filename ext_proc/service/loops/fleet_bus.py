"""The shell of ext_proc.feeds.peers: this router's lifecycle events go out on NATS, and the
other routers' come in, on `<bus.subject>.<router id>` (core NATS publish/subscribe; no
echo of our own). `bus.nats_url` may list several servers of one NATS cluster (one per
region): they are tried in the order given, the region's own first, and a server that
stops answering pings is left for the next within a few seconds. Fail open: while no
server is reachable the router decides from its own view and the engines' reports
(/state `fleet.connected` false, `gorgo_bus_connected` 0), and reconnects by itself
(nats-py's reconnect loop, and a retry loop for the first connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.feeds.peers import (
    Head,
    PeerEvent,
    PeerKind,
    PeerPublisher,
    sync_event,
    waiting_event,
)
from ext_proc.vocab.backend import Backend

log = logging.getLogger("gorgo.fleet")

# Events waiting to be published; beyond this (NATS gone for long) new ones are dropped:
# stale dispatches would only mislead the peers.
QUEUE_EVENTS = 10_000
RETRY_S = 1.0
# A server that stops answering (frozen, partitioned) is noticed after this many pings a
# second unanswered (nats-py's default pings every 2 minutes), and the next one is tried.
PING_S = 1
MAX_PINGS_OUT = 3
# What a router sent in this many seconds it sends again, in order, when it rejoins the
# bus or a peer that rejoined asks (`sync`): core NATS drops what a server swallowed before
# its loss was noticed (3 pings) and what an absent subscriber missed. Replayed in order,
# the events are idempotent (a dispatch then its close nets to nothing).
REPLAY_S = 15.0
# The lifecycle events worth replaying (the claims are sent afresh anyway).
REPLAYED = (
    PeerKind.DISPATCHED,
    PeerKind.FIRST_BYTE,
    PeerKind.CLOSED,
    PeerKind.FIRST_CHUNK,
    PeerKind.COMPLETED,
)
# How long a flush may wait for the server's answer (whole seconds: nats-py's unit); the
# flow-control releases it confirms time out sooner by themselves (flow.shared).
FLUSH_TIMEOUT_S = 1


def default_router_id() -> str:
    host = socket.gethostname().split(".")[0] or "router"
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in f"{host}-{os.getpid()}")


class FleetBus:
    """The other routers' lifecycle events over NATS, and ours to them (a `Feed` of the
    whole fleet: nothing per backend)."""

    name = "fleet_bus"

    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self.router_id = cfg.bus.router_id or default_router_id()
        self.subject = cfg.bus.subject
        self._queue: asyncio.Queue[PeerEvent] = asyncio.Queue(QUEUE_EVENTS)
        self._nc: Client | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.sent = self.received = self.dropped = self.bad = 0
        self.disconnects = self.forgotten = 0
        # Which router each peer request we count came from: a SYNC from it forgets those
        # it no longer has (their close was missed).
        self._peer_of: dict[str, str] = {}
        # What we sent lately (monotonic time, event), for a replay (REPLAY_S).
        self._recent: deque[tuple[float, PeerEvent]] = deque()
        self.replayed = 0
        self.forwarded = self.forwarded_here = 0
        # Applies another router's FIRST_CHUNK or COMPLETED for one of ours (the shell's
        # ExtProcService.apply_forwarded).
        self.on_forwarded: Callable[[PeerEvent], None] | None = None
        # Told which of our dispatches the NATS server has (published, then a flush's
        # round trip): every peer's connection has them too (flow control's bound on the
        # room several routers release together, ext_proc.flow.shared).
        self.on_confirmed: Callable[[list[str]], None] | None = None
        # Told of every peer event applied, and of the peers' flow-control claims (the
        # gateway queue's Holding.hear: room may have come, or a peer's band waits).
        self.on_peer: Callable[[PeerEvent], None] | None = None

    def add(self, backend: Backend) -> None:
        """Nothing per backend: every router's events name their backend."""

    def cancel(self, backend: str) -> list[asyncio.Task[None]]:
        return []

    @property
    def backends(self) -> list[str]:
        return []

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> None:
        if not self.cfg.bus.nats_url:
            return
        self.router.subscribe(PeerPublisher(self.router_id, self._send))
        self._tasks.append(asyncio.create_task(self._run()))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self._nc is not None:
            with contextlib.suppress(Exception):  # already closed, or NATS gone
                await self._nc.close()

    @property
    def forward(self) -> Callable[[PeerEvent], None] | None:
        """How the shell hands another router's request to it (None: a single router)."""
        return self._forward if self.cfg.bus.nats_url else None

    def _forward(self, e: PeerEvent) -> None:
        self.forwarded += 1
        self._send(replace(e, router=self.router_id))

    def snapshot(self) -> dict[str, Any] | None:
        if not self.cfg.bus.nats_url:
            return None
        return {
            "router_id": self.router_id,
            "connected": self.connected,
            "server": self.server,
            "disconnects": self.disconnects,
            # Peer requests forgotten because their router's SYNC no longer listed them,
            # and our events sent again (on our rejoin, or a rejoining peer's ask).
            "forgotten": self.forgotten,
            "replayed": self.replayed,
            "peer_requests_in_flight": len(self.router.peer_in_flight),
            "sent": self.sent,
            "received": self.received,
            "dropped": self.dropped,
            "malformed": self.bad,
            # What this router saw of others' requests (several routers behind one
            # Envoy), and what others saw of its own.
            "forwarded": self.forwarded,
            "forwarded_here": self.forwarded_here,
        }

    def tell_claims(self, claims: dict[str, Head], heads: list[Head]) -> None:
        """What our gateway queue waits for: per backend, the highest band waiting; the
        heads of the queue that found no room."""
        if self.cfg.bus.nats_url:
            self._send(waiting_event(self.router_id, claims, heads))

    def _send(self, e: PeerEvent, replay: bool = False) -> None:
        if e.kind == PeerKind.DISPATCHED and not self.connected and not replay:
            # No peer can hear it now: nothing to wait for (fail open). Told after the
            # release that sent it is recorded.
            self._confirm_soon([e.request_id])
        if e.kind in REPLAYED and not replay:
            now = time.monotonic()
            self._recent.append((now, e))
            while self._recent and self._recent[0][0] < now - REPLAY_S:
                self._recent.popleft()
        try:
            self._queue.put_nowait(e)
        except asyncio.QueueFull:
            self.dropped += 1

    def _confirm_soon(self, request_ids: list[str]) -> None:
        if self.on_confirmed is not None:
            asyncio.get_running_loop().call_soon(self.on_confirmed, request_ids)

    async def _run(self) -> None:
        servers = self.cfg.bus.nats_url.split(",")
        while self._nc is None:
            try:
                self._nc = await nats.connect(
                    servers=servers,
                    # In the order given: the nearest (the region's own) first.
                    dont_randomize=True,
                    ping_interval=PING_S,
                    max_outstanding_pings=MAX_PINGS_OUT,
                    name=f"gorgo-{self.router_id}",
                    no_echo=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=RETRY_S,
                    connect_timeout=2,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            except Exception as e:  # nats-py raises its own and OSError: retry them all
                log.warning("fleet bus: cannot reach %s (%s); retrying", servers, e)
                await asyncio.sleep(RETRY_S)
        log.info("fleet bus: %s on %s as %s", servers, self.subject, self.router_id)
        await self._nc.subscribe(f"{self.subject}.*", cb=self._on_message)
        self._sync(ask=True)  # an earlier run of ours may still be counted: say what is
        own = f"{self.subject}.{self.router_id}"
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for event in batch:
                await self._nc.publish(own, event.encode())
                self.sent += 1
            dispatched = [e.request_id for e in batch if e.kind == PeerKind.DISPATCHED]
            if dispatched and self.on_confirmed is not None:
                try:  # the server has them once it answers the PING behind them
                    await self._nc.flush(timeout=FLUSH_TIMEOUT_S)
                except Exception as e:  # timed out or disconnected: confirm anyway
                    log.warning("fleet bus: flush: %s", e)
                self.on_confirmed(dispatched)

    async def _on_message(self, msg: Msg) -> None:
        try:
            e = PeerEvent.decode(msg.data)
        except ValueError as err:
            self.bad += 1
            log.warning("fleet bus: dropped a message on %s: %s", msg.subject, err)
            return
        if e.router == self.router_id:
            return
        self.received += 1
        if e.kind in (PeerKind.FIRST_CHUNK, PeerKind.COMPLETED):
            if self.on_forwarded is not None and e.request_id in self.router.in_flight:
                self.forwarded_here += 1
                self.on_forwarded(e)  # ours: the others ignore it
            return
        if e.kind == PeerKind.SYNC:
            self._synced(e)
            return
        if e.kind == PeerKind.DISPATCHED:
            self._peer_of[e.request_id] = e.router
        elif e.kind == PeerKind.CLOSED:
            self._peer_of.pop(e.request_id, None)
        if e.kind != PeerKind.WAITING:
            self.router.inputs.apply_peer(e)
        if self.on_peer is not None:
            self.on_peer(e)

    def _sync(self, ask: bool) -> None:
        """Our last REPLAY_S of events again, in order, then every request we have in
        flight (`ask`: the others answer with theirs)."""
        horizon = time.monotonic() - REPLAY_S
        for at, e in list(self._recent):
            if at >= horizon:
                self.replayed += 1
                self._send(e, replay=True)
        self._send(sync_event(self.router_id, list(self.router.in_flight), ask))

    def _synced(self, e: PeerEvent) -> None:
        """A peer's whole list of requests in flight: forget its others (and any request
        no longer counted at all: expired); answer with ours if it asks."""
        counted = self.router.peer_in_flight
        has = set(e.request_ids)
        for rid, router in list(self._peer_of.items()):
            if rid not in counted:
                del self._peer_of[rid]
            elif router == e.router and rid not in has:
                self.forgotten += 1
                self.router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, router, rid, ""))
                del self._peer_of[rid]
        if e.ask:
            self._sync(ask=False)

    async def _on_error(self, e: Exception) -> None:
        log.warning("fleet bus: %s", e)

    async def _on_disconnected(self) -> None:
        self.disconnects += 1
        log.warning("fleet bus: disconnected; deciding from this router's own view")

    async def _on_reconnected(self) -> None:
        log.info("fleet bus: reconnected to %s", self.server)
        self._sync(ask=True)  # what we missed meanwhile: the others say what they have

    @property
    def server(self) -> str | None:
        """The NATS server this router is connected to (host:port), if any."""
        url = self._nc.connected_url if self._nc is not None and self.connected else None
        return url.netloc if url is not None else None
