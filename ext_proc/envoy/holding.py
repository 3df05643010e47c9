"""The gateway queue's async shell: a request that must wait (flow control) is held here,
its body's reply unsent, until the admission's pump settles it (released or refused).
The queue is offered room again when a first byte or a completion arrives, and every
TICK_S while any request waits (the estimates of work not yet started fall as time
passes), and at the next wait that runs out. This is the service's one caller of `pump`,
so whatever it settles finds the future `hold` registered for it."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator

from ext_proc.director.admission import Admission
from ext_proc.director.outcomes import Outcome, Settled
from ext_proc.feeds.peers import Head, PeerEvent, PeerKind
from ext_proc.flow.queue import Waiting
from ext_proc.vocab.events import Closed, FirstByte, Listener

TICK_S = 0.05


class Holding(Listener):
    """Holds the waiting requests' futures and pumps the admission's queue."""

    def __init__(self, admission: Admission, clock: Callable[[], float]) -> None:
        self.admission = admission
        self.clock = clock
        self._waiters: dict[int, asyncio.Future[Outcome]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
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
            self.admission.hear_claims(e.router, dict(e.claims), list(e.heads))
        self._wake.set()

    def _tell(self) -> None:
        if self.tell is not None and (claims := self.admission.claims_to_send()) is not None:
            self.tell(*claims)

    def confirm(self, request_ids: list[str]) -> None:
        """The fleet bus carried these dispatches: room this router left for its peers
        to hear of them is its own again."""
        if self.admission.confirm(request_ids):
            self._wake.set()

    @property
    def held(self) -> int:
        return len(self._waiters)

    @contextlib.contextmanager
    def hold(self, ticket: Waiting) -> Iterator[asyncio.Future[Outcome]]:
        """The future of a request the admission queued, to await: registered at once, so
        the caller takes it before its first await (no pump can settle the request
        unseen). Leaving before it is settled (its stream ended) takes it out of the
        queue."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiters[id(ticket)] = future
        # an admission's pump may have settled others that wait: handed over now
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="gorgo-flow-pump")
        try:
            yield future
        finally:
            self._waiters.pop(id(ticket), None)
            # not `future.done()`: a task cancelled while it awaited the future cancels
            # the future too; the ticket says whether it was settled
            self.admission.cancel(ticket)

    def _deliver(self, settled: list[Settled]) -> None:
        for w, outcome in settled:
            future = self._waiters.get(id(w))
            if future is not None and not future.done():
                future.set_result(outcome)

    async def _run(self) -> None:
        try:
            await self._pump_while_waiting()
        finally:
            self._tell()  # nothing waits: the peers stop holding room back for us

    async def _pump_while_waiting(self) -> None:
        while self._waiters:
            self._wake.clear()
            self._deliver(self.admission.pump())
            self._tell()
            wait_s = min(TICK_S, max(0.0, self.admission.next_expiry_s() - self.clock()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), timeout=wait_s if math.isfinite(wait_s) else TICK_S
                )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
