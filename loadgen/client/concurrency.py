"""The client's concurrency cap (the GORGO paper's protocol, loadgen.client.protocol): at most
`limit` requests in flight; an arrival that finds every slot taken waits, first come first
served, for the next slot to free, and how long it waited is its slip.

Pure: no timers, no event loop. Time comes from the clock it is given (the simulator's
virtual clock, the live replay's event loop), read when a request arrives or a slot frees.
The simulator (loadgen.sim.simulate) and the live replay (loadgen.replay.loop) both use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """A request given a slot: when it was due and when it got the slot (seconds)."""

    item: T
    due_s: float
    sent_s: float
    # It found every slot taken and waited for one.
    throttled: bool

    @property
    def slip_s(self) -> float:
        return self.sent_s - self.due_s


class ConcurrencyCap(Generic[T]):
    """At most `limit` in flight; the rest wait in arrival order."""

    def __init__(self, limit: int, clock: Callable[[], float]) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {limit}")
        self.limit = limit
        self.clock = clock
        self.in_flight = 0
        self._waiting: deque[tuple[float, T]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, item: T, due_s: float | None = None) -> Admitted[T] | None:
        """A request is due (at `due_s`, now by default): admitted now when a slot is
        free, else None and it waits (release admits it)."""
        due = self.clock() if due_s is None else due_s
        if self.in_flight < self.limit:
            return self._admit(due, item, throttled=False)
        self._waiting.append((due, item))
        return None

    def release(self) -> Admitted[T] | None:
        """A request in flight ended: its slot goes to the longest waiting, if any."""
        if self.in_flight <= 0:
            raise RuntimeError("release() without a request in flight")
        self.in_flight -= 1
        if self._waiting:
            due, item = self._waiting.popleft()
            return self._admit(due, item, throttled=True)
        return None

    def _admit(self, due_s: float, item: T, throttled: bool) -> Admitted[T]:
        self.in_flight += 1
        return Admitted(item, due_s, max(self.clock(), due_s), throttled)
