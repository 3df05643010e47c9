"""The routing core: let the policy choose among the candidates with the router's weights,
record the dispatch, and close every request through one path.

Pure and synchronous with an injected clock: the live service and the offline simulator
build it with the same factory (`core.build.build_router`) and drive the very same
object. Its surface is its public methods and properties: the fleet's records are read
through `backends` (read-only) and changed only by the methods here. What learns from
outcomes subscribes to the lifecycle events (`core.events`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from ext_proc.config.schema import Config
from ext_proc.core import views
from ext_proc.core.admission import context_refusal, fleet_models, model_refusal, served_name
from ext_proc.core.backend import BackendState
from ext_proc.core.decision_log import DecisionLog
from ext_proc.core.features import (
    Features,
    first_byte_deadline_ms,
    output_tokens,
    pace_ms,
    prefix_state_for,
)
from ext_proc.core.fleet import Fleet
from ext_proc.core.inputs import RouterInputs
from ext_proc.estimate.prefix import Hashes
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.errors import RATE_LIMITED
from ext_proc.vocab.events import BackendChanged, Closed, Dispatched, FirstByte, Listener
from ext_proc.vocab.policy import Policy
from ext_proc.vocab.types import (
    Candidate,
    Decision,
    InFlight,
    PrefixState,
    Refusal,
    RouteRequest,
    Status,
    Weights,
)

log = logging.getLogger("gorgo.router")


# Whether a candidate backend has room for the request (flow control: flow.room).
RoomCheck = Callable[[Candidate], bool]


@dataclass(frozen=True)
class NoRoom:
    """The backend the policy chose had no room (flow control): nothing was recorded."""

    # The least TTFT predicted among the candidates, from now (what it would see at best).
    best_ttft_ms: float
    # The backend the policy chose: the one it waits for.
    backend_id: str = ""


class Router:
    """Decides where each request goes and closes it, whatever ends it (the request's
    lifecycle); its fleet (`fleet`: backends added, drained, removed) and what it hears
    from outside (`inputs`) are objects of their own."""

    __slots__ = (
        "_decisions",
        "_features",
        "_fleet",
        "_listeners",
        "_log",
        "_policy",
        "_tuner",
        "_weights",
        "clock",
        "inputs",
    )

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
        self.clock = clock
        self._policy = policy
        self._tuner = tuner
        self._weights = weights
        self._fleet = Fleet(cfg, clock, self._emit)
        self.inputs = RouterInputs(self._fleet, clock)
        self._features = Features(self._fleet, clock)
        self._decisions = 0
        self._log = DecisionLog(cfg.telemetry.recent_decisions)
        # Who hears each event, in order: its own decision log, then what subscribes (the
        # learners first: core.build.build_router).
        self._listeners: list[Listener] = [self._log]

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # -- what it shows ------------------------------------------------------------------

    @property
    def cfg(self) -> Config:
        """The config in force (its backends and live keys change at run time)."""
        return self._fleet.cfg

    @property
    def fleet(self) -> Fleet:
        """The fleet's changes: backends added, activated, drained, updated, reconciled
        with a config (core.fleet)."""
        return self._fleet

    @property
    def features(self) -> Features:
        """What each candidate would cost a request (core.features): its prompt's
        blocks, the candidates with their terms, a backend's queue estimate."""
        return self._features

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def tuner(self) -> Tuner | None:
        return self._tuner

    @property
    def weights(self) -> Weights | None:
        """The weights serving traffic now (the tuner's parent when tuning)."""
        return self._tuner.weights if self._tuner is not None else self._weights

    @property
    def decisions(self) -> int:
        return self._decisions

    @property
    def recent(self) -> DecisionLog:
        """The last decisions made (telemetry.recent_decisions of them)."""
        return self._log

    @property
    def backends(self) -> Mapping[str, BackendState]:
        """Every backend's record (pending, active, draining), read-only."""
        return MappingProxyType(self._fleet.state.backends)

    @property
    def in_flight(self) -> Mapping[str, InFlight]:
        """This router's requests in flight, in dispatch order, read-only."""
        return MappingProxyType(self._fleet.state.in_flight)

    @property
    def peer_in_flight(self) -> Mapping[str, InFlight]:
        """Other routers' requests in flight, as their dispatches told us."""
        return MappingProxyType(self._fleet.state.peer_in_flight)

    def snapshot(self, decisions: bool = True) -> dict[str, Any]:
        """/state; `decisions=False` leaves out the recent decisions (the page's poll)."""
        return views.snapshot(
            self._features,
            self._policy.name,
            self.weights,
            self._tuner,
            self._decisions,
            self._log if decisions else None,
        )

    # -- deciding -----------------------------------------------------------------------

    def served_models(self) -> dict[str, str | None] | None:
        """The fleet's models, name -> parent (core.admission.fleet_models)."""
        return fleet_models(self._fleet.state, self.cfg.models)

    def served_name(self, model: str | None, key: str) -> str | None:
        """The served name a request for `model` goes as (an alias resolved by `key`)."""
        return served_name(self.cfg.models, model, key)

    def admit(self, request: RouteRequest) -> Refusal | None:
        """The admission step before a decision (None: admitted): a model no backend
        serves, none named when several are, none of whose backends is in rotation, a
        prompt no backend's context holds (core.admission); with shedding on, every
        backend's queue estimate past the bound (429)."""
        model = request.llm.model if request.llm else None
        state = self._fleet.state
        refused = model_refusal(state, model, self.clock()) or context_refusal(state, request.llm)
        if refused is not None:
            return refused
        bound_ms = self.cfg.routing.shed_queue_ms
        if not bound_ms:
            return None
        least_ms = self._features.least_queue_ms(request)
        if least_ms <= bound_ms:
            return None
        return Refusal(RATE_LIMITED, "all backends overloaded, retry later", least_ms / 1000)

    def decide(self, request: RouteRequest) -> Decision:
        """Choose a backend and record the dispatch."""
        return self.place(request)  # type: ignore[return-value]  # no room check: placed

    def place(
        self,
        request: RouteRequest,
        room: RoomCheck | None = None,
        waited_ms: float = 0.0,
        queued_behind: int = 0,
    ) -> Decision | NoRoom:
        """Choose a backend; record the dispatch if it has `room` (None: always), else NoRoom
        (flow control waits). `waited_ms`: its gateway queue wait (in its TTFT and E2E)."""
        blocks = self._features.prompt_blocks(request)
        candidates = self._features.candidates(request, blocks)
        bt = self.cfg.routing.block_tokens
        arm = None
        weights = self._weights
        if self._tuner is not None:  # the tuner's arm for this request sets the weights
            arm = self._tuner.arm_for(request.request_id, request.session_key)
            weights = self._tuner.weights_for(request.request_id, request.session_key)
        choice = self._policy.choose(request, candidates, weights)
        chosen = next((c for c in candidates if c.backend_id == choice.backend_id), None)
        if chosen is None:
            raise ValueError(
                f"policy {self._policy.name!r} chose {choice.backend_id!r}, not a candidate"
            )
        if room is not None and not room(chosen):
            # late binding: it goes where the policy wants it, once that backend has room
            return NoRoom(min(c.predicted_ttft_ms for c in candidates), chosen.backend_id)
        if request.request_id in self._fleet.state.in_flight:  # reused: the older is lost
            self.close(request.request_id, Status.LOST, reason="request id reused")
        now_s = self.clock()
        b = self._fleet.state.backends[chosen.backend_id]
        state = prefix_state_for(b, request)
        if state is PrefixState.WARMING and b.engine.blocks is not None:
            # judged at its close: would a precise prediction have been right?
            b.engine.blocks.expect(request.request_id, self._features.precise_cached.get(b.id, 0))
        rec = in_flight_record(request, chosen, b, blocks, state, now_s, bt, self._features)
        self._fleet.state.dispatch(rec)
        decision = Decision(
            request_id=request.request_id,
            backend=chosen.backend_id,
            policy=self._policy.name,
            input_tokens=rec.input_tokens,
            candidates=candidates,
            scores=choice.scores,
            weights=weights,
            arm=arm,
            draining=self._fleet.draining,
            model=rec.model,
            hold_ms=pace_ms(self.cfg.routing, b, chosen, now_s),
            waited_ms=waited_ms,
            queued_behind=queued_behind,
            first_byte_deadline_ms=first_byte_deadline_ms(
                self.cfg.routing, chosen, rec.streaming, self.cfg.envoy.route_timeout_s
            ),
            engine_priority=engine_priority(b, request),
        )
        _stamp(rec, decision, now_s)
        self._decisions += 1
        self._log.add(decision, now_s)
        event = Dispatched(request, decision, rec, now_s)
        for listener in self._listeners:
            listener.on_dispatch(event)
        return decision

    # -- a request's lifecycle ------------------------------------------------------------

    def first_byte(self, request_id: str) -> FirstByte | None:
        """The first response byte reached the proxy (None: not in flight, or seen)."""
        now_s = self.clock()
        seen = self._fleet.state.first_byte(request_id, now_s)
        if seen is None:
            return None
        self._features.sees_first_bytes = True
        ttft_ms, rec = seen
        event = FirstByte(request_id, rec.served_by or rec.backend, ttft_ms, now_s)
        for listener in self._listeners:
            listener.on_first_byte(event)
        return event

    def response_ended(self, request_id: str, e2e_ms: float | None) -> bool:
        """Envoy says a streamed response ended (e2e_ms) before its first byte was seen:
        the first byte came no later. Returns whether the request waits for that first
        byte (True: close it a moment later), False if there is nothing to wait for."""
        rec = self._fleet.state.in_flight.get(request_id)
        if rec is None or not rec.streaming or rec.first_byte_s is not None:
            return False
        rec.ended_e2e_ms = e2e_ms
        return True

    def close(
        self,
        request_id: str,
        status: Status,
        e2e_ms: float | None = None,
        cached_tokens: int | None = None,
        served_by: str | None = None,
        reason: str = "",
    ) -> Closed | None:
        """The one way a request ends, however it ends; idempotent (a second call returns
        None). served_by: the backend that answered, if known (or `inputs.served_by`): if
        not the chosen one (Envoy retried a connect failure elsewhere), it failed over.
        `reason`: what ended it, for the log and /state."""
        now_s = self.clock()
        state = self._fleet.state
        served_ok = status == Status.OK
        served_by = state.served_elsewhere(request_id, served_by)
        if served_by is not None:
            status = Status.FAILED_OVER
        closed = state.close(request_id, now_s, status, e2e_ms, reason, served_ok)
        if closed is None:
            return None
        rec, measured_e2e_ms = closed
        ttft_ms = None if rec.first_byte_s is None else (rec.first_byte_s - rec.arrived_s) * 1e3
        event = Closed(
            request_id=request_id,
            backend=rec.backend,
            status=status,
            ttft_ms=ttft_ms,
            e2e_ms=measured_e2e_ms,
            record=rec,
            now_s=now_s,
            served_by=served_by if served_by in state.backends else None,
            cached_tokens=cached_tokens,
            reason=reason,
            served_ok=served_ok and served_by in state.backends,
        )
        for listener in self._listeners:
            listener.on_close(event)
        self._fleet.remove_if_drained(rec.backend)  # draining: its last request may have closed
        return event

    def expire(self) -> list[Closed]:
        """Close the requests whose completion never arrived by their deadline
        (core.state.lost_after_s)."""
        now_s = self.clock()
        state = self._fleet.state
        for r in state.missed_first_byte(now_s):
            log.warning(
                "backend %s suspect: no first byte of %s by its deadline", r.backend, r.request_id
            )
        state.expire_peers(now_s, self.cfg.fleet.peer_ttl_s)
        overdue = state.overdue(now_s, self.cfg.request_timeout_s)
        closed = [c for rid in overdue if (c := self.close(rid, Status.EXPIRED)) is not None]
        for backend in self._fleet.draining:  # any left by a record that went without a close
            self._fleet.remove_if_drained(backend)
        return closed

    def lose(self, envoys: set[str]) -> list[Closed]:
        """The Envoys named went away (their access-log streams ended): the requests they
        carried will never be reported. Close them as lost, now."""
        gone = [r.request_id for r in self._fleet.state.in_flight.values() if r.envoy in envoys]
        return [c for rid in gone if (c := self.close(rid, Status.LOST, reason="envoy gone"))]

    def _emit(self, e: BackendChanged) -> None:
        for listener in self._listeners:
            listener.on_backend(e)


def in_flight_record(
    request: RouteRequest,
    chosen: Candidate,
    b: BackendState,
    blocks: list[Hashes],
    state: PrefixState,
    now_s: float,
    block_tokens: int,
    features: Features | None = None,
) -> InFlight:
    """What the router keeps of a request it sends to `chosen` (to learn from its end);
    `features`: the candidates' computer, whose replay there it keeps (ttft_model)."""
    replay = features.replays.get(b.id) if features is not None else None
    # The engine reports one cached count per request: it says which blocks it lost only
    # for a single prompt.
    held = blocks[0][: chosen.cached_tokens // block_tokens] if len(blocks) == 1 else None
    model = request.llm.model if request.llm else None
    speed = b.speed_for(model)
    return InFlight(
        request_id=request.request_id,
        backend=chosen.backend_id,
        dispatched_s=now_s,
        input_tokens=chosen.cached_tokens + chosen.uncached_tokens,
        output_tokens=output_tokens(request),
        cached_tokens=chosen.cached_tokens,
        prefix_state=state,
        prefill_ms=chosen.prefill_ms,
        rtt_ms=chosen.rtt_ms,
        queue_ms=chosen.wait_ms,
        predicted_ttft_ms=chosen.predicted_ttft_ms,
        predicted_e2e_ms=chosen.predicted_e2e_ms,
        expected_output_tokens=chosen.expected_output_tokens,
        max_output_tokens=request.llm.max_output_tokens if request.llm else None,
        objective=request.objective,
        tenant=request.tenant,
        session=request.session_key,
        decode_calibration=chosen.decode_calibration,
        prefill_factor=speed.prefill_factor,
        decode_factor=speed.decode_factor,
        model=model,
        blocks=np.concatenate(blocks) if blocks else None,
        matched_last_used_s=None if held is None else b.prefix.last_used_s(held),
        streaming=request.llm.stream if request.llm else True,
        envoy=request.envoy,
        priority=request.priority,
        replay_features=None if replay is None else replay.features,
        replay_credit_ms=0.0 if replay is None else replay.credit_ms,
    )


def engine_priority(b: BackendState, request: RouteRequest) -> int | None:
    """The `priority` to write into the request's body for b's engine (None: nothing to
    write: feeds.server_info.PriorityWriting.to_write)."""
    client = request.llm.priority if request.llm else None
    return b.priority.to_write(request.priority, client)


def _stamp(rec: InFlight, decision: Decision, now_s: float) -> None:
    """What the in-flight record keeps of its decision: the pacing hold, the wait in the
    gateway queue, and when its first byte is due."""
    rec.hold_ms = decision.hold_ms
    rec.waited_ms = decision.waited_ms
    if decision.first_byte_deadline_ms is not None:
        rec.first_byte_deadline_s = (
            now_s + (decision.hold_ms + decision.first_byte_deadline_ms) / 1000
        )
