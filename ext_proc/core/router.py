"""The routing core: compute each backend's features, let the policy choose with the
router's weights, record the dispatch, and close every request through one path.

Pure and synchronous with an injected clock: the live service and the offline simulator
build it with the same factory (`build_router`) and drive the very same object. What
learns from outcomes subscribes to the lifecycle events (`ext_proc.lifecycle`).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ext_proc.config.dump import backend_as_dict
from ext_proc.config.schema import Backend, Config, TunerMode
from ext_proc.core.events import BackendChanged, Closed, Dispatched, FirstByte, Listener
from ext_proc.core.state import BackendState, FleetState
from ext_proc.core.types import (
    BackendChange,
    BackendLifecycle,
    Candidate,
    Decision,
    InFlight,
    PrefixState,
    RouteRequest,
    Shed,
    Status,
    Weights,
)
from ext_proc.estimate.cost import (
    KV_HEADROOM_MARGIN,
    PrefillModel,
    QueueItem,
    decode_stall_ms,
    estimate_queue_ms,
    kv_headroom_ms,
)
from ext_proc.estimate.engine_index import Applied, EngineBlocks, chain_keys
from ext_proc.estimate.prediction import PredictionStats
from ext_proc.estimate.prefix import Hashes, PrefixIndex, as_hashes
from ext_proc.estimate.profile import EngineProfile, load_profile
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.kv_events import EventBatch
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.learn.learners import Ejector, PrefillLearner, PrefixLearner, TunerLearner
from ext_proc.learn.tuner import StateSink, Tuner, TunerSettings, TunerState
from ext_proc.policy.base import Policy, PolicyInfo
from ext_proc.policy.catalog import make_policy, policy_info, policy_params
from ext_proc.prompt.tokens import APPROX, block_hashes_of_ids

# How many recent decisions /state shows.
RECENT_DECISIONS = 8
# How many removed backends /state and the lifecycle metric still show.
RECENT_REMOVED = 16
# Output budget assumed when a request names no max tokens (KV and decode estimates).
DEFAULT_OUTPUT_TOKENS = 256
_ACTIVE = BackendLifecycle.ACTIVE
_PENDING = BackendLifecycle.PENDING
_DRAINING = BackendLifecycle.DRAINING


class UnknownBackend(LookupError):
    """No backend with that id (pending, active or draining)."""


class NoActiveBackend(RuntimeError):
    """Every backend is pending or draining (a fleet replaced whole, for the moment Envoy
    takes to learn the new clusters): the request takes Envoy's fallback route."""


class FleetConflict(ValueError):
    """The change cannot be made: the id exists, or it would leave no active backend."""


@dataclass(frozen=True)
class FleetChanges:
    """What `Router.reconcile` did, by backend id."""

    added: tuple[str, ...] = ()
    reactivated: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.reactivated or self.updated or self.draining)


# Keys a reload applies live: read from `Router.cfg` at each use, by nothing else.
LIVE_KEYS = (
    "routing.shed_queue_ms",
    "routing.stall_grace_ms",
    "routing.optimistic_ttl_s",
    "routing.unreadable_body",
    "routing.pace_sigmas",
    "routing.pace_max_ms",
)

# A backend's fields that say which engine it is and how the router reaches it: changed
# in place, what the router knew of the old engine is forgotten (`Router.update_backend`).
IDENTITY_FIELDS = ("address", "engine", "kv_events")


class Router:
    def __init__(
        self,
        cfg: Config,
        clock: Callable[[], float],
        policy: Policy,
        weights: Weights | None = None,
        tuner: Tuner | None = None,
    ) -> None:
        """`weights`: the starting cost weights of a weighted policy (None for the
        others); `tuner`: moves them online (only with weights)."""
        if tuner is not None and weights is None:
            raise ValueError(f"policy {policy.name!r} has no weights to tune")
        self.cfg = cfg
        self.clock = clock
        self.policy = policy
        self.tuner = tuner
        self._weights = weights
        # Every per-backend structure is filled by _attach (here, and for a backend added
        # at run time) and emptied by _detach (ext_proc.router: the fleet section).
        self.state = FleetState(())
        self.profiles: dict[str, EngineProfile] = {}
        self.prefill: dict[str, PrefillModel] = {}
        self.index = PrefixIndex({}, cfg.routing.block_tokens)
        self.decisions = 0
        self.recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)
        self.sees_first_bytes = False
        # Backends whose engine publishes KV events: what it reports holding, and whether
        # that stream is up now (the shell says so; down, the router's own estimate serves).
        self.engine_blocks: dict[str, EngineBlocks] = {}
        self.precise: set[str] = set()
        # The backends' configs (pending, active, draining) and the backends removed lately
        # (for /state and the lifecycle metric).
        self.configs: dict[str, Backend] = {}
        self.removed: deque[dict[str, Any]] = deque(maxlen=RECENT_REMOVED)
        # Set by a shell that tells Envoy of new backends: they start pending, and the
        # shell activates them once Envoy can route to them (False: active at once).
        self.confirm_new_backends = False
        for b in cfg.backends:
            self._attach(b, clock())
        # How far the cached-token predictions were from the engines' reports.
        self.prediction = PredictionStats()
        # The learners, in the order they hear each event; more can subscribe.
        self.listeners: list[Listener] = [
            PrefixLearner(self.index, cfg.routing.block_tokens),
            PrefillLearner(self.prefill),
            Ejector(self.state, cfg.routing),
            self.prediction,
        ]
        if tuner is not None:
            self.listeners.append(TunerLearner(tuner, cfg.request_timeout_s * 1000, self.profiles))

    def subscribe(self, listener: Listener) -> None:
        self.listeners.append(listener)

    @property
    def weights(self) -> Weights | None:
        """The weights serving traffic now (the tuner's parent when tuning)."""
        return self.tuner.weights if self.tuner is not None else self._weights

    # -- features -----------------------------------------------------------------------

    def prompt_blocks(self, request: RouteRequest) -> list[Hashes]:
        """Each prompt's prefix-block hashes (one list per prompt of a batch)."""
        if request.blocks is not None:
            return [as_hashes(list(request.blocks))]
        if request.llm is None:
            return []
        bt = self.cfg.routing.block_tokens
        return [
            as_hashes(
                block_hashes_of_ids(p, bt) if isinstance(p, tuple) else APPROX.block_hashes(p, bt)
            )
            for p in request.llm.prompts
        ]

    def output_tokens(self, request: RouteRequest) -> int:
        """The request's output budget (its max tokens), else a typical chat answer."""
        llm = request.llm
        return llm.max_output_tokens if llm and llm.max_output_tokens else DEFAULT_OUTPUT_TOKENS

    def _kv_tokens(self, request: RouteRequest) -> int:
        """KV the request will hold: its prompt and its output budget."""
        return (request.llm.input_tokens if request.llm else 0) + self.output_tokens(request)

    def _precise_cached(
        self,
        backend: str,
        keys_of: Callable[[int], list[list[int]]],
        blocks: list[Hashes],
        now_s: float,
    ) -> list[float]:
        """Per prompt, the tokens the engine's own events say it holds, or that this router
        sent there within optimistic_ttl_s (not yet confirmed by an event)."""
        engine = self.engine_blocks[backend]
        since_s = now_s - self.cfg.routing.optimistic_ttl_s
        out = []
        for keys, prompt_blocks in zip(
            keys_of(engine.block_size or self.cfg.routing.block_tokens), blocks, strict=False
        ):
            reported = engine.cached_tokens(keys)
            recent = self.index.last_used_s(backend, prompt_blocks)
            optimistic = _leading(recent >= since_s) * self.cfg.routing.block_tokens
            out.append(max(reported, optimistic))
        return out

    def _precise_for(self, backend: str, request: RouteRequest) -> bool:
        """The backend's prediction comes from its engine's events (they are up, and the
        request is matched by token ids, not by a simulator's own block hashes alone)."""
        return backend in self.precise and (
            request.blocks is None or request.engine_keys is not None
        )

    @staticmethod
    def _keys_by_block_size(request: RouteRequest) -> Callable[[int], list[list[int]]]:
        """Each prompt's chain keys at a block size, tokenized and chained once per
        decision whatever the number of backends."""
        prompts = request.llm.prompts if request.llm else ()
        ids: list[Sequence[int]] = []
        cache: dict[int, list[list[int]]] = {}

        def keys_of(block_size: int) -> list[list[int]]:
            if request.engine_keys is not None:
                return [list(request.engine_keys)]
            if not ids:
                ids.extend(p if isinstance(p, tuple) else APPROX.ids(p) for p in prompts)
            if block_size not in cache:
                cache[block_size] = [chain_keys(p, block_size) for p in ids]
            return cache[block_size]

        return keys_of

    def candidates(self, request: RouteRequest, blocks: list[Hashes]) -> tuple[Candidate, ...]:
        now_s = self.clock()
        lengths = request.llm.prompt_tokens if request.llm else ()
        input_tokens = sum(lengths)
        need_kv = self._kv_tokens(request)
        matched = [self.index.match(prompt) for prompt in blocks]
        bt = self.cfg.routing.block_tokens
        active = [b for b in self.state.backends.values() if b.lifecycle is _ACTIVE]
        if not active:
            raise NoActiveBackend("no active backend")
        healthy = [b for b in active if self.state.available(b, now_s)]
        keys_of = self._keys_by_block_size(request)
        out = []
        for b in healthy or active:  # all suspect: try them all (never a draining one)
            if self._precise_for(b.id, request):
                per_prompt = self._precise_cached(b.id, keys_of, blocks, now_s)
            else:
                per_prompt = [m[b.id] * bt for m in matched]
            # Each prompt's own leading match; at least one token of each is computed.
            cached = sum(
                min(int(c), max(0, n - 1)) for c, n in zip(per_prompt, lengths, strict=False)
            )
            uncached = input_tokens - cached
            prefill_ms = self.prefill[b.id].prefill_ms(uncached, cached)
            items, step_ms = self._queue_items(b.id)
            queue_ms = self._queue_ms(b.id, now_s, need_kv, items, step_ms)
            out.append(
                Candidate(
                    backend_id=b.id,
                    in_flight=b.in_flight,
                    waiting_first_byte=b.waiting_first_byte,
                    in_flight_tokens=b.in_flight_tokens,
                    rtt_ms=b.rtt_ms,
                    queue_ms=queue_ms,
                    prefill_ms=prefill_ms,
                    cached_tokens=cached,
                    uncached_tokens=uncached,
                    decode_stall_ms=decode_stall_ms(prefill_ms, b.in_flight),
                    kv_ms=kv_headroom_ms(
                        items,
                        step_ms,
                        now_s,
                        self._kv_capacity_tokens(b.id),
                        need_kv,
                        KV_HEADROOM_MARGIN,
                        queue_ms,
                    ),
                )
            )
        return tuple(out)

    def _kv_capacity_tokens(self, backend: str) -> int:
        return self.index.capacity_blocks[backend] * self.cfg.routing.block_tokens

    def _queue_items(self, backend: str) -> tuple[list[QueueItem], float]:
        """The backend's requests in flight as the queue and KV estimates see them, and its
        decode step now."""
        b = self.state.backends[backend]
        items = [
            QueueItem(
                r.prefill_ms,
                r.input_tokens + r.output_tokens,
                r.output_tokens,
                r.dispatched_s,
                r.first_byte_s,
                # Due: when its first token should have come. Only a streamed response
                # shows its first token; a non-streamed one answers at the end.
                r.dispatched_s + (r.rtt_ms + r.queue_ms + r.prefill_ms) / 1000
                if r.streaming
                else None,
            )
            for r in b.records.values()
        ]
        decoding = [r for r in b.records.values() if r.first_byte_s is not None]
        step_ms = self.profiles[backend].decode_ms(
            len(decoding), sum(r.input_tokens for r in decoding)
        )
        return items, step_ms

    def queue_estimate_ms(self, backend: str, now_s: float, need_kv_tokens: int = 0) -> float:
        """How long a new request needing need_kv_tokens of KV would wait on `backend`
        before its own prefill starts."""
        items, step_ms = self._queue_items(backend)
        return self._queue_ms(backend, now_s, need_kv_tokens, items, step_ms)

    def _queue_ms(
        self,
        backend: str,
        now_s: float,
        need_kv_tokens: int,
        items: list[QueueItem],
        step_ms: float,
    ) -> float:
        b = self.state.backends[backend]
        capacity = self._kv_capacity_tokens(backend)
        # No first byte ever seen means none is observed (an Envoy without the observing
        # filter): lateness would then be noise.
        grace_ms = self.cfg.routing.stall_grace_ms if self.sees_first_bytes else 0.0
        own_ms = estimate_queue_ms(
            items, step_ms, now_s, b.rtt_ms / 2, capacity, need_kv_tokens, grace_ms
        )
        report = self.fresh_engine_report(backend, now_s)
        if report is not None and report.waiting is not None and b.engine_at_s is not None:
            # The engine's own count of requests waiting (load this router did not route:
            # other routers, direct clients), priced at the mean prefill of what we sent
            # there lately, plus what this router sent there since that report.
            since = sum(
                r.prefill_ms
                for r in b.records.values()
                if r.dispatched_s > b.engine_at_s and r.first_byte_s is None
            )
            own_ms = max(own_ms, report.waiting * b.mean_prefill_ms + since)
        return own_ms

    def fresh_engine_report(self, backend: str, now_s: float) -> EngineReport | None:
        """The engine's last load report, unless older than probes.metrics_stale_s."""
        b = self.state.backends[backend]
        if b.engine_at_s is None or now_s - b.engine_at_s > self.cfg.probes.metrics_stale_s:
            return None
        return b.engine

    # -- admission and decisions --------------------------------------------------------

    def admit(self, request: RouteRequest) -> Shed | None:
        """The admission step before a decision. With shedding on, a request is refused
        when every backend's queue estimate is past the bound (None: admitted)."""
        bound_ms = self.cfg.routing.shed_queue_ms
        if not bound_ms:
            return None
        now_s = self.clock()
        need = self._kv_tokens(request)
        least_ms = min(
            (
                self.queue_estimate_ms(b.id, now_s, need)
                for b in self.state.backends.values()
                if b.lifecycle is _ACTIVE
            ),
            default=0.0,
        )
        return Shed(least_ms / 1000) if least_ms > bound_ms else None

    def decide(self, request: RouteRequest) -> Decision:
        """Choose a backend and record the dispatch."""
        blocks = self.prompt_blocks(request)
        candidates = self.candidates(request, blocks)
        bt = self.cfg.routing.block_tokens
        arm = None
        weights = self._weights
        if self.tuner is not None:  # the tuner's arm for this request sets the weights
            arm = self.tuner.arm_for(request.request_id, request.session_key)
            weights = self.tuner.weights_for(request.request_id, request.session_key)
        choice = self.policy.choose(request, candidates, weights)
        chosen = next((c for c in candidates if c.backend_id == choice.backend_id), None)
        if chosen is None:
            raise ValueError(
                f"policy {self.policy.name!r} chose {choice.backend_id!r}, not a candidate"
            )
        now_s = self.clock()
        # The engine reports one cached count per request: it says which blocks it lost
        # only for a single prompt.
        held = blocks[0][: chosen.cached_tokens // bt] if len(blocks) == 1 else None
        rec = InFlight(
            request_id=request.request_id,
            backend=chosen.backend_id,
            dispatched_s=now_s,
            input_tokens=chosen.cached_tokens + chosen.uncached_tokens,
            output_tokens=self.output_tokens(request),
            cached_tokens=chosen.cached_tokens,
            prefix_state=PrefixState.PRECISE
            if self._precise_for(chosen.backend_id, request)
            else PrefixState.APPROXIMATE,
            prefill_ms=chosen.prefill_ms,
            rtt_ms=chosen.rtt_ms,
            queue_ms=chosen.queue_ms,
            blocks=np.concatenate(blocks) if blocks else None,
            matched_last_used_s=None
            if held is None
            else self.index.last_used_s(chosen.backend_id, held),
            streaming=request.llm.stream if request.llm else True,
        )
        self.state.dispatch(rec)
        hold_ms = self._pace(chosen, now_s)
        decision = Decision(
            request.request_id,
            chosen.backend_id,
            self.policy.name,
            rec.input_tokens,
            candidates,
            choice.scores,
            weights,
            arm,
            self.draining,
            hold_ms,
        )
        self.decisions += 1
        self.recent.append(decision)
        event = Dispatched(request, decision, rec, now_s)
        for listener in self.listeners:
            listener.on_dispatch(event)
        return decision

    def _pace(self, chosen: Candidate, now_s: float) -> float:
        """Dispatch pacing: how long to hold a request before it is sent on (ms).

        Requests sent to one backend within the WAN's jitter of each other reach the
        engine in an order the jitter picks, while the queue estimate (and so every
        decision made since) counts each one behind those routed before it; under bursts
        that unpredicted overtaking made most of the TTFT tail (docs/cost-model.md). So a
        request is held until `routing.pace_sigmas` probe-RTT standard deviations after
        the previous one sent there; never longer than the queue it is predicted to meet on
        arrival (a held request loses nothing it would not have waited: on arrival-spread
        traffic a cap at the queue owed now held requests past it and cost p95 E2E), nor
        than `routing.pace_max_ms` (Envoy waits for the decision within its message
        timeout).
        """
        r = self.cfg.routing
        b = self.state.backends[chosen.backend_id]
        hold_ms = 0.0
        if r.pace_sigmas:
            due_ms = (b.sent_s - now_s) * 1000 + r.pace_sigmas * math.sqrt(b.rtt_var_ms2)
            # The queue it meets on arrival: what is owed there now, less what the engine
            # gets through while the request travels.
            wait_ms = chosen.queue_ms - b.rtt_ms / 2
            hold_ms = min(max(0.0, due_ms), max(0.0, wait_ms), r.pace_max_ms)
        b.sent_s = now_s + hold_ms / 1000
        return hold_ms

    # -- the lifecycle ------------------------------------------------------------------

    def first_byte(self, request_id: str) -> FirstByte | None:
        """The first response byte reached the proxy (None: not in flight, or seen)."""
        now_s = self.clock()
        seen = self.state.first_byte(request_id, now_s)
        if seen is None:
            return None
        self.sees_first_bytes = True
        ttft_ms, rec = seen
        event = FirstByte(request_id, rec.backend, ttft_ms, now_s)
        for listener in self.listeners:
            listener.on_first_byte(event)
        return event

    def close(
        self,
        request_id: str,
        status: Status,
        e2e_ms: float | None = None,
        cached_tokens: int | None = None,
        served_by: str | None = None,
    ) -> Closed | None:
        """The one way a request ends, however it ends; idempotent (a second call returns
        None). served_by: the backend that answered, when known: if it is not the chosen
        one (Envoy retried a connect failure elsewhere), the request failed over."""
        now_s = self.clock()
        pending = self.state.in_flight.get(request_id)
        if pending is not None and served_by and served_by != pending.backend:
            status = Status.FAILED_OVER
        else:
            served_by = None
        closed = self.state.close(request_id, now_s, status, e2e_ms)
        if closed is None:
            return None
        rec, measured_e2e_ms = closed
        ttft_ms = None if rec.first_byte_s is None else (rec.first_byte_s - rec.dispatched_s) * 1e3
        event = Closed(
            request_id,
            rec.backend,
            status,
            ttft_ms,
            measured_e2e_ms,
            rec,
            now_s,
            served_by if served_by in self.state.backends else None,
            cached_tokens,
        )
        for listener in self.listeners:
            listener.on_close(event)
        self._remove_if_drained(rec.backend)  # draining: its last request may have closed
        return event

    def expire(self) -> list[Closed]:
        """Close the requests whose completion never arrived (request_timeout_s)."""
        now_s = self.clock()
        self.state.expire_peers(now_s, self.cfg.fleet.peer_ttl_s)
        overdue = self.state.overdue(now_s, self.cfg.request_timeout_s)
        closed = [c for rid in overdue if (c := self.close(rid, Status.EXPIRED)) is not None]
        for backend in self.draining:  # any left by a record that went without a close
            self._remove_if_drained(backend)
        return closed

    # -- the engines' KV events ----------------------------------------------------------

    def apply_kv_events(self, backend: str, batch: EventBatch) -> Applied:
        """One batch from the backend's engine, in order (see EngineBlocks.apply); a
        backend removed meanwhile ignores it."""
        engine = self.engine_blocks.get(backend)
        return Applied() if engine is None else engine.apply(batch)

    def set_event_stream(self, backend: str, up: bool) -> None:
        """The backend's event stream is up (its state is the engine's) or down (the
        router's own estimate serves it until it is back)."""
        if up and backend in self.engine_blocks:
            self.precise.add(backend)
        else:
            self.precise.discard(backend)

    # -- the other routers' dispatches (ext_proc.peers) ---------------------------------

    def apply_peer(self, e: PeerEvent) -> None:
        """Another router's lifecycle event: its requests load our view of the backends
        (queue estimates, in-flight counts) as our own do; nothing learns from them."""
        if e.kind == PeerKind.DISPATCHED:
            self.state.peer_dispatch(
                InFlight(
                    request_id=e.request_id,
                    backend=e.backend,
                    dispatched_s=self.clock(),
                    input_tokens=e.input_tokens,
                    output_tokens=e.output_tokens,
                    cached_tokens=e.cached_tokens,
                    prefill_ms=e.prefill_ms,
                    rtt_ms=e.rtt_ms,
                    queue_ms=e.queue_ms,
                    streaming=e.streaming,
                )
            )
        elif e.kind == PeerKind.FIRST_BYTE:
            self.state.peer_first_byte(e.request_id, self.clock())
        else:
            self.state.peer_close(e.request_id)

    def record_probe(self, backend: str, rtt_ms: float | None) -> None:
        p = self.cfg.probes
        self.state.record_probe(backend, rtt_ms, p.ewma_alpha, p.suspect_after)

    def record_fallback(self, backend: str) -> None:
        self.state.record_fallback(backend)

    # -- the fleet: backends added, drained and removed at run time ---------------------
    #
    # (pending ->) active -> draining -> removed. Pending (`confirm_new_backends`): added,
    # not a candidate until the shell says Envoy can route to it. A draining backend is no
    # candidate of any decision (so no policy, failover list or fallback of the router
    # names it); its requests in flight finish, and the close of its last one (or its
    # expiry) removes it from every per-backend structure. Listeners hear each step
    # (`BackendChanged`): the shell starts and stops the backend's probes and KV-event
    # subscriber and tells Envoy. `cfg.backends` is always the pending, active and draining
    # ones, in the order they came.

    @property
    def draining(self) -> tuple[str, ...]:
        """The draining backends' ids, in the fleet's order."""
        return tuple(b for b, st in self.state.backends.items() if st.lifecycle is _DRAINING)

    def lifecycle(self, backend: str) -> BackendLifecycle:
        b = self.state.backends.get(backend)
        if b is None:
            raise UnknownBackend(backend)
        return b.lifecycle

    def add_backend(self, b: Backend, reason: str = "admin") -> BackendLifecycle:
        """A new backend: active at once, or pending until the shell activates it
        (`confirm_new_backends`). FleetConflict if the id is pending, active or draining."""
        if b.id in self.state.backends:
            raise FleetConflict(f"backend {b.id!r} exists ({self.state.backends[b.id].lifecycle})")
        now_s = self.clock()
        st = self._attach(b, now_s)
        if self.confirm_new_backends:
            st.lifecycle = _PENDING
        self._emit(b.id, BackendChange.ADDED, now_s, reason)
        return st.lifecycle

    def activate_backend(self, backend: str, reason: str = "envoy") -> bool:
        """A pending backend becomes a candidate (Envoy can route to it now). Returns
        whether it was pending (a backend drained or removed meanwhile stays so)."""
        b = self.state.backends.get(backend)
        if b is None or b.lifecycle is not _PENDING:
            return False
        now_s = self.clock()
        b.lifecycle, b.lifecycle_since_s = _ACTIVE, now_s
        self._emit(backend, BackendChange.ACTIVATED, now_s, reason)
        return True

    def drain_backend(self, backend: str, reason: str = "admin") -> BackendLifecycle:
        """No new decisions to `backend`; it is removed once this router's requests in
        flight there have closed (at once if there are none). Returns its lifecycle now.
        Draining a draining backend changes nothing. FleetConflict: it is the last
        backend active or pending (the router would have nowhere to send requests)."""
        b = self.state.backends.get(backend)
        if b is None:
            raise UnknownBackend(backend)
        if b.lifecycle is not _DRAINING:
            if b.lifecycle in (_ACTIVE, _PENDING) and not any(
                o.lifecycle in (_ACTIVE, _PENDING)
                for o in self.state.backends.values()
                if o is not b
            ):
                raise FleetConflict(f"backend {backend!r} is the last active or pending one")
            now_s = self.clock()
            b.lifecycle, b.lifecycle_since_s = _DRAINING, now_s
            self._emit(backend, BackendChange.DRAINING, now_s, reason)
        return BackendLifecycle.REMOVED if self._remove_if_drained(backend) else b.lifecycle

    def reactivate_backend(self, backend: str, reason: str = "reload") -> None:
        """A draining backend back in rotation (a reload named it again)."""
        b = self.state.backends.get(backend)
        if b is None:
            raise UnknownBackend(backend)
        if b.lifecycle is not _DRAINING:
            return
        now_s = self.clock()
        b.lifecycle, b.lifecycle_since_s = _ACTIVE, now_s
        self._emit(backend, BackendChange.REACTIVATED, now_s, reason)

    def update_backend(self, new: Backend, reason: str = "reload") -> bool:
        """New fields for a backend, applied in place: its requests in flight and counters
        stay. The RTT prior, region, engine profile and KV capacity only change estimates.
        A new address, engine kind or KV-event source is another engine (or another way to
        it): what the router knew of the old one (prefix index, KV-event state, RTT samples,
        engine report, health) is forgotten, and the shell restarts the backend's probes and
        subscriber. Returns whether it was such a reset."""
        old = self.configs.get(new.id)
        if old is None:
            raise UnknownBackend(new.id)
        if old == new:
            return False
        b = self.state.backends[new.id]
        reset = any(getattr(old, f) != getattr(new, f) for f in IDENTITY_FIELDS)
        if new.engine_profile != old.engine_profile or reset:
            self.profiles[new.id] = load_profile(new.engine_profile)
            self.prefill[new.id] = PrefillModel(
                self.profiles[new.id], self.cfg.routing.refit_prefill
            )
        capacity = new.kv_capacity_tokens or self.profiles[new.id].kv_capacity_tokens
        if reset:
            self.index.add_backend(new.id, capacity)  # empty again
            self.engine_blocks.pop(new.id, None)
            if new.kv_events.endpoint:
                self.engine_blocks[new.id] = EngineBlocks()
            self.precise.discard(new.id)
            self.prediction.forget(new.id)
            b.rtt_samples = b.probe_failures = b.request_failures = 0
            b.suspect = False
            b.ejected_until_s = b.engine = b.engine_at_s = None
        else:
            self.index.set_capacity(new.id, capacity)
        b.rtt_prior_ms = new.rtt_prior_ms
        if b.rtt_samples == 0:
            b.rtt_ms = new.rtt_prior_ms
        self.configs[new.id] = new
        self._sync_cfg()
        self._emit(new.id, BackendChange.UPDATED, self.clock(), reason, reset)
        return reset

    def reconcile(self, backends: Sequence[Backend], reason: str = "reload") -> FleetChanges:
        """Make the fleet `backends` (a reloaded config's): new ids are added, draining
        ones named again come back, changed ones are updated in place, and active ones not
        named are drained (then removed). Adds come first: a fleet that is replaced whole
        always has an active backend."""
        wanted = {b.id for b in backends}
        added, back, updated = [], [], []
        for b in backends:
            if b.id not in self.state.backends:
                self.add_backend(b, reason)
                added.append(b.id)
                continue
            if self.state.backends[b.id].lifecycle is _DRAINING:
                self.reactivate_backend(b.id, reason)
                back.append(b.id)
            if self.configs[b.id] != b:
                self.update_backend(b, reason)
                updated.append(b.id)
        gone = [
            bid
            for bid, st in self.state.backends.items()
            if bid not in wanted and st.lifecycle is not _DRAINING
        ]
        for bid in gone:
            self.drain_backend(bid, reason)
        return FleetChanges(tuple(added), tuple(back), tuple(updated), tuple(gone))

    def apply_live_keys(self, new: Config) -> list[str]:
        """Take the LIVE_KEYS of a reloaded config; returns those that changed."""
        changed = [
            k
            for k in LIVE_KEYS
            if getattr(self.cfg.routing, k.split(".")[1]) != getattr(new.routing, k.split(".")[1])
        ]
        if changed:
            routing = replace(
                self.cfg.routing,
                **{k.split(".")[1]: getattr(new.routing, k.split(".")[1]) for k in changed},
            )
            self.cfg = replace(self.cfg, routing=routing)
        return changed

    def backends_json(self) -> list[dict[str, Any]]:
        """Each backend with its lifecycle, this router's requests in flight there, and its
        config (GET /backends)."""
        now_s = self.clock()
        return [
            {
                "id": b.id,
                "lifecycle": str(b.lifecycle),
                "lifecycle_age_s": round(now_s - b.lifecycle_since_s, 3),
                "in_flight": self.state.own_in_flight(b.id),
                "peer_in_flight": b.in_flight - self.state.own_in_flight(b.id),
                "config": backend_as_dict(self.configs[b.id]),
            }
            for b in self.state.backends.values()
        ]

    def removed_json(self, now_s: float) -> list[dict[str, Any]]:
        return [
            {
                **{k: v for k, v in r.items() if k != "removed_s"},
                "age_s": round(now_s - r["removed_s"], 3),
            }
            for r in self.removed
        ]

    def _attach(self, b: Backend, now_s: float) -> BackendState:
        """Every per-backend structure of a new backend (undone by _detach)."""
        st = self.state.add(b.id, b.rtt_prior_ms, now_s)
        profile = self.profiles[b.id] = load_profile(b.engine_profile)
        self.prefill[b.id] = PrefillModel(profile, self.cfg.routing.refit_prefill)
        self.index.add_backend(b.id, b.kv_capacity_tokens or profile.kv_capacity_tokens)
        if b.kv_events.endpoint:
            self.engine_blocks[b.id] = EngineBlocks()
        self.configs[b.id] = b
        self._sync_cfg()
        return st

    def _remove_if_drained(self, backend: str) -> bool:
        b = self.state.backends.get(backend)
        if b is None or b.lifecycle is not _DRAINING or self.state.own_in_flight(backend):
            return False
        now_s = self.clock()
        config = self._detach(backend)
        self.removed.append(
            {
                "id": backend,
                "removed_s": now_s,
                "drained_s": round(now_s - b.lifecycle_since_s, 3),
                "completed": b.completed,
                "errors": b.errors,
                "failovers": b.failovers,
            }
        )
        self._emit(backend, BackendChange.REMOVED, now_s, "drained", config=config)
        return True

    def _detach(self, backend: str) -> Backend:
        self.state.remove(backend)
        self.profiles.pop(backend)
        self.prefill.pop(backend)
        self.index.remove_backend(backend)
        self.engine_blocks.pop(backend, None)
        self.precise.discard(backend)
        self.prediction.forget(backend)
        config = self.configs.pop(backend)
        self._sync_cfg()
        return config

    def _sync_cfg(self) -> None:
        self.cfg = replace(self.cfg, backends=tuple(self.configs.values()))

    def _emit(
        self,
        backend: str,
        change: BackendChange,
        now_s: float,
        reason: str,
        reset: bool = False,
        config: Backend | None = None,
    ) -> None:
        b = self.state.backends.get(backend)
        lifecycle = BackendLifecycle.REMOVED if b is None else b.lifecycle
        e = BackendChanged(
            backend, change, lifecycle, config or self.configs[backend], now_s, reason, reset
        )
        for listener in self.listeners:
            listener.on_backend(e)

    def snapshot(self) -> dict[str, Any]:
        now_s = self.clock()
        wall_s = time.time()  # KV event batches carry the engine's wall-clock stamp
        backends = {}
        for b in self.state.backends.values():
            backends[b.id] = {
                **b.as_json(),
                "queue_ms": round(self.queue_estimate_ms(b.id, now_s), 3),
                "cached_tokens": self.index.size_blocks(b.id) * self.cfg.routing.block_tokens,
                # What the engine last said of its load, and how old that is (None: never).
                "engine": None
                if b.engine is None or b.engine_at_s is None
                else {**b.engine.as_json(), "age_s": round(now_s - b.engine_at_s, 3)},
                **self._prefix_state(b.id, wall_s),
                # How far its cached-token predictions were from the engine's reports.
                "prefix_prediction": self.prediction.as_json(b.id),
                "lifecycle_age_s": round(now_s - b.lifecycle_since_s, 3),
            }
        w = self.weights
        return {
            "policy": self.policy.name,
            "weights": None if w is None else {"rtt": w.rtt, "queue": w.queue},
            "tuner": None if self.tuner is None else self.tuner.snapshot(),
            "decisions": self.decisions,
            "in_flight": len(self.state.in_flight),
            "backends": backends,
            "removed_backends": self.removed_json(now_s),
            "recent_decisions": [d.as_json() for d in self.recent],
        }

    def _prefix_state(self, backend: str, wall_s: float) -> dict[str, Any]:
        engine = self.engine_blocks.get(backend)
        state = PrefixState.PRECISE if backend in self.precise else PrefixState.APPROXIMATE
        out: dict[str, Any] = {"prefix_state": str(state)}
        if engine is not None:
            out["kv_events"] = {
                "up": backend in self.precise,
                "blocks": engine.blocks,
                "block_size": engine.block_size,
                "last_seq": engine.last_seq,
                "last_event_ts": engine.last_ts,
                # Seconds since that stamp (an idle engine publishes nothing).
                "age_s": None
                if engine.last_ts is None
                else round(max(0.0, wall_s - engine.last_ts), 3),
                "gaps": engine.gaps,
                "resets": engine.resets,
            }
        return out


def _leading(hit: Any) -> int:
    """How many leading entries of a boolean array are true."""
    return len(hit) if hit.all() else int(np.argmin(hit))


def tuner_settings(cfg: Config, info: PolicyInfo) -> TunerSettings:
    """The tuner's settings for a weighted policy: the paper's bounds in paper mode, else
    the policy's own (or the time form's defaults)."""
    if not info.weighted:
        raise ValueError(f"policy {info.name!r} has no weights to tune")
    bounds = info.params.TUNER_BOUNDS
    if cfg.tuner.mode == TunerMode.PAPER:
        base = TunerSettings.paper()
    elif bounds is not None:
        base = TunerSettings(rtt_bounds=bounds[0], queue_bounds=bounds[1])
    else:
        base = TunerSettings()
    return replace(
        base,
        mode=cfg.tuner.mode,
        arm_size=cfg.tuner.arm_size,
        objective=cfg.tuner.objective,
        arm_key=cfg.tuner.arm_key,
    )


def build_router(
    cfg: Config,
    clock: Callable[[], float],
    rng: random.Random,
    tuner_state: TunerState | None = None,
    tuner_sink: StateSink | None = None,
    listeners: Iterable[Listener] = (),
) -> Router:
    """The one way to build a router, for `gorgo serve` and the simulator alike: the
    policy and the tuner each get an RNG drawn from `rng`, in that order."""
    info = policy_info(cfg.policy)
    params = policy_params(cfg)
    policy = make_policy(cfg.policy, random.Random(rng.random()), params)
    tuner_rng = random.Random(rng.random())
    weights: Weights | None = params.weights if info.weighted else None
    tuner = None
    if weights is not None and cfg.tuner.mode != TunerMode.OFF:
        settings = tuner_settings(cfg, info)
        tuner = Tuner(settings, weights, tuner_rng, tuner_state, tuner_sink)
    router = Router(cfg, clock, policy, weights, tuner)
    for listener in listeners:
        router.subscribe(listener)
    return router
