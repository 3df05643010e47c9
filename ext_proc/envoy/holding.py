"""The gateway queue's async shell: a request that must wait (flow control) is held here,
its body's reply unsent, until the Director releases or refuses it. The queue is offered
room again when a first byte or a completion arrives, and every TICK_S while any request
waits (the estimates of work not yet started fall as time passes), and at the next wait
that runs out."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

from ext_proc.core.pipeline import Director, Outcome
from ext_proc.feeds.peers import Head, PeerEvent, PeerKind
from ext_proc.flow.queue import Waiting
from ext_proc.vocab.events import Closed, FirstByte, Listener

TICK_S = 0.05
# Outcomes kept for sessions not yet waiting; past this many, the oldest are dropped (their
# streams ended before they waited: a bound, not a queue).
MAX_EARLY = 1024


class Holding(Listener):
    """Holds the waiting requests' futures and pumps the Director's queue."""

    def __init__(self, director: Director) -> None:
        self.director = director
        self._waiters: dict[int, asyncio.Future[Outcome]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Outcomes decided before their session waited for them, by id(waiting).
        self._early: dict[int, tuple[Waiting, Outcome]] = {}
        # Several routers: tells the peers what our queue waits for (the fleet bus's
        # FleetBus.tell_claims; None: alone).
        self.tell: Callable[[dict[str, Head], list[Head]], None] | None = None

    def on_first_byte(self, e: FirstByte) -> None:
        self._wake.set()

    def on_close(self, e: Closed) -> None:
        self._wake.set()

    def hear(self, e: PeerEvent) -> None:
        """A peer's event: its claims (what its queue waits for), or a first byte or close
        of its own that may have made room here too: the queue is offered it now."""
        if e.kind == PeerKind.WAITING:
            self.director.hear_claims(e.router, dict(e.claims), list(e.heads))
        self._wake.set()

    def _tell(self) -> None:
        if self.tell is not None and (claims := self.director.claims_to_send()) is not None:
            self.tell(*claims)

    def confirm(self, request_ids: list[str]) -> None:
        """The fleet bus carried these dispatches: room this router left for its peers
        to hear of them is its own again."""
        if self.director.confirm(request_ids):
            self._wake.set()

    @property
    def held(self) -> int:
        return len(self._waiters)

    async def wait(self, w: Waiting) -> Outcome:
        """Until the request is released or refused; its client going away (the stream
        cancelled) takes it out of the queue."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        early = self._early.pop(id(w), None)
        if early is not None:
            return early[1]
        self._waiters[id(w)] = future
        self.deliver()  # a pump before this wait may already have decided it
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="gorgo-flow-pump")
        try:
            return await future
        finally:
            self._waiters.pop(id(w), None)
            if not future.done():
                self.director.cancel(w)

    def deliver(self) -> None:
        released, self.director.released = self.director.released, []
        for w, outcome in released:
            future = self._waiters.get(id(w))
            if future is None:
                # decided before its session waits for it (the session was still sending
                # Envoy the held reply's timer): kept for its wait, not dropped (it would
                # hang until Envoy's timeout, dispatched but never sent on)
                self._early[id(w)] = (w, outcome)
                while len(self._early) > MAX_EARLY:  # streams gone before they waited
                    del self._early[next(iter(self._early))]
            elif not future.done():
                future.set_result(outcome)

    async def _run(self) -> None:
        try:
            await self._pump_while_waiting()
        finally:
            self._tell()  # nothing waits: the peers stop holding room back for us

    async def _pump_while_waiting(self) -> None:
        while self._waiters:
            self._wake.clear()
            self.director.pump()
            self.deliver()
            self._tell()
            wait_s = min(
                TICK_S, max(0.0, self.director.next_expiry_s() - self.director.router.clock())
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), timeout=wait_s if math.isfinite(wait_s) else TICK_S
                )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
