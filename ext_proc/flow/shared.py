"""Room shared by several routers (docs/cost-model.md, "Several routers"): each router
holds its own gateway queue over one view of the fleet (the peers' dispatches over NATS,
ext_proc.feeds.peers), so two routers that see the same room at the same moment could
both fill it. The rule that bounds it: a router releases at most one request into a
backend until the fleet bus confirms that release (the NATS server has it, and with it
every peer's connection: a flush's round trip); until then that backend has no room for
this router. So at any moment each router has at most one release per backend its peers
may not have heard of yet, and a backend receives at most one request per router beyond
the room every router sees.

Priority across routers (`Claims`): each router tells the others, for each backend its
waiting requests wait for (the policy's choice at their last try), the highest priority
waiting for it, when that changes and every CLAIM_REFRESH_S while any waits. A router
offers a backend's room to a request only when no peer's fresh claim on that backend is
of a higher priority (unless the request waited the starvation bound): a router holding
only batch does not take the room another router's interactive request waits for, and
the room of other backends is not held back. One router offers room to at most a few
waiting requests a pump (core.pipeline.MAX_TRIES_PER_PUMP) before it stops: when that many
of a band wait without room, nothing lower is released anywhere. Its claim on ANY_BACKEND
says the same to its peers (the band of the last request a pump would offer), so N
routers keep one router's strict bands. Claims not refreshed within CLAIM_TTL_S are
forgotten (a router that died holds nothing back for long).

A release not confirmed within CONFIRM_TIMEOUT_S counts as confirmed (fail open: a bus
that is slow or gone must not stop the queue; the bound then rests on the engines'
reports, as with one router per view). Pure: the clock is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

# Far above a NATS round trip on one host or a LAN (well under 5 ms), short beside the
# queue's 50 ms tick: a bus gone quiet costs at most one release per backend this often.
CONFIRM_TIMEOUT_S = 0.1


# A waiting router's claims go out again this often while they stand (5 messages a second
# per router, not per request), and are forgotten after this long without news: three
# refreshes missed.
CLAIM_REFRESH_S = 0.2
CLAIM_TTL_S = 0.6
# A claim on every backend's room (no backend id can be "*": config.load).
ANY_BACKEND = "*"


class Claims:
    """The peers' claims on backends' room (backend -> the highest priority waiting for
    it), and when ours are due to be told."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        # router -> (its claims, when heard)
        self._heard: dict[str, tuple[dict[str, int], float]] = {}
        self._sent: dict[str, int] = {}
        self._sent_s = -math.inf
        # How often a release was held back for a peer's higher band.
        self.deferred = 0

    def hear(self, router: str, claims: Mapping[str, int]) -> None:
        """A peer's claims now (empty: it waits for nothing)."""
        if claims:
            self._heard[router] = (dict(claims), self.clock())
        else:
            self._heard.pop(router, None)

    def outranked(self, backend: str, priority: int) -> bool:
        """Whether a peer waits for `backend` with a request of a higher band."""
        now_s = self.clock()
        for router, (claims, heard_s) in list(self._heard.items()):
            if now_s - heard_s > CLAIM_TTL_S:
                del self._heard[router]
            elif max(claims.get(backend, priority), claims.get(ANY_BACKEND, priority)) > priority:
                self.deferred += 1
                return True
        return False

    def due(self, ours: Mapping[str, int]) -> bool:
        """Whether `ours` should go out now (changed, or standing for a refresh); if so,
        they count as sent."""
        now_s = self.clock()
        if ours == self._sent and (not ours or now_s - self._sent_s < CLAIM_REFRESH_S):
            return False
        self._sent, self._sent_s = dict(ours), now_s
        return True

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The peers' claims heard and still standing."""
        now_s = self.clock()
        return {r: c for r, (c, at) in sorted(self._heard.items()) if now_s - at <= CLAIM_TTL_S}


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
