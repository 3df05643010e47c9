"""The offline simulator: a trace replayed on a virtual clock through the very same router
(policy, prefix index, queue estimate, probes' arithmetic) and the very same engine model
as the live emulated fleet, with the WAN's RTT profile. Deterministic for a given seed.

Per request: it arrives at the proxy at its (scaled) trace time; the router decides; it
reaches the engine one WAN half-trip later; the engine model schedules it; each token
travels back one half-trip. The router sees the first token (TTFT) and the completion
(E2E, and the engine's cached-token count) when they reach the proxy, as live. What it runs
on (the routers, the engines, the links) is built by its base, world.py's `SimWorld`.

Under a client protocol with a concurrency cap (loadgen.client.protocol), a request whose
arrival finds every slot taken waits, first come first served, for the first client to
see its answer end; the wait is its slip, and its TTFT and E2E count from dispatch.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from emulator.wan import DelayModel, region_rtt_ms
from ext_proc.core.router import Router
from ext_proc.director.outcomes import Outcome, Queued, Refused, Routed
from ext_proc.prompt.parse import COMPLETIONS
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import Refusal, RouteRequest, Status
from loadgen.client.concurrency import Admitted, ConcurrencyCap
from loadgen.results import RequestResult
from loadgen.sim.bus import Bus
from loadgen.sim.kv_link import KvMover, KvStats
from loadgen.sim.rivals.feed import RivalFeed
from loadgen.sim.settings import PROXY, SimSettings
from loadgen.sim.world import SimWorld, preempted, sub_blocks
from loadgen.traces.request import TraceRequest

_ARRIVE, _AT_ENGINE, _STEP, _FIRST_BYTE, _DONE, _PROBE, _KV_EVENTS = range(7)
_SCRAPE, _REPORT, _PEER, _CALL = range(7, 11)
# A client's due time and its concurrency slot coming free (only with a cap).
_SEND, _SLOT = range(11, 13)
# Flow control: the gateway queues are offered room again (TICK_S apart while any waits).
_TICK = 13
TICK_S = 0.05
# Several routers with flow control: the bus confirms a router's dispatch to it (the
# server has it: a flush's round trip, ext_proc.flow.shared).
_CONFIRM = 14
# Prefill and decode apart: a prompt's KV has reached its decode engine; a prefill leg's
# answer has reached its router.
_KV_ARRIVED, _PREFILL_DONE = 15, 16

# A request on its way to its front door: (request, origin region, door, access RTT ms).
_Arrival = tuple[TraceRequest, str, str, float]


class _Held(NamedTuple):
    """A request at its front door, as the router's outcome for it is applied."""

    r: TraceRequest
    origin: str
    door: str
    access_ms: float
    router: Router
    objective: str
    tenant: str


# Called after each completion with (request result, the router): the tuner's hook.
CompletionHook = Callable[[RequestResult, Router], None]
# Called as requests finish (answered or refused) with (finished, requests in the run).
ProgressHook = Callable[[int, int], None]


@dataclass
class SimResult:
    settings: SimSettings
    requests: list[RequestResult]
    itl_ms: list[float]
    router: Router
    # Requests the protocol dropped (prompts over max_input_tokens).
    dropped: int = 0
    # Requests the router answered itself (admission refused: 404 unknown model, 400 none
    # named, 503 none in rotation, 429 shed), by HTTP status.
    refused: dict[int, int] = field(default_factory=dict)
    # Running requests the engines preempted (their priority scheduling), by the
    # priority they carried.
    preempted: dict[str, int] = field(default_factory=dict)
    # Prefill and decode apart (settings.pd): what the links between the engines carried.
    kv: KvStats | None = None


class Simulation(SimWorld):
    """A trace's requests through the world its settings make (`SimWorld`: routers,
    engines, links), event by event on the virtual clock, and the results they leave."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        settings: SimSettings,
        hook: CompletionHook | None = None,
        progress: ProgressHook | None = None,
    ) -> None:
        self.trace, self.dropped = settings.protocol.apply(trace)
        self.hook = hook
        self.progress = progress
        super().__init__(settings)
        self.refused: dict[int, int] = {}
        kinds = (_PEER, _CONFIRM)
        self.bus = Bus(
            self.routers_at, self.directors, lambda: self.now_s, self._push, kinds, self._room
        )
        if settings.share_dispatches:
            self.bus.connect()
        self.feed = None if self.rival is None else RivalFeed(self.rival, self)
        self.kv = KvMover(
            self.engines,
            settings.backends,
            {b: e.profile.kv_bytes_per_token for b, e in self.engines.items()},
            settings.kv_gbps,
            settings.pd_protocol == "sglang",
        )
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.results: dict[str, RequestResult] = {}
        # Per request in flight: its router, its WAN link, when it reached its front door
        # and its client's access round trip to that door.
        self._router_of: dict[str, Router] = {}
        self._link_of: dict[str, DelayModel] = {}
        self._arrival_s: dict[str, float] = {}
        self._access_ms: dict[str, float] = {}
        self._last_emit_s: dict[str, float] = {}
        self.itl_ms: list[float] = []
        # The client's concurrency slots (protocol.max_concurrency, first come, first
        # served, on the virtual clock), and each request's slip.
        cap = settings.protocol.max_concurrency
        self._cap: ConcurrencyCap[_Arrival] | None = (
            None if cap is None else ConcurrencyCap(cap, lambda: self.now_s)
        )
        self._slip_ms: dict[str, float] = {}
        # P/D: each prefill leg's answer's half trip back to its door.
        self._leg_back_s: dict[str, float] = {}
        # Flow control: the requests waiting in a router's gateway queue, with where they
        # came from (as _bind takes them), and whether a tick is due.
        self._queued: dict[str, _Held] = {}
        self._ticking = False
        # door_spacing_ms: when each front door takes its next request, and when each
        # request waiting there reached it. envoy_workers: per (door, backend, worker), the
        # connections open and those busy, and the connection each request holds.
        self._door_free_s: dict[str, float] = {}
        self._door_arrival_s: dict[str, float] = {}
        self._conns_open: dict[tuple[str, str, int], int] = {}
        self._conns_busy: dict[tuple[str, str, int], int] = {}
        self._conn_of: dict[str, tuple[str, str, int]] = {}
        # Its own RNG: the other draws stay as they were.
        self._worker_rng = random.Random(f"envoy-workers:{settings.seed}")

    def _push(self, t: float, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _schedule_step(self, backend: str) -> None:
        t = self.engines[backend].next_event_s()
        if t is not None:
            self._push(t, _STEP, (backend, t))

    def at(self, t_s: float, change: Callable[[], None]) -> None:
        """Run `change` at virtual time t_s (a scenario's regime change: a link's delay)."""
        self._push(t_s, _CALL, change)

    def run(self) -> SimResult:
        for r in self.trace:
            if self.s.front_doors:
                origin = self.s.origin(r.session or r.id)
                door = self.s.door_of(origin)
                access_ms = region_rtt_ms(origin, door)
            else:
                origin, door, access_ms = "", PROXY, 0.0
            sent_s = r.arrival_s * self.s.time_scale
            if self.s.protocol.max_concurrency is None:
                self._push(sent_s + access_ms / 2000, _ARRIVE, (r, origin, door, access_ms))
            else:
                self._push(sent_s, _SEND, (r, origin, door, access_ms))
        for door in self.routers_at:
            for b in self.engines:
                self._push(0.0, _PROBE, (door, b))
        if self.s.engine_reports:
            for door in self.routers_at:
                for b in self.engines:
                    self._push(0.0, _SCRAPE, (door, b))
        if self.feed is not None:
            self.feed.start()
        self._pending = len(self.trace)
        told = self._pending
        while self._events and self._pending:
            if self.progress is not None and self._pending != told:
                told = self._pending
                self.progress(len(self.trace) - told, len(self.trace))
            t, _, kind, data = heapq.heappop(self._events)
            self.now_s = t
            if kind == _ARRIVE:
                self._arrive(*data)
            elif kind == _AT_ENGINE:
                backend, r, priority = data
                engine = self.engines[backend]
                per_engine = r.block_tokens // self.engine_block_tokens[backend]
                blocks = sub_blocks(r.block_ids, per_engine, self.engine_salt(r))
                lora = r.model if r.model in self.served[backend].adapters else None
                # a prefill leg generates the first token only (its decode does the rest)
                out = 1 if self.kv.prefill_of.get(r.id) == backend else r.output_tokens
                engine.submit(r.id, r.input_tokens, out, blocks, t, lora, 1.0, priority)
                self._publish_cache_changes(backend, t)
                self._schedule_step(backend)
            elif kind == _KV_ARRIVED:
                backend = self.kv.arrived(data, t)
                self._schedule_step(backend)
            elif kind == _PREFILL_DONE:
                if (router := self._router_of.get(data)) is not None:
                    router.prefill_done(data, kv_sent=self.s.pd_protocol == "sglang")
            elif kind == _STEP:
                backend, due = data
                if self.engines[backend].next_event_s() != due:
                    continue  # replanned since: a newer event stands for this engine
                self._step(backend, t)
            elif kind == _FIRST_BYTE:
                # a one-token answer's completion can reach the proxy first: then no router
                # holds it any more
                if (router := self._router_of.get(data)) is not None:
                    router.first_byte(data)
                    if self._queued:
                        self._pump()
            elif kind == _DONE:
                self._done(data)
                self._pending -= 1
                if self._queued:
                    self._pump()
            elif kind == _TICK:
                self._ticking = False
                self._pump()
            elif kind == _PROBE:
                door, b = data
                rtt_ms = self.links[data].sample_rtt_ms()
                for router in self.routers_at[door]:
                    router.inputs.record_probe(b, rtt_ms)
                self._push(t + self.probe_interval_s, _PROBE, data)
            elif kind == _KV_EVENTS:
                door, backend, changes = data
                for router in self.routers_at[door]:
                    router.inputs.apply_keyed_kv_events(
                        backend, self.engine_block_tokens[backend], changes
                    )
            elif kind == _SCRAPE:
                # The engine's reading now (as emulator/engine/status.py renders /metrics; one
                # code path would need the engine server here) reaches
                # the door a half-trip later.
                door, b = data
                self._push(t + self.one_way_s(door, b), _REPORT, (door, b, self.report(b)))
                self._push(t + self.metrics_interval_s, _SCRAPE, data)
            elif kind == _REPORT:
                door, b, report = data
                for router in self.routers_at[door]:
                    router.inputs.record_engine_report(b, report)
                if self._queued:
                    self._pump()
            elif kind == _PEER:
                self.bus.deliver(*data)
            elif kind == _CALL:
                data()
            elif kind == _CONFIRM:
                self.bus.confirm(*data)
            elif kind == _SEND:
                # The client's due time: a free slot sends it now, else it waits.
                assert self._cap is not None
                self._dispatch(self._cap.arrive(data))
            elif kind == _SLOT:
                # A client saw its answer end: its slot goes to the longest waiting.
                assert self._cap is not None
                self._dispatch(self._cap.release())
        if self.progress is not None:
            self.progress(len(self.trace) - self._pending, len(self.trace))
        # The last closes are still on the bus: deliver them, so every router's books close.
        for t, _, kind, data in sorted(self._events):
            if kind == _PEER:
                self.now_s = t
                self.bus.deliver(*data)
        ordered = [self.results[r.id] for r in self.trace]
        return SimResult(
            self.s,
            ordered,
            self.itl_ms,
            self.router,
            self.dropped,
            dict(sorted(self.refused.items())),
            preempted(self.engines.values()),
            self.kv.stats if self.s.pd else None,
        )

    def _dispatch(self, sent: Admitted[_Arrival] | None) -> None:
        """The client sends a request given a slot (if any) now, holding the slot until
        it sees the answer end; it reaches its front door one access half-trip later."""
        if sent is None:
            return
        r, _, _, access_ms = sent.item
        self._slip_ms[r.id] = sent.slip_s * 1000
        self._push(self.now_s + access_ms / 2000, _ARRIVE, sent.item)

    def _publish_cache_changes(self, backend: str, t: float) -> None:
        """Precise mode: the engine's cache changes reach each front door's routers a
        half-trip later."""
        cache = self.engines[backend].cache
        if cache.events:
            if self.s.prefix_state == "precise":
                for door in self.routers_at:
                    heard_s = t + self.one_way_s(door, backend)
                    self._push(heard_s, _KV_EVENTS, (door, backend, cache.events))
            if self.feed is not None:
                self.feed.kv_events(backend, t, cache.events)
            cache.events = []

    def _arrive(self, r: TraceRequest, origin: str, door: str, access_ms: float) -> None:
        if self.s.door_spacing_ms:
            # The door is busy with an earlier request: this one waits its turn (FIFO).
            self._door_arrival_s.setdefault(r.id, self.now_s)
            free_s = self._door_free_s.get(door, 0.0)
            if self.now_s < free_s:
                self._push(free_s, _ARRIVE, (r, origin, door, access_ms))
                return
            self._door_free_s[door] = self.now_s + self.s.door_spacing_ms / 1000
        llm = _llm(r, self.s.protocol.sent_max_tokens(r.output_tokens))
        per = max(1, r.block_tokens // self.router_block_tokens)
        blocks = sub_blocks(r.block_ids, per, 1)[: r.input_tokens // self.router_block_tokens]
        engine_keys = None
        if self.s.prefix_state == "precise":
            engine_keys = self.engine_keys(r)
        if self.feed is not None:
            self.feed.rows[r.id] = r
        routers = self.routers_at[door]
        router = routers[zlib.crc32((r.session or r.id).encode()) % len(routers)]
        key = r.session or r.id
        classes = self.s.classes
        objective = classes.objective_of(key) if classes is not None else ""
        tenant = classes.tenant_of(key) if classes is not None else ""
        request = RouteRequest(
            r.id, llm, r.session, blocks, engine_keys, objective=objective, tenant=tenant
        )
        # TTFT and E2E count from the door's arrival (a wait for the door included, and
        # the wait in the router's gateway queue).
        self._arrival_s[r.id] = self._door_arrival_s.pop(r.id, self.now_s)
        held = _Held(r, origin, door, access_ms, router, objective, tenant)
        outcome = self.directors[id(router)].handle(request)
        if isinstance(outcome, Queued):
            self._queued[r.id] = held
            self._pump()
            return
        self._bind(held, outcome)

    def _room(self) -> None:
        if self._queued:
            self._pump()

    def _pump(self) -> None:
        """Room may have come: each director's admission offers it to its queue (the
        waits it settles bound); while any request waits, again TICK_S later (the
        estimates fall as time passes), as the service."""
        for director in self.directors.values():
            for w, outcome in director.admission.pump():
                self._bind(self._queued.pop(w.request.request_id), outcome)
            self.bus.tell(director)
        if self._queued and not self._ticking:
            self._ticking = True
            self._push(self.now_s + TICK_S, _TICK, None)

    def _bind(self, held: _Held, outcome: Outcome) -> None:
        """The request's outcome: sent to its backend, or answered by the router."""
        r, origin, door, access_ms, router, objective, tenant = held
        if isinstance(outcome, Refused):
            self._refuse(r, origin, access_ms, outcome.refusal)
            self.results[r.id].objective = objective or None
            self.results[r.id].tenant = tenant or None
            return
        assert isinstance(outcome, Routed), outcome  # the simulator's fleet stays active
        self._router_of[r.id] = router
        d = outcome.decision
        self.results[r.id] = RequestResult(
            r.id,
            d.backend,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            predicted_cached_tokens=d.chosen.cached_tokens,
            region=origin or None,
            slip_ms=self._slip_ms.pop(r.id, 0.0),
            objective=objective or None,
            tenant=tenant or None,
        )
        # The router's predictions count from its decision: the row's, from where its
        # TTFT and E2E count (the door's wait and the access leg are known, not predicted).
        before_ms = (self.now_s - self._arrival_s[r.id]) * 1000 + access_ms
        self.results[r.id].predicted_ttft_ms = d.chosen.predicted_ttft_ms + before_ms
        self.results[r.id].predicted_e2e_ms = d.chosen.predicted_e2e_ms + before_ms
        self._access_ms[r.id] = access_ms
        link = self._link_of[r.id] = self.links[(door, d.backend)]
        # Dispatch pacing: the router keeps the request before Envoy sends it on.
        delay_s = d.pace_ms / 1000 + link.one_way_delay_s()
        if self.s.envoy_workers:
            worker = self._worker_rng.randrange(self.s.envoy_workers)
            key = self._conn_of[r.id] = (door, d.backend, worker)
            busy = self._conns_busy.get(key, 0)
            if busy >= self._conns_open.get(key, 0):
                self._conns_open[key] = busy + 1
                delay_s += link.sample_rtt_ms() / 1000  # the handshake
            self._conns_busy[key] = busy + 1
        priority = self.class_priority.get(objective)  # in its body
        if d.prefill is not None:  # prefill and decode apart: the prefill leg goes first
            p = d.prefill.backend
            two_steps = self.s.pd_protocol == "vllm"  # vLLM's: the answer, then the decode
            relay_s = (
                self.one_way_s(door, p) + self.one_way_s(door, d.backend) if two_steps else 0.0
            )
            self.kv.send(r, p, d.backend, relay_s)
            self._leg_back_s[r.id] = self.one_way_s(door, p)  # its answer's trip back
            delay_s = d.pace_ms / 1000 + self.links[(door, p)].one_way_delay_s()
            self._push(self.now_s + delay_s, _AT_ENGINE, (p, r, priority))
            return
        self._push(self.now_s + delay_s, _AT_ENGINE, (d.backend, r, priority))

    def _refuse(self, r: TraceRequest, origin: str, access_ms: float, refusal: Refusal) -> None:
        """The router answered the request itself, no engine reached: counted, not timed
        (its TTFT and E2E are not a model's); the client's slot frees when the answer
        is back."""
        code = refusal.status
        self.refused[code] = self.refused.get(code, 0) + 1
        self.results[r.id] = RequestResult(
            r.id,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            # flow control's refusals (they say a reason) apart from admission's
            status="rejected" if refusal.reason else "refused",
            error=f"HTTP {code} {refusal.error.code}: {refusal.message}",
            region=origin or None,
            slip_ms=self._slip_ms.pop(r.id, 0.0),
        )
        self._door_arrival_s.pop(r.id, None)
        if self.s.protocol.max_concurrency is not None:
            self._push(self.now_s + access_ms / 2000, _SLOT, r.id)
        self._pending -= 1

    def _step(self, backend: str, t: float) -> None:
        # TTFT and E2E as the client sees them: at its front door, plus its access leg.
        for e in self.engines[backend].advance(t):
            if self.kv.prefill_of.get(e.rid) == backend:  # a prefill leg: its KV goes on
                arrive_s = self.kv.prefilled(e.rid, e.cached_tokens, t)
                self._push(arrive_s, _KV_ARRIVED, e.rid)
                # the leg answers its router: vLLM's at once, SGLang's once the KV is sent
                answered_s = t if self.s.pd_protocol == "vllm" else arrive_s
                self._push(answered_s + self._leg_back_s.pop(e.rid), _PREFILL_DONE, e.rid)
                continue
            res = self.results[e.rid]
            link = self._link_of[e.rid]
            if e.index == 0:
                at_proxy_s = t + link.one_way_delay_s()
                res.ttft_ms = (at_proxy_s - self._arrival_s[e.rid]) * 1000 + self._access_ms[e.rid]
                res.cached_tokens = e.cached_tokens
                self._push(at_proxy_s, _FIRST_BYTE, e.rid)
            else:
                self.itl_ms.append((t - self._last_emit_s[e.rid]) * 1000)
            self._last_emit_s[e.rid] = t
            if e.finished:
                done_s = t + link.one_way_delay_s()
                e2e_ms = (done_s - self._arrival_s[e.rid]) * 1000 + self._access_ms[e.rid]
                res.e2e_ms = max(res.ttft_ms or 0.0, e2e_ms)
                self._push(max(done_s, t), _DONE, e.rid)
        self._publish_cache_changes(backend, t)
        self._schedule_step(backend)

    def _done(self, rid: str) -> None:
        res = self.results[rid]
        assert res.e2e_ms is not None
        access_ms = self._access_ms.pop(rid)
        at_door_ms = res.e2e_ms - access_ms
        if self.s.protocol.max_concurrency is not None:
            # The client frees its slot when it has seen the whole answer: E2E after it
            # sent the request (a first byte delayed past the last one included).
            sent_s = self._arrival_s[rid] - access_ms / 2000
            self._push(max(self.now_s, sent_s + res.e2e_ms / 1000), _SLOT, rid)
        del self._link_of[rid], self._last_emit_s[rid]
        if (conn := self._conn_of.pop(rid, None)) is not None:
            self._conns_busy[conn] -= 1
        _close_ok(self._router_of.pop(rid), res, at_door_ms)
        if self.hook is not None:
            self.hook(res, self.router)


def _llm(r: TraceRequest, max_tokens: int | None) -> LlmRequest:
    """The trace row's request as the router reads it (its max_tokens as the protocol says)."""
    return LlmRequest(COMPLETIONS, ("",), (r.input_tokens,), max_tokens, True, r.model, None)


def _close_ok(router: Router, res: RequestResult, at_door_ms: float) -> None:
    """The request completed at its door: its cached and output tokens as its engine had
    them (the engine reports the first; the count generated is known to the client)."""
    rec = router.in_flight.get(res.id)
    if rec is not None:
        rec.generated_tokens = res.output_tokens
    router.close(res.id, Status.OK, at_door_ms, cached_tokens=res.cached_tokens)


def simulate(
    trace: Sequence[TraceRequest],
    settings: SimSettings,
    hook: CompletionHook | None = None,
    progress: ProgressHook | None = None,
) -> SimResult:
    return Simulation(trace, settings, hook, progress).run()
