"""The routing core: let the policy choose among the candidates with the router's weights
and record the dispatch; every request then closes through one path (its base,
core.lifecycle.RequestLifecycle).

Pure and synchronous with an injected clock: the live service and the offline simulator
build it with the same factory (`core.build.build_router`) and drive the very same
object. Its surface is its public methods and properties: the fleet's records are read
through `backends` (read-only) and changed only by the methods here and in its base. What
learns from outcomes subscribes to the lifecycle events (`vocab.events`).
"""

from __future__ import annotations

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
from ext_proc.core.lifecycle import RequestLifecycle
from ext_proc.core.pairs import (
    PairedCandidates,
    disaggregated,
    legs,
    pair_leg,
    paired_candidates,
    picked_pair,
    prefill_leg,
)
from ext_proc.estimate.prefix import Hashes
from ext_proc.estimate.transfer import PairKnobs
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.errors import RATE_LIMITED
from ext_proc.vocab.events import Dispatched
from ext_proc.vocab.policy import Choice, Policy
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

# Whether a candidate backend has room for the request (flow control: flow.room).
RoomCheck = Callable[[Candidate], bool]


@dataclass(frozen=True)
class NoRoom:
    """The backend the policy chose had no room (flow control): nothing was recorded."""

    # The least TTFT predicted among the candidates, from now (what it would see at best).
    best_ttft_ms: float
    # The backend the policy chose: the one it waits for.
    backend_id: str = ""


class Router(RequestLifecycle):
    """Decides where each request goes; closes it, whatever ends it, as a
    `RequestLifecycle`; its fleet (`fleet`: backends added, drained, removed) and what it
    hears from outside (`inputs`) are objects of their own."""

    __slots__ = ("_decisions", "_log", "_pair_tuner", "_policy", "_tuner", "_weights", "inputs")

    def __init__(
        self,
        cfg: Config,
        clock: Callable[[], float],
        policy: Policy,
        weights: Weights | None = None,
        tuner: Tuner | None = None,
        pair_tuner: Tuner | None = None,
    ) -> None:
        """`weights`: the starting cost weights of a weighted policy (None for the
        others); `tuner`: moves them online (only with weights); `pair_tuner`: moves the
        policy's pair knobs online, for the requests of a disaggregated fleet."""
        if tuner is not None and weights is None:
            raise ValueError(f"policy {policy.name!r} has no weights to tune")
        super().__init__(cfg, clock)
        self._policy = policy
        self._tuner = tuner
        self._pair_tuner = pair_tuner
        self._weights = weights
        self.inputs = RouterInputs(self._fleet, clock)
        self._decisions = 0
        self._log = DecisionLog(cfg.telemetry.recent_decisions)
        self.subscribe(self._log)  # it hears each event first

    # -- what it shows ------------------------------------------------------------------

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
    def pair_tuner(self) -> Tuner | None:
        return self._pair_tuner

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

    def snapshot(self, decisions: bool = True) -> dict[str, Any]:
        """/state; `decisions=False` leaves out the recent decisions (the page's poll)."""
        return views.snapshot(
            self._features,
            self._policy.name,
            self.weights,
            self._tuner,
            self._decisions,
            self._log if decisions else None,
            self._pair_tuner,
        )

    # -- deciding -----------------------------------------------------------------------

    def _pair_knobs(self, request: RouteRequest) -> PairKnobs:
        """The knobs for a request on a disaggregated fleet: its arm's, when tuned, else
        the policy's (gorgo's parameters), else none."""
        if self._pair_tuner is not None:
            tuned = self._pair_tuner.values_for(request.request_id, request.session_key)
            return PairKnobs.of(tuned)
        knobs = getattr(self._policy, "pair_knobs", None)
        return knobs if isinstance(knobs, PairKnobs) else PairKnobs()

    def _paired(
        self, request: RouteRequest, candidates: tuple[Candidate, ...]
    ) -> PairedCandidates | None:
        """A disaggregated fleet's candidates (core.pairs); None: no prefill or decode
        engine among them (decided exactly as an aggregated fleet)."""
        backends = self._fleet.state.backends
        if not disaggregated(backends, candidates):
            return None
        state, routing = self._fleet.state, self.cfg.routing
        input_tokens = sum(request.llm.prompt_tokens) if request.llm else 0
        choose_pair = getattr(self._policy, "choose_pair", None)
        if choose_pair is not None:  # a PairPolicy: each leg by its own rule
            decodes, prefills = legs(backends, candidates)
            if decodes:
                pick = choose_pair(request, decodes, prefills)
                return picked_pair(
                    candidates, backends, routing, state.transfer, input_tokens, pick
                )
        return paired_candidates(
            candidates, backends, routing, self._pair_knobs(request), state.transfer, input_tokens
        )

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
        paired = self._paired(request, candidates)
        if paired is not None:  # a disaggregated fleet: decode engines with their pairs
            candidates = paired.candidates
        bt = self.cfg.routing.block_tokens
        arm = None
        weights = self._weights
        if self._tuner is not None:  # the tuner's arm for this request sets the weights
            arm = self._tuner.arm_for(request.request_id, request.session_key)
            weights = self._tuner.weights_for(request.request_id, request.session_key)
        if paired is not None and paired.picked is not None:  # the PairPolicy's pick
            choice = Choice(paired.picked, {})
        else:
            choice = self._policy.choose(request, candidates, weights)
        if paired is not None:  # a remote prefill must win by the policy's margin
            choice = paired.with_margin(choice)
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
        rec = in_flight_record(request, chosen, b, blocks, state, now_s, bt)
        pair = paired.pairs.get(chosen.backend_id) if paired is not None else None
        leg = None if pair is None or paired is None else pair_leg(rec, pair, paired)
        if leg is not None:  # the prefill engine's factor in its terms (what its end teaches)
            p = self._fleet.state.backends[leg.backend]
            leg.prefill_factor = p.speed_for(rec.model).prefill_factor
        self._fleet.state.dispatch(rec, leg)
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
            pace_ms=pace_ms(self.cfg.routing, b, chosen, now_s),
            waited_ms=waited_ms,
            queued_behind=queued_behind,
            first_byte_deadline_ms=first_byte_deadline_ms(
                self.cfg.routing, chosen, rec.streaming, self.cfg.envoy.route_timeout_s
            ),
            engine_priority=engine_priority(b, request),
            prefill=None if pair is None else prefill_leg(pair),
        )
        _stamp(rec, decision, now_s)
        self._decisions += 1
        self._log.add(decision, now_s)
        event = Dispatched(request, decision, rec, now_s)
        for listener in self._listeners:
            listener.on_dispatch(event)
        return decision


def in_flight_record(
    request: RouteRequest,
    chosen: Candidate,
    b: BackendState,
    blocks: list[Hashes],
    state: PrefixState,
    now_s: float,
    block_tokens: int,
) -> InFlight:
    """What the router keeps of a request it sends to `chosen` (to learn from its end),
    the scheduler's replay there with it (ttft_model: replay)."""
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
        replay_features=chosen.replay_features,
        replay_credit_ms=chosen.replay_credit_ms,
    )


def engine_priority(b: BackendState, request: RouteRequest) -> int | None:
    """The `priority` to write into the request's body for b's engine (None: nothing to
    write: feeds.server_info.PriorityWriting.to_write)."""
    client = request.llm.priority if request.llm else None
    return b.priority.to_write(request.priority, client)


def _stamp(rec: InFlight, decision: Decision, now_s: float) -> None:
    """What the in-flight record keeps of its decision: its pacing, the wait in the
    gateway queue, and when its first byte is due."""
    rec.pace_ms = decision.pace_ms
    rec.waited_ms = decision.waited_ms
    if decision.first_byte_deadline_ms is not None:
        rec.first_byte_deadline_s = (
            now_s + (decision.pace_ms + decision.first_byte_deadline_ms) / 1000
        )
