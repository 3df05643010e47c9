"""The request's recipe, one short function every transport calls (the Envoy session, the
simulator): resolve the model it asks for, admit it, let it wait in the gateway queue
until a backend has room (flow control, when on), schedule it (the candidates and the
policy's choice), record the dispatch. In the spirit of llm-d's `Director.HandleRequest`
(parse, admit, locate, prepare, schedule), in our own words; parsing and tokenizing stay
with the transport, which knows the wire.

Pure and synchronous: the router it drives runs on an injected clock. A request that must
wait comes back `Queued`; the transport calls `pump()` when room may have come (a first
byte, a completion, an engine report, a timer) and takes the outcomes of those released
or refused from `released`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from ext_proc.core.admission import serving
from ext_proc.core.features import NoActiveBackend, output_tokens
from ext_proc.core.router import NoRoom, Router
from ext_proc.feeds.peers import Head
from ext_proc.flow.classify import Objectives
from ext_proc.flow.queue import FlowQueue, Waiting
from ext_proc.flow.room import Mix, has_room, within_caps
from ext_proc.flow.shared import Claims, Releases
from ext_proc.vocab.errors import RATE_LIMITED, UNAVAILABLE
from ext_proc.vocab.events import Closed, Dispatched, Listener
from ext_proc.vocab.types import BackendLifecycle, Candidate, Decision, Refusal, RouteRequest

# What flow control does with a request (Director.counts, gorgo_flow_outcomes_total).
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


@dataclass(frozen=True)
class Routed:
    """Sent to `decision.backend`."""

    decision: Decision
    # The name the request goes to the engine as, when the client asked for an alias (the
    # transport rewrites the body's `model`); None: as asked.
    served_model: str | None = None


@dataclass(frozen=True)
class Refused:
    """Answered by the router itself: no engine could serve it now."""

    refusal: Refusal


@dataclass(frozen=True)
class Unrouted:
    """No backend is active (a fleet replaced whole, for the moment Envoy takes to learn
    the new one): the transport lets Envoy's fallback route take it."""

    reason: str


@dataclass(frozen=True)
class Queued:
    """Waiting in the gateway queue: its outcome comes later, in `Director.released`."""

    ticket: Waiting


Outcome = Routed | Refused | Unrouted


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


class Director:
    """Runs one request through the router's steps, in order."""

    def __init__(self, router: Router, shared: bool | None = None) -> None:
        self.router = router
        settings = router.cfg.flow_control
        self.objectives = Objectives(settings)
        # The gateway queue (None: flow control off, every request bound at once).
        self.queue = FlowQueue(settings) if settings.enabled else None
        if self.queue is not None:
            router.subscribe(_InEngine(self.queue))
        # The classes arriving: with one alone, holding cannot gain (flow.room.Mix).
        self.mix = Mix()
        # Several routers over one view (`shared`; default: a fleet bus is configured):
        # one release per backend until the bus confirms it, and no room taken that a
        # peer's higher band waits for (flow.shared). None: alone.
        if shared is None:
            shared = bool(router.cfg.bus.nats_url)
        shared = shared and settings.enabled
        self.releases = Releases(router.clock) if shared else None
        self.claims = Claims(router.clock, MAX_TRIES_PER_PUMP) if shared else None
        # The outcomes of waiting requests decided by a pump, for the transport to take.
        self.released: list[tuple[Waiting, Outcome]] = []
        self._served: dict[int, str | None] = {}
        # What flow control did: passed straight, released after a wait, refused (by
        # reason), abandoned by the client.
        self.counts: Counter[str] = Counter()

    def handle(self, request: RouteRequest, body_bytes: int = 0) -> Outcome | Queued:
        request, served = self.resolve_model(request)
        refused = self.router.admit(request)
        if refused is not None:
            return Refused(refused)
        objective = self.objectives.of(request)
        if objective.priority != request.priority:
            # its class, for the engines that schedule by priority (with or without the
            # gateway queue: Decision.engine_priority)
            request = replace(request, priority=objective.priority)
        if self.queue is None:
            return self._schedule(request, served)
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
        now_s = self.router.clock()
        self.queue.seen(request.tenant, now_s)
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
        if not self.queue:  # nobody waits: straight through when a backend has room
            outcome = self._try(w, served)
            if outcome is not None:
                self.counts["straight"] += 1
                return outcome
        if self.queue.full(w.priority, body_bytes):
            self.counts["rejected-saturated"] += 1
            return Refused(
                Refusal(
                    RATE_LIMITED,
                    f"the gateway queue of priority {w.priority} is full, retry later",
                    self.router.cfg.flow_control.retry_after_s,
                    "rejected-saturated",
                )
            )
        self.queue.push(w)
        self._served[id(w)] = served
        self.pump()
        for i, (done, outcome) in enumerate(self.released):
            if done is w:  # released at once (it was first in order and found room)
                del self.released[i]
                return outcome
        return Queued(w)

    def pump(self) -> None:
        """Offer room to the waiting requests in order, and refuse those that waited too
        long; their outcomes go to `released`."""
        if not self.queue:
            return
        now_s = self.router.clock()
        for w in self.queue.expired(now_s):
            self._refuse(w, "rejected-ttl-expired", f"waited {now_s - w.arrival_s:.1f} s")
        failed = 0
        for w in self.queue.order(now_s):
            outcome = self._try(w, self._served.get(id(w)))
            if outcome is None:
                w.tries += 1
                failed += 1
                if failed >= MAX_TRIES_PER_PUMP:
                    break
                continue
            self.queue.remove(w)
            self._served.pop(id(w), None)
            self.counts["released"] += isinstance(outcome, Routed)
            self.released.append((w, outcome))

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
        None: for each backend our waiting requests wait for, the first of them in our
        order; and per band the first MAX_TRIES_PER_PUMP in that order that found no room
        (each as priority, seconds to its deadline or None, seconds waited)."""
        if self.claims is None or self.queue is None:
            return None
        first: dict[str, Waiting] = {}
        tried = sorted(
            (w for w in self.queue.waiting() if w.wants),  # tried: its backend had no room
            key=lambda w: (-w.priority, w.key()),
        )
        heads: list[Waiting] = []
        for w in tried:
            first.setdefault(w.wants, w)
            if sum(1 for h in heads if h.priority == w.priority) < MAX_TRIES_PER_PUMP:
                heads.append(w)
        signature = (tuple((b, w.seq) for b, w in first.items()), tuple(w.seq for w in heads))
        if not self.claims.due(bool(heads), signature):
            return None
        now_s = self.router.clock()

        def told(w: Waiting) -> Head:
            due_s = None if math.isinf(w.deadline_s) else w.deadline_s - now_s
            return (w.priority, due_s, now_s - w.arrival_s)

        return {b: told(w) for b, w in first.items()}, [told(w) for w in heads]

    def cancel(self, w: Waiting) -> None:
        """Its client went away while it waited."""
        if self.queue is not None and not w.done:
            self.queue.remove(w)
            self._served.pop(id(w), None)
            self.counts["cancelled"] += 1

    def snapshot(self) -> dict[str, Any]:
        """/state's `flow`: whether it is on, what waits (by band and tenant, the oldest
        wait), each tenant's tokens in the engines and a tenant's share (None: no limit),
        and what it did (straight, released, refused by reason, cancelled)."""
        if self.queue is None:
            return {"enabled": False}
        now_s = self.router.clock()
        waiting = self.queue.waiting()
        share = self.queue.share(now_s, self._capacity())
        return {
            "enabled": True,
            "waiting": len(waiting),
            "oldest_wait_s": round(max((now_s - w.arrival_s for w in waiting), default=0.0), 3),
            **self.queue.depth(),
            "in_engine_tokens": self.queue.in_engine_by_tenant(),
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

    def next_expiry_s(self) -> float:
        return self.queue.next_expiry_s() if self.queue is not None else math.inf

    def resolve_model(self, request: RouteRequest) -> tuple[RouteRequest, str | None]:
        """A public model name the config maps to served ones (an alias, a rollout's
        split) as the name the engine serves; the request unchanged otherwise."""
        llm = request.llm
        if llm is None:
            return request, None
        served = self.router.served_name(llm.model, request.session_key or request.request_id)
        if served is None or served == llm.model:
            return request, None
        return replace(request, llm=replace(llm, model=served)), served

    # -- the steps ------------------------------------------------------------------------

    def _schedule(self, request: RouteRequest, served: str | None) -> Outcome:
        try:
            decision = self.router.decide(request)
        except NoActiveBackend as e:
            return Unrouted(str(e))
        return Routed(decision, served)

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
        assert self.queue is not None
        if self.queue.over_share(w.tenant, w.tokens, self.queue.share(now_s, self._capacity())):
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

        try:
            waited_ms = (now_s - w.arrival_s) * 1000
            placed = self.router.place(w.request, room, waited_ms, w.behind)
        except NoActiveBackend as e:
            return Unrouted(str(e))
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
        self.queue.charge(w.tenant, w.tokens, now_s)
        if releases is not None:
            releases.released(placed.backend, placed.request_id)
        return Routed(placed, served)

    def _capacity(self) -> int:
        """The fleet's KV capacity in tokens: the active backends' (the tenants' shares)."""
        return sum(
            b.kv_capacity[0]
            for b in self.router.backends.values()
            if b.lifecycle is BackendLifecycle.ACTIVE
        )

    def _refuse(self, w: Waiting, reason: str, why: str) -> None:
        self._served.pop(id(w), None)
        self.counts[reason] += 1
        refusal = Refusal(
            RATE_LIMITED,
            f"no backend had room within the objective {w.objective!r}'s longest wait ({why}), "
            "retry later",
            self.router.cfg.flow_control.retry_after_s,
            reason,
        )
        self.released.append((w, Refused(refusal)))

    def _servable(self, request: RouteRequest) -> bool:
        model = request.llm.model if request.llm else None
        return any(
            b.config.region in request.regions and b.lifecycle is BackendLifecycle.ACTIVE
            for b in serving(self.router.fleet.state, model)
        )
