"""The gateway queue's order: priority bands (strict, with a starvation bound), then
fairness between tenants within a band (the least usage first: the prompt and output
tokens of its requests sent and not yet finished, plus its recent service, decaying),
then each request's deadline (arrival + its TTFT SLO, earliest first) or its arrival. A
tenant over its share of the engines waits (`over_share`). Pure: times come from the
caller.

The bands' order follows llm-d's flow control (pkg/epp/flowcontrol: band, then flow, then
item), the starvation bound SMG's head-of-queue promotion, the token-weighted,
decaying service its least-attained-service fairness, and the share's ceiling llm-d's
usage limits (a flow over its limit waits in the queue even when the backends have room;
in our own words).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ext_proc.config.flow import FlowControl
from ext_proc.vocab.types import RouteRequest


@dataclass(eq=False)
class Waiting:
    """A request held in the queue, and what orders it."""

    request: RouteRequest
    objective: str
    tenant: str
    priority: int
    arrival_s: float
    # arrival + its TTFT SLO (inf: none), and when it is refused for waiting too long
    deadline_s: float
    expires_s: float
    sheddable: bool
    # the body's size (the band's byte cap) and the tokens its tenant is charged
    body_bytes: int
    tokens: int
    seq: int = 0
    # True once it left the queue (released, refused, or its client went away)
    done: bool = False
    # How many times it was tried and found no room, and the requests waiting when it
    # joined (for the span).
    tries: int = 0
    behind: int = 0
    # The most work (ms) it may leave ahead of a higher band's next request (inf: any).
    protected_ms: float = math.inf
    # The backend the policy chose for it at its last try, which had no room ("": not
    # tried yet): what it waits for (several routers: flow.shared.Claims).
    wants: str = ""

    def key(self) -> tuple[float, float, int]:
        return (self.deadline_s, self.arrival_s, self.seq)


@dataclass
class _Band:
    by_tenant: dict[str, list[tuple[tuple[float, float, int], Waiting]]] = field(
        default_factory=dict
    )
    by_arrival: deque[Waiting] = field(default_factory=deque)
    requests: int = 0
    body_bytes: int = 0


class QueueView(Protocol):
    """The gateway queue as read from outside: only its controller changes it
    (director.flow_control)."""

    def __len__(self) -> int: ...

    def in_engine(self, tenant: str) -> int: ...

    def share(self, now_s: float, capacity_tokens: int) -> float: ...


class FlowQueue:
    """The requests waiting for room, in the order they are offered it."""

    def __init__(self, settings: FlowControl) -> None:
        self.settings = settings
        self._bands: dict[int, _Band] = {}
        self._expiry: list[tuple[float, int, Waiting]] = []
        self._seq = itertools.count(1)
        # tenant -> (service in tokens, when it was last decayed)
        self._service: dict[str, tuple[float, float]] = {}
        # What each tenant has in the engines: request id -> (tenant, its prompt plus
        # output tokens, held until it ends); tenant -> their sum.
        self._sent: dict[str, tuple[str, int]] = {}
        self._in_engine: dict[str, int] = {}
        # tenant -> when a request of it last arrived (the tenants sharing the engines)
        self._seen: dict[str, float] = {}

    def __len__(self) -> int:
        return sum(b.requests for b in self._bands.values())

    def full(self, priority: int, body_bytes: int) -> bool:
        """Whether a request of this band and size would go past the band's caps."""
        band = self._bands.get(priority)
        if band is None:
            return False
        s = self.settings
        return (
            band.requests + 1 > s.max_queued_requests
            or band.body_bytes + body_bytes > s.max_queued_bytes
        )

    def push(self, w: Waiting) -> None:
        w.seq = next(self._seq)
        w.behind = len(self)
        band = self._bands.setdefault(w.priority, _Band())
        heapq.heappush(band.by_tenant.setdefault(w.tenant, []), (w.key(), w))
        band.by_arrival.append(w)
        band.requests += 1
        band.body_bytes += w.body_bytes
        heapq.heappush(self._expiry, (w.expires_s, w.seq, w))

    def remove(self, w: Waiting) -> None:
        """It leaves the queue (its entries are dropped lazily)."""
        if w.done:
            return
        w.done = True
        band = self._bands[w.priority]
        band.requests -= 1
        band.body_bytes -= w.body_bytes

    # -- fairness ---------------------------------------------------------------------------

    def service(self, tenant: str, now_s: float) -> float:
        value, at_s = self._service.get(tenant, (0.0, now_s))
        if at_s >= now_s:
            return value
        return float(value * 0.5 ** ((now_s - at_s) / self.settings.fairness_half_life_s))

    def charge(self, tenant: str, tokens: int, now_s: float) -> None:
        """A request of `tenant` was sent on: its tokens count against the tenant."""
        self._service[tenant] = (self.service(tenant, now_s) + tokens, now_s)
        if len(self._service) > 4096:  # forget the tenants whose service has decayed away
            self._service = {
                t: (v, at) for t, (v, at) in self._service.items() if self.service(t, now_s) > 1
            }

    # -- what each tenant has in the engines ------------------------------------------------

    def sent(self, request_id: str, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request of `tenant` was dispatched: its prompt and output hold the engine's
        KV memory until it ends (the output counted whole from the start: what the
        engine must find room for)."""
        self.finished(request_id)  # a reused id: the older one can no longer end
        tokens = prompt_tokens + output_tokens
        self._sent[request_id] = (tenant, tokens)
        self._in_engine[tenant] = self._in_engine.get(tenant, 0) + tokens

    def finished(self, request_id: str) -> None:
        """It ended, however it ended: nothing of it is in the engine any more."""
        rec = self._sent.pop(request_id, None)
        if rec is None:
            return
        tenant, tokens = rec
        left = self._in_engine.get(tenant, 0) - tokens
        if left > 0:
            self._in_engine[tenant] = left
        else:
            self._in_engine.pop(tenant, None)

    def in_engine(self, tenant: str) -> int:
        """Tokens of `tenant` sent to the engines and not yet finished."""
        return self._in_engine.get(tenant, 0)

    def in_engine_by_tenant(self) -> dict[str, int]:
        return dict(sorted(self._in_engine.items()))

    def usage(self, tenant: str, now_s: float) -> float:
        """What orders the tenants in a band: in the engines now, plus recent service."""
        return self.in_engine(tenant) + self.service(tenant, now_s)

    def seen(self, tenant: str, now_s: float) -> None:
        """A request of `tenant` arrived (it shares the engines for tenant_window_s)."""
        self._seen[tenant] = now_s
        if len(self._seen) > 4096:  # forget the tenants gone quiet
            window_s = self.settings.tenant_window_s
            self._seen = {t: at for t, at in self._seen.items() if now_s - at <= window_s}

    def share(self, now_s: float, capacity_tokens: int) -> float:
        """A tenant's share of the engines, in tokens: tenant_share x the fleet's KV
        capacity over the tenants active in the last tenant_window_s (inf: no limit, with
        one tenant active or tenant_share 0)."""
        s = self.settings
        window_s = s.tenant_window_s
        active = sum(1 for at in self._seen.values() if now_s - at <= window_s)
        if active <= 1 or not s.tenant_share or capacity_tokens <= 0:
            return math.inf
        return s.tenant_share * capacity_tokens / active

    def over_share(self, tenant: str, tokens: int, share_tokens: float) -> bool:
        """Whether sending `tokens` more of `tenant` would take it past its share (a tenant
        with nothing in the engines may always send one, however large)."""
        held = self.in_engine(tenant)
        return held > 0 and held + tokens > share_tokens

    # -- order ------------------------------------------------------------------------------

    def order(self, now_s: float) -> Iterator[Waiting]:
        """The waiting requests in the order they are offered room: any of a lower band
        that waited past the starvation bound first (oldest first), then by band, tenant
        and deadline. The
        tenants' order is taken when the band is reached; the caller removes what it
        releases (a released request is not offered again)."""
        starved = self.settings.starvation_s
        # The bound lets a lower band past higher ones; within the highest band waiting,
        # fairness between tenants orders it (a heavy tenant's old requests do not jump
        # a light tenant's).
        heads = [
            (priority, arrivals[0])
            for priority, band in self._bands.items()
            if (arrivals := self._live(band.by_arrival))
        ]
        top = max((p for p, _ in heads), default=0)
        oldest = sorted((w for p, w in heads if p < top), key=lambda w: w.arrival_s)
        promoted = [w for w in oldest if now_s - w.arrival_s >= starved]
        for w in promoted:
            if not w.done:
                yield w
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            tenants = sorted(
                (t for t, heap in band.by_tenant.items() if self._prune(heap)),
                key=lambda t: self.usage(t, now_s),
            )
            for tenant in tenants:
                heap = band.by_tenant[tenant]
                # Popped in order from the tenant's own heap, and what was offered and
                # is still waiting pushed back when the pump stops: O(tries x log n) a
                # pump, not a copy of the queue.
                offered: list[tuple[tuple[float, float, int], Waiting]] = []
                try:
                    while heap:
                        entry = heapq.heappop(heap)
                        w = entry[1]
                        if w.done:
                            continue
                        offered.append(entry)
                        if w not in promoted:  # each offered once a pump
                            yield w
                finally:
                    for entry in offered:
                        if not entry[1].done:
                            heapq.heappush(heap, entry)

    def expired(self, now_s: float) -> list[Waiting]:
        """The requests that waited past their longest wait, taken out of the queue."""
        out = []
        while self._expiry and self._expiry[0][0] <= now_s:
            _, _, w = heapq.heappop(self._expiry)
            if not w.done:
                self.remove(w)
                out.append(w)
        return out

    def next_expiry_s(self) -> float:
        while self._expiry and self._expiry[0][2].done:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else math.inf

    def depth(self) -> dict[str, dict[str, int]]:
        """Requests waiting, by band (its priority) and by tenant."""
        bands: dict[str, int] = {}
        tenants: dict[str, int] = {}
        for priority, band in self._bands.items():
            if band.requests:
                bands[str(priority)] = band.requests
            for tenant, heap in band.by_tenant.items():
                if n := sum(1 for _, w in heap if not w.done):
                    tenants[tenant] = tenants.get(tenant, 0) + n
        return {"bands": bands, "tenants": tenants}

    def waiting(self) -> list[Waiting]:
        return [w for band in self._bands.values() for w in band.by_arrival if not w.done]

    @staticmethod
    def _prune(heap: list[tuple[tuple[float, float, int], Waiting]]) -> bool:
        while heap and heap[0][1].done:
            heapq.heappop(heap)
        return bool(heap)

    @staticmethod
    def _live(arrivals: deque[Waiting]) -> deque[Waiting]:
        while arrivals and arrivals[0].done:
            arrivals.popleft()
        return arrivals
