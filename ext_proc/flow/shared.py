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
the room of other backends is not held back. Each router also tells the heads of its queue
(per band, in its order, as many as one pump offers room to), shown on /state; they do not
gate releases: holding a request back while that many ahead of it waited at the peers
(one router's pump stops there) measured worse in the simulator (docs/results.md).
Claims not refreshed within CLAIM_TTL_S are forgotten (a router
that died holds nothing back for long).

A release not confirmed within CONFIRM_TIMEOUT_S counts as confirmed (fail open: a bus
that is slow or gone must not stop the queue; the bound then rests on the engines'
reports, as with one router per view). Pure: the clock is the caller's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from ext_proc.flow.queue import Waiting

# Far above a NATS round trip on one host or a LAN (well under 5 ms), short beside the
# queue's 50 ms tick: a bus gone quiet costs at most one release per backend this often.
CONFIRM_TIMEOUT_S = 0.1


# A waiting router's claims go out again this often while they stand (5 messages a second
# per router, not per request), and are forgotten after this long without news: three
# refreshes missed.
CLAIM_REFRESH_S = 0.2
CLAIM_TTL_S = 0.6


# A request at the head of a peer's queue, as told: (priority, seconds to its deadline or
# None, seconds it has waited); and as heard: (priority, deadline, arrival) on our clock
# (inf: no deadline).
Told = tuple[int, float | None, float]
Head = tuple[int, float, float]


class Claims:
    """The peers' claims: per backend the highest band waiting for it, and the requests
    a pump of theirs would offer room first (up to `tries_per_pump` per band, each found
    none at its last try); and when ours are due to be told."""

    def __init__(self, clock: Callable[[], float], tries_per_pump: int) -> None:
        self.clock = clock
        # This many ahead of a request in the peers' queues, waiting without room, hold it
        # back anywhere (one router's pump would stop before reaching it).
        self.tries_per_pump = tries_per_pump
        # router -> (its claims per backend, its heads, when heard)
        self._heard: dict[str, tuple[dict[str, Head], list[Head], float]] = {}
        self._sent: Hashable = None
        self._sent_s = -math.inf
        self._standing = False  # what we last said was a claim (not "nothing waits")
        # How often a release was held back for a peer's request.
        self.deferred = 0

    def hear(
        self,
        router: str,
        claims: Mapping[str, Told],
        heads: Iterable[Told],
    ) -> None:
        """A peer's claims now: per backend the first request waiting for it, and the
        heads, each as (priority, seconds to its deadline or None, seconds it has waited).
        Empty: it waits for nothing."""
        now_s = self.clock()

        def ours(t: Told) -> Head:
            p, due_s, waited_s = t
            return (p, math.inf if due_s is None else now_s + due_s, now_s - waited_s)

        if claims or heads:
            self._heard[router] = (
                {b: ours(t) for b, t in claims.items()},
                [ours(t) for t in heads],
                now_s,
            )
        else:
            self._heard.pop(router, None)

    def outranked(self, backend: str, priority: int, deadline_s: float, arrival_s: float) -> bool:
        """Whether a peer waits for `backend` with a request of a higher band (the
        request's deadline and arrival are not compared across routers: measured, that
        held requests back for peers' requests their pumps did not reach)."""
        now_s = self.clock()
        for router, (claims, _, heard_s) in list(self._heard.items()):
            if now_s - heard_s > CLAIM_TTL_S:
                del self._heard[router]
                continue
            first = claims.get(backend)
            # a higher band waiting for this backend (within a band, each router's order:
            # a peer's earlier request there may be one its pump does not reach)
            if first is not None and first[0] > priority:
                self.deferred += 1
                return True
        return False

    def due(self, standing: bool, signature: Hashable) -> bool:
        """Whether ours should go out now: changed (`signature`: what they are), or still
        `standing` and due for a refresh; if so, they count as sent."""
        now_s = self.clock()
        if not standing and not self._standing:
            return False  # nothing stands, and the peers know
        fresh = now_s - self._sent_s < CLAIM_REFRESH_S
        if standing and self._standing and signature == self._sent and fresh:
            return False
        self._sent, self._sent_s, self._standing = signature, now_s, standing
        return True

    def to_send(self, waiting: Iterable[Waiting]) -> tuple[dict[str, Told], list[Told]] | None:
        """Ours when they are due to go to the peers (changed, or a refresh), else None:
        for each backend our `waiting` requests wait for, the first of them in our order;
        and per band the first `tries_per_pump` in that order that found no room (each as
        priority, seconds to its deadline or None, seconds waited)."""
        first: dict[str, Waiting] = {}
        tried = sorted(
            (w for w in waiting if w.wants),  # tried: its backend had no room
            key=lambda w: (-w.priority, w.key()),
        )
        heads: list[Waiting] = []
        for w in tried:
            first.setdefault(w.wants, w)
            if sum(1 for h in heads if h.priority == w.priority) < self.tries_per_pump:
                heads.append(w)
        signature = (tuple((b, w.seq) for b, w in first.items()), tuple(w.seq for w in heads))
        if not self.due(bool(heads), signature):
            return None
        now_s = self.clock()

        def told(w: Waiting) -> Told:
            due_s = None if math.isinf(w.deadline_s) else w.deadline_s - now_s
            return (w.priority, due_s, now_s - w.arrival_s)

        return {b: told(w) for b, w in first.items()}, [told(w) for w in heads]

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The peers' claims heard and still standing: per backend the highest band
        waiting, and how many wait at their heads per band."""
        now_s = self.clock()
        return {
            r: {
                "backends": {b: p for b, (p, _, _) in c.items()},
                "heads": dict(Counter(str(p) for p, _, _ in heads)),
            }
            for r, (c, heads, at) in sorted(self._heard.items())
            if now_s - at <= CLAIM_TTL_S
        }


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
