"""Room shared by several routers (docs/cost-model.md, "Several routers"): each router
holds its own gateway queue over one view of the fleet (the peers' dispatches over NATS,
ext_proc.feeds.peers), so two routers that see the same room at the same moment could
both fill it. The rule that bounds it: a router releases at most one request into a
backend until the fleet bus confirms that release (the NATS server has it, and with it
every peer's connection: a flush's round trip); until then that backend has no room for
this router. So at any moment each router has at most one release per backend its peers
may not have heard of yet, and a backend receives at most one request per router beyond
the room every router sees.

A release not confirmed within CONFIRM_TIMEOUT_S counts as confirmed (fail open: a bus
that is slow or gone must not stop the queue; the bound then rests on the engines'
reports, as with one router per view). Pure: the clock is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Far above a NATS round trip on one host or a LAN (well under 5 ms), short beside the
# queue's 50 ms tick: a bus gone quiet costs at most one release per backend this often.
CONFIRM_TIMEOUT_S = 0.1


class Releases:
    """This router's releases its peers may not have heard of yet, per backend."""

    def __init__(self, clock: Callable[[], float], timeout_s: float = CONFIRM_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        self.clock = clock
        self.timeout_s = timeout_s
        # request id -> (backend, released at)
        self._open: dict[str, tuple[str, float]] = {}
        self._by_backend: dict[str, set[str]] = {}
        # Releases confirmed by the bus, and those that timed out first.
        self.confirmed = 0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._open)

    def released(self, backend: str, request_id: str) -> None:
        """A request was sent to `backend`: its peers hear of it once the bus confirms."""
        self._open[request_id] = (backend, self.clock())
        self._by_backend.setdefault(backend, set()).add(request_id)

    def confirm(self, request_ids: Iterable[str]) -> int:
        """The bus carried these dispatches (ids not released here are ignored): how many
        of ours it confirmed."""
        n = 0
        for rid in request_ids:
            if self._drop(rid):
                n += 1
        self.confirmed += n
        return n

    def blocked(self, backend: str) -> bool:
        """Whether a release into `backend` waits for the bus to confirm an earlier one."""
        ids = self._by_backend.get(backend)
        if not ids:
            return False
        now_s = self.clock()
        for rid in [r for r in ids if now_s - self._open[r][1] >= self.timeout_s]:
            self._drop(rid)
            self.timed_out += 1
        return bool(ids)

    def next_timeout_s(self) -> float | None:
        """When the oldest open release times out (None: none open)."""
        if not self._open:
            return None
        return min(at for _, at in self._open.values()) + self.timeout_s

    def _drop(self, rid: str) -> bool:
        entry = self._open.pop(rid, None)
        if entry is None:
            return False
        ids = self._by_backend[entry[0]]
        ids.discard(rid)
        if not ids:
            del self._by_backend[entry[0]]
        return True
