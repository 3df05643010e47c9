"""The flow controller: the admission seam's side with flow control on (llm-d's flow
control admission, in our own words). It owns the gateway queue (flow.queue), the classes
arriving (flow.room.Mix), the room rule, this router's releases and its peers' claims
(flow.shared), the counts of what it did and /state's snapshot. Nothing outside it changes
its queue: a request joins through `admit`, leaves through `pump` (released or refused:
the waits it settled, returned) or `cancel`.

A request goes straight on when nobody waits and the backend the policy chooses has room;
else it waits, and each pump offers room to the waiting requests in the queue's order.
Pure and synchronous: the router's clock.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any

from ext_proc.config.flow import Objective
from ext_proc.core.features import output_tokens
from ext_proc.core.router import NoRoom, Router
from ext_proc.director.admission import Schedule
from ext_proc.director.outcomes import Outcome, Queued, Refused, Routed, Settled
from ext_proc.feeds.peers import Head
from ext_proc.flow.classify import Objectives
from ext_proc.flow.queue import FlowQueue, QueueView, Waiting
from ext_proc.flow.room import Mix, has_room, within_caps
from ext_proc.flow.shared import Claims, Releases
from ext_proc.vocab.errors import RATE_LIMITED, UNAVAILABLE
from ext_proc.vocab.events import Closed, Dispatched, Listener
from ext_proc.vocab.types import BackendLifecycle, Candidate, Refusal, RouteRequest

# What flow control does with a request (FlowController.counts, gorgo_flow_outcomes_total).
FLOW_OUTCOMES = (
    "straight",
    "released",
    "cancelled",
    "rejected-saturated",
    "rejected-ttl-expired",
    "rejected-slo",
    "rejected-no-endpoints",
)
# A pump offers room to at most this many waiting requests that find none: past the
# first few, the fleet is full for the rest too (each try computes the candidates).
MAX_TRIES_PER_PUMP = 4


class _InEngine(Listener):
    """Keeps the queue's count of what each tenant has in the engines: its dispatches
    (released or straight) until they end."""

    def __init__(self, queue: FlowQueue) -> None:
        self.queue = queue

    def on_dispatch(self, e: Dispatched) -> None:
        rec = e.record
        self.queue.sent(e.request.request_id, e.request.tenant, rec.input_tokens, rec.output_tokens)

    def on_close(self, e: Closed) -> None:
        self.queue.finished(e.request_id)


class FlowController:
    """Holds admitted requests in the gateway queue until the backend the policy chooses
    has room, and settles each wait (released or refused)."""

    def __init__(
        self,
        router: Router,
        objectives: Objectives,
        schedule: Schedule,
        shared: bool | None = None,
    ) -> None:
        self.router = router
        self.objectives = objectives
        self.schedule = schedule
        self._queue = FlowQueue(router.cfg.flow_control)
        router.subscribe(_InEngine(self._queue))
        # The classes arriving: with one alone, holding cannot gain (flow.room.Mix).
        self.mix = Mix()
        # Several routers over one view (`shared`; default: a fleet bus is configured):
        # one release per backend until the bus confirms it, and no room taken that a
        # peer's higher band waits for (flow.shared). None: alone.
        if shared is None:
            shared = bool(router.cfg.bus.nats_url)
        self.releases = Releases(router.clock) if shared else None
        self.claims = Claims(router.clock, MAX_TRIES_PER_PUMP) if shared else None
        # Waits settled by the pump of another request's admission, for the next pump.
        self._settled: list[Settled] = []
        self._served: dict[int, str | None] = {}
        # What flow control did: passed straight, released after a wait, refused (by
        # reason), abandoned by the client.
        self.counts: Counter[str] = Counter()

    @property
    def queue(self) -> QueueView:
        """The gateway queue, to read (what waits, each tenant's tokens in the engines)."""
        return self._queue

    def admit(
        self, request: RouteRequest, objective: Objective, served: str | None, body_bytes: int
    ) -> Outcome | Queued:
        if objective.regions:
            request = replace(request, regions=frozenset(objective.regions))
            if not self._servable(request):
                self.counts["rejected-no-endpoints"] += 1
                return Refused(
                    Refusal(
                        UNAVAILABLE,
                        f"objective {objective.name!r}: no backend in regions "
                        f"{', '.join(sorted(objective.regions))} serves this model",
                        reason="rejected-no-endpoints",
                    )
                )
        w = self._arrive(request, objective, body_bytes)
        if not self._queue:  # nobody waits: straight through when a backend has room
            outcome = self._try(w, served)
            if outcome is not None:
                self.counts["straight"] += 1
                return outcome
        if self._queue.full(w.priority, body_bytes):
            self.counts["rejected-saturated"] += 1
            return Refused(
                Refusal(
                    RATE_LIMITED,
                    f"the gateway queue of priority {w.priority} is full, retry later",
                    self.router.cfg.flow_control.retry_after_s,
                    "rejected-saturated",
                )
            )
        self._queue.push(w)
        self._served[id(w)] = served
        mine = None
        for s in self._offer():
            if s.ticket is w:  # released at once (it was first in order and found room)
                mine = s.outcome
            else:
                self._settled.append(s)  # others': the next pump hands them out
        return Queued(w) if mine is None else mine

    def pump(self) -> list[Settled]:
        """Offer room to the waiting requests in order, and refuse those that waited too
        long: the waits settled since the last pump, in order."""
        settled, self._settled = self._settled, []
        return settled + self._offer()

    def cancel(self, ticket: Waiting) -> None:
        """Its client went away while it waited."""
        if not ticket.done:
            self._queue.remove(ticket)
            self._served.pop(id(ticket), None)
            self.counts["cancelled"] += 1

    def next_expiry_s(self) -> float:
        return self._queue.next_expiry_s()

    def confirm(self, request_ids: list[str]) -> int:
        """The fleet bus carried these dispatches to the peers: their backends have room
        for this router's next release again (the caller pumps). How many were ours."""
        return self.releases.confirm(request_ids) if self.releases is not None else 0

    def hear_claims(self, router: str, claims: dict[str, Head], heads: list[Head]) -> None:
        """A peer router's claims: for each backend, the first request waiting for it;
        the heads of its queue (priority, seconds to deadline or None, seconds waited)."""
        if self.claims is not None:
            self.claims.hear(router, claims, heads)

    def claims_to_send(self) -> tuple[dict[str, Head], list[Head]] | None:
        """Our claims when they are due to go to the peers (changed, or a refresh), else
        None (flow.shared.Claims.to_send: what they are)."""
        return self.claims.to_send(self._queue.waiting()) if self.claims is not None else None

    def snapshot(self) -> dict[str, Any]:
        """/state's `flow`: whether it is on, what waits (by band and tenant, the oldest
        wait), each tenant's tokens in the engines and a tenant's share (None: no limit),
        and what it did (straight, released, refused by reason, cancelled)."""
        now_s = self.router.clock()
        waiting = self._queue.waiting()
        share = self._queue.share(now_s, self._capacity())
        return {
            "enabled": True,
            "waiting": len(waiting),
            "oldest_wait_s": round(max((now_s - w.arrival_s for w in waiting), default=0.0), 3),
            **self._queue.depth(),
            "in_engine_tokens": self._queue.in_engine_by_tenant(),
            "tenant_share_tokens": None if math.isinf(share) else round(share),
            "outcomes": dict(sorted(self.counts.items())),
            **self._shared_snapshot(),
        }

    def _shared_snapshot(self) -> dict[str, Any]:
        r, c = self.releases, self.claims
        if r is None or c is None:
            return {}
        return {
            "releases": {"unconfirmed": len(r), "confirmed": r.confirmed, "timed_out": r.timed_out},
            "peer_claims": c.snapshot(),
            "deferred_to_peers": c.deferred,
        }

    # -- the steps ------------------------------------------------------------------------

    def _arrive(self, request: RouteRequest, objective: Objective, body_bytes: int) -> Waiting:
        """Its ticket: its class, deadline, longest wait and size; its tenant and class
        seen arriving."""
        now_s = self.router.clock()
        self._queue.seen(request.tenant, now_s)
        max_wait_s = self.objectives.max_wait_s(objective)
        w = Waiting(
            request=request,
            objective=objective.name,
            tenant=request.tenant,
            priority=objective.priority,
            arrival_s=now_s,
            deadline_s=self.objectives.deadline_s(objective, request, now_s),
            expires_s=now_s + max_wait_s,
            sheddable=objective.sheddable,
            body_bytes=body_bytes,
            tokens=(request.llm.input_tokens if request.llm else 0) + output_tokens(request),
            protected_ms=self.objectives.protected_ms(objective),
        )
        self.mix.seen((w.priority, w.tenant, w.objective, request.ttft_slo_ms), now_s)
        return w

    def _offer(self) -> list[Settled]:
        """One pass over the queue: the expired refused, then room offered in order."""
        if not self._queue:
            return []
        now_s = self.router.clock()
        settled = [
            Settled(w, self._expired(w, now_s - w.arrival_s)) for w in self._queue.expired(now_s)
        ]
        failed = 0
        for w in self._queue.order(now_s):
            outcome = self._try(w, self._served.get(id(w)))
            if outcome is None:
                w.tries += 1
                failed += 1
                if failed >= MAX_TRIES_PER_PUMP:
                    break
                continue
            self._queue.remove(w)
            self._served.pop(id(w), None)
            self.counts["released"] += isinstance(outcome, Routed)
            settled.append(Settled(w, outcome))
        return settled

    def _try(self, w: Waiting, served: str | None) -> Outcome | None:
        """Schedule it on a backend with room (None: none has room, it waits on)."""
        now_s = self.router.clock()
        settings = self.router.cfg.flow_control

        # A lower band's request leaves a higher band's SLO room: not where its prefill
        # and the work ahead of it would make a higher band's next request wait past half
        # of its SLO (engines start prefills in order), until it waited the starvation bound.
        # An engine that schedules by priority puts that next request before everything
        # of this band but a prefill under way: only its own prefill can delay it there.
        starved = now_s - w.arrival_s >= settings.starvation_s
        protect_ms = math.inf if starved else w.protected_ms
        if self._queue.over_share(w.tenant, w.tokens, self._queue.share(now_s, self._capacity())):
            return None  # its tenant has its share in the engines: others' requests first
        claims = None if starved else self.claims

        releases = self.releases
        # One class arriving, not sheddable: waiting can only delay it (flow.room.Mix).
        gated = w.sheddable or self.mix.mixed(now_s)

        def room(c: Candidate) -> bool:
            if releases is not None and releases.blocked(c.backend_id):
                return False  # its last release here is not yet heard by the peers
            if claims is not None and claims.outranked(
                c.backend_id, w.priority, w.deadline_s, w.arrival_s
            ):
                return False  # a peer's higher band waits for this room
            if not gated:
                return within_caps(c, settings)
            ahead_ms = c.prefill_ms if c.by_priority else c.unstarted_ms + c.prefill_ms
            return ahead_ms <= protect_ms and has_room(c, settings)

        waited_ms = (now_s - w.arrival_s) * 1000
        placed = self.schedule(w.request, served, room, waited_ms, w.behind)
        if isinstance(placed, NoRoom):
            w.wants = placed.backend_id
            if w.sheddable and now_s + placed.best_ttft_ms / 1000 > w.deadline_s:
                self.counts["rejected-slo"] += 1
                return Refused(
                    Refusal(
                        RATE_LIMITED,
                        f"objective {w.objective!r}: its TTFT objective cannot be met now "
                        f"(at best {placed.best_ttft_ms / 1000:.1f} s), retry later",
                        max(settings.retry_after_s, placed.best_ttft_ms / 1000),
                        "rejected-slo",
                    )
                )
            return None
        if isinstance(placed, Routed):
            self._queue.charge(w.tenant, w.tokens, now_s)
            if releases is not None:
                releases.released(placed.decision.backend, placed.decision.request_id)
        return placed

    def _capacity(self) -> int:
        """The fleet's KV capacity in tokens: the active backends' (the tenants' shares)."""
        return sum(
            b.kv_capacity[0]
            for b in self.router.backends.values()
            if b.lifecycle is BackendLifecycle.ACTIVE
        )

    def _expired(self, w: Waiting, waited_s: float) -> Refused:
        """It waited past its objective's longest wait (taken out of the queue)."""
        self._served.pop(id(w), None)
        self.counts["rejected-ttl-expired"] += 1
        return Refused(
            Refusal(
                RATE_LIMITED,
                f"no backend had room within the objective {w.objective!r}'s longest wait "
                f"(waited {waited_s:.1f} s), retry later",
                self.router.cfg.flow_control.retry_after_s,
                "rejected-ttl-expired",
            )
        )

    def _servable(self, request: RouteRequest) -> bool:
        """Whether an active backend in one of its regions serves its model."""
        model = request.llm.model if request.llm else None
        return any(
            b.config.region in request.regions and b.lifecycle is BackendLifecycle.ACTIVE
            for b in self.router.fleet.serving(model)
        )
