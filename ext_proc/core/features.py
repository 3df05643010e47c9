"""Step 3's inputs: each candidate backend's features for one request (RTT, queue,
prefill of the uncached tokens, cached tokens, what the request would do to the others
there), computed from the fleet's records. The framework computes them; a policy only
chooses.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np

from ext_proc.config.schema import Routing
from ext_proc.core.admission import fits_context, serving
from ext_proc.core.backend import BackendState
from ext_proc.core.fleet import Fleet
from ext_proc.core.terms.base import TermInputs
from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.queue import queue_ms, reported_waiting_ms
from ext_proc.estimate.chain import chain_keys
from ext_proc.estimate.cost import QueueItem, ahead_of, unstarted_ms
from ext_proc.estimate.decode_replay import length_kind
from ext_proc.estimate.output_length import DEFAULT_OUTPUT_TOKENS, OutputLengths, keys_for
from ext_proc.estimate.prefix import Hashes, as_hashes, leading_true
from ext_proc.estimate.replay import Prompt, ReplayEstimate, estimate
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.prompt.tokens import APPROX, block_hashes_of_ids
from ext_proc.vocab.types import BackendLifecycle, Candidate, InFlight, PrefixState, RouteRequest

# How long after its first token a request is surely in the engine's next load report: a
# scrape's own delay, the gauges' update.
REPORT_SLACK_MS = 250.0
_ACTIVE = BackendLifecycle.ACTIVE


class NoActiveBackend(RuntimeError):
    """Every backend is pending or draining (a fleet replaced whole, for the moment Envoy
    takes to learn the new clusters): the request takes Envoy's fallback route."""


def output_tokens(request: RouteRequest) -> int:
    """The request's output budget (its max tokens), else a typical chat answer."""
    llm = request.llm
    return llm.max_output_tokens if llm and llm.max_output_tokens else DEFAULT_OUTPUT_TOKENS


def expected_output_tokens(lengths: OutputLengths, request: RouteRequest) -> float:
    """The output the request is expected to generate: learned by its model, objective and
    tenant, its max_tokens the cap (estimate/output_length.py)."""
    llm = request.llm
    keys = keys_for(llm.model if llm else None, request.objective, request.tenant)
    return lengths.expected(keys, llm.max_output_tokens if llm else None, request.session_key)


def kv_tokens(request: RouteRequest) -> int:
    """KV the request will hold: its prompt and its output budget."""
    return (request.llm.input_tokens if request.llm else 0) + output_tokens(request)


def prefix_state(b: BackendState) -> PrefixState:
    """Where the backend's predictions come from: its engine's events while their stream
    is up, warming while the router may lack the engine's earlier history, the router's
    own index while they are down or of a shape the router cannot key."""
    engine = b.engine.blocks
    if not b.precise or engine is None or engine.unsupported is not None:
        return PrefixState.APPROXIMATE
    return PrefixState.PRECISE if engine.history_complete else PrefixState.WARMING


def prefix_state_for(b: BackendState, request: RouteRequest) -> PrefixState:
    """The backend's prefix state for this request: the engine's (precise, warming) only
    for a request matched by token ids, not by a simulator's own block hashes alone."""
    if request.blocks is not None and request.engine_keys is None:
        return PrefixState.APPROXIMATE
    return prefix_state(b)


def precise_for(b: BackendState, request: RouteRequest) -> bool:
    """The backend's prediction for this request comes from its engine's events."""
    return prefix_state_for(b, request) is not PrefixState.APPROXIMATE


KeysOf = Callable[[int, int], list[list[int]]]


def _keys_by_block_size(request: RouteRequest) -> KeysOf:
    """Each prompt's chain keys at a block size in a namespace (`chain.namespace_seed`),
    tokenized and chained once per decision whatever the number of backends."""
    prompts = request.llm.prompts if request.llm else ()
    ids: list[Sequence[int]] = []
    cache: dict[tuple[int, int], list[list[int]]] = {}

    def keys_of(block_size: int, seed: int = 0) -> list[list[int]]:
        if request.engine_keys is not None:
            return [list(request.engine_keys)]
        if not ids:
            ids.extend(p if isinstance(p, tuple) else APPROX.ids(p) for p in prompts)
        if (block_size, seed) not in cache:
            cache[block_size, seed] = [chain_keys(p, block_size, seed) for p in ids]
        return cache[block_size, seed]

    return keys_of


def _capped(per_prompt: Sequence[float], lengths: Sequence[int]) -> int:
    """Cached tokens of a request: each prompt's own leading match, at least one token of
    each computed."""
    return sum(min(int(c), max(0, n - 1)) for c, n in zip(per_prompt, lengths, strict=False))


def adapter_salt(model: str) -> int:
    """What an adapter's block hashes are XORed with in the router's own index."""
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "little")


def first_byte_deadline_ms(
    r: Routing, chosen: Candidate, streaming: bool, route_timeout_s: float
) -> float | None:
    """How long the chosen backend has to begin its response (None: no deadline): a
    multiple of the predicted TTFT (E2E when not streamed: the headers come at the end)
    plus the slack, under Envoy's route timeout, which a per-try timeout must be."""
    if not r.first_byte_factor and not r.first_byte_slack_ms:
        return None
    predicted_ms = chosen.predicted_ttft_ms if streaming else chosen.predicted_e2e_ms
    deadline_ms = r.first_byte_factor * predicted_ms + r.first_byte_slack_ms
    return min(deadline_ms, route_timeout_s * 1000 - 1)


def pace_ms(r: Routing, b: BackendState, chosen: Candidate, now_s: float) -> float:
    """Dispatch pacing: how long to keep a request before it is sent on (ms).

    Requests sent to one backend within the WAN's jitter of each other reach the
    engine in an order the jitter picks, while the queue estimate (and so every
    decision made since) counts each one behind those routed before it; under bursts
    that unpredicted overtaking made most of the TTFT tail (docs/cost-model.md). So a
    request is paced until `routing.pace_sigmas` probe-RTT standard deviations after
    the previous one sent there; never longer than the queue it is predicted to meet on
    arrival (a paced request loses nothing it would not have waited: on arrival-spread
    traffic a cap at the queue owed now paced requests past it and cost p95 E2E), nor
    than `routing.pace_max_ms` (Envoy waits for the decision within its message
    timeout).
    """
    paced_ms = 0.0
    if r.pace_sigmas:
        due_ms = (b.load.sent_s - now_s) * 1000 + r.pace_sigmas * math.sqrt(b.health.rtt_var_ms2)
        # The queue it meets on arrival: what is owed there now, less what the engine
        # gets through while the request travels.
        wait_ms = chosen.queue_ms - b.health.rtt_ms / 2
        paced_ms = min(max(0.0, due_ms), max(0.0, wait_ms), r.pace_max_ms)
    b.load.sent_s = now_s + paced_ms / 1000
    return paced_ms


def credible_records(b: BackendState, report: EngineReport | None) -> list[InFlight]:
    """The backend's requests in flight that its engine's last report does not deny. A
    request whose first token came before the report (by REPORT_SLACK_MS) runs there, and
    the engine says how many run and wait: beyond that count, the oldest of them are gone
    whatever the router heard (their ends were never reported: an Envoy that went away)
    and load nothing there. A request still waiting for its first token is kept: the
    engine not counting it is what a stall looks like (held before the scheduler), and
    stall detection needs it."""
    records = list(b.load.records.values())
    if report is None or report.waiting is None or report.running is None:
        return records
    assert b.engine.report_at_s is not None
    seen_by_s = b.engine.report_at_s - REPORT_SLACK_MS / 1000
    running = [r for r in records if r.first_byte_s is not None and r.first_byte_s <= seen_by_s]
    denied = len(running) - int(report.waiting + report.running)
    if denied <= 0:
        return records
    gone = {r.request_id for r in sorted(running, key=lambda r: r.dispatched_s)[:denied]}
    return [r for r in records if r.request_id not in gone]


class Features:
    """Computes candidates from the fleet's records on the router's clock."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.clock = clock
        # No first byte ever seen means none is observed (an Envoy without the observing
        # filter): lateness would then be noise (set by the router at the first one).
        self.sees_first_bytes = False
        # Per candidate of the last `candidates` call whose engine's events serve: the
        # cached tokens a precise prediction gave (what a warming backend is judged by).
        self.precise_cached: dict[str, int] = {}
        # Flow control is on: each candidate's work not yet started is measured (its room).
        self.flow_control = fleet.cfg.flow_control.enabled
        # routing.ttft_model: replay: each candidate carries the scheduler's replay there.
        self.replay = fleet.cfg.routing.ttft_model == "replay"

    def prompt_blocks(self, request: RouteRequest) -> list[Hashes]:
        """Each prompt's prefix-block hashes (one list per prompt of a batch), in the
        namespace of the LoRA adapter it asks for, if any: the engines key an adapter's
        blocks apart from its base model's, so neither is a hit for the other."""
        if request.blocks is not None:
            blocks = [as_hashes(list(request.blocks))]
        elif request.llm is None:
            return []
        else:
            bt = self.fleet.cfg.routing.block_tokens
            blocks = [
                as_hashes(
                    block_hashes_of_ids(p, bt)
                    if isinstance(p, tuple)
                    else APPROX.block_hashes(p, bt)
                )
                for p in request.llm.prompts
            ]
        model = request.llm.model if request.llm else None
        if model is not None and self.fleet.state.is_adapter(model):
            salt = np.uint64(adapter_salt(model))
            blocks = [h ^ salt for h in blocks]
        return blocks

    def _precise_cached(
        self,
        b: BackendState,
        request: RouteRequest,
        keys_of: KeysOf,
        blocks: list[Hashes],
        now_s: float,
    ) -> tuple[list[float], list[float]]:
        """Per prompt, the tokens the engine's own events say it holds, or that this router
        sent there within optimistic_ttl_s (not yet confirmed by an event); and what is
        used: that, or while warming (the engine's earlier history may be missing) at
        least what the router's own index holds."""
        routing = self.fleet.cfg.routing
        engine = b.engine.blocks
        assert engine is not None  # precise_for
        llm = request.llm
        seed = engine.seed_for(llm.model, llm.cache_salt) if llm else 0
        sizes = engine.key_sizes or (routing.block_tokens,)
        keyed = {size: keys_of(size, seed) for size in sizes}
        lengths = llm.prompt_tokens if llm else ()
        warming = not engine.history_complete
        since_s = now_s - routing.optimistic_ttl_s
        precise, used = [], []
        for i, prompt_blocks in enumerate(blocks[: min(len(k) for k in keyed.values())]):
            limit = max(0, lengths[i] - 1) if i < len(lengths) else None
            reported = engine.cached_tokens({s: k[i] for s, k in keyed.items()}, limit)
            recent = b.prefix.last_used_s(prompt_blocks)
            optimistic = leading_true(recent >= since_s) * routing.block_tokens
            precise.append(max(reported, optimistic))
            own = b.prefix.match(prompt_blocks) * routing.block_tokens if warming else 0
            used.append(max(precise[-1], own))
        return precise, used

    def candidates(self, request: RouteRequest, blocks: list[Hashes]) -> tuple[Candidate, ...]:
        now_s = self.clock()
        state = self.fleet.state
        lengths = request.llm.prompt_tokens if request.llm else ()
        input_tokens = sum(lengths)
        need_kv = kv_tokens(request)
        out_tokens = output_tokens(request)
        expected_out = expected_output_tokens(state.output_lengths, request)
        kind = length_kind(expected_out, request.llm.max_output_tokens if request.llm else None)
        bt = self.fleet.cfg.routing.block_tokens
        model = request.llm.model if request.llm else None
        active = [b for b in serving(state, model) if b.lifecycle is _ACTIVE]
        if request.regions:  # its objective's regions only (flow control checked some serve)
            active = [b for b in active if b.config.region in request.regions]
        if request.subset is not None:  # the data plane's subset hint: only those
            active = [b for b in active if b.id in request.subset]
        if not active:
            within = "" if request.subset is None else " in the request's subset"
            raise NoActiveBackend(f"no active backend{within} serves {model!r}")
        # those whose context holds the prompt (admission refused it if none does)
        active = [b for b in active if fits_context(b, request.llm)] or active
        healthy = [b for b in active if state.available(b, now_s)]
        adapter = model is not None and state.is_adapter(model)
        grace_ms = self.grace_ms
        keys_of = _keys_by_block_size(request)
        self.precise_cached.clear()
        out = []
        for b in healthy or active:  # all suspect: try them all (never a draining one)
            if precise_for(b, request):
                precise, per_prompt = self._precise_cached(b, request, keys_of, blocks, now_s)
                self.precise_cached[b.id] = _capped(precise, lengths)
            else:
                per_prompt = [b.prefix.match(prompt) * bt for prompt in blocks]
            cached = _capped(per_prompt, lengths)
            items, step_ms = self._queue_items(b)
            # An engine that schedules by priority serves this request before the lower
            # classes there: only its class and above are ahead of it (estimate.cost.ahead_of).
            by_priority = b.priority.writes
            ahead = ahead_of(items, request.priority) if by_priority else items
            x = TermInputs(
                backend=b,
                request=request,
                now_s=now_s,
                model=model,
                adapter=adapter,
                input_tokens=input_tokens,
                cached_tokens=cached,
                uncached_tokens=input_tokens - cached,
                output_tokens=out_tokens,
                need_kv_tokens=need_kv,
                speed=b.speed_for(model),
                items=ahead,
                step_ms=step_ms,
                report=self.fresh_engine_report(b, now_s),
                capacity_tokens=b.prefix.capacity_blocks * bt,
                stall_grace_ms=grace_ms,
                replay=self._replay(b, ahead, now_s, Prompt(input_tokens - cached, cached))
                if self.replay
                else None,
                by_priority=by_priority,
                expected_output_tokens=expected_out,
                decode_calibration=state.decode_calibration.multiplier((b.id, kind)),
            )
            terms: dict[str, float] = {}
            for term in TERMS.values():  # in order: a term may read those before it
                terms[term.name] = term.compute(x, terms)
            out.append(
                Candidate(
                    backend_id=b.id,
                    in_flight=b.load.in_flight,
                    waiting_first_byte=b.load.waiting_first_byte,
                    in_flight_tokens=b.load.in_flight_tokens,
                    cached_tokens=cached,
                    uncached_tokens=x.uncached_tokens,
                    waiting_tokens=sum(
                        it.kv_tokens - it.output_tokens for it in items if it.first_byte_s is None
                    )
                    if self.flow_control
                    else 0,
                    unstarted_ms=_unstarted_ms(x) if self.flow_control else 0.0,
                    by_priority=by_priority,
                    expected_output_tokens=expected_out,
                    decode_calibration=x.decode_calibration,
                    terms=terms,
                    replay_features=None if x.replay is None else x.replay.features,
                    replay_credit_ms=0.0 if x.replay is None else x.replay.credit_ms,
                )
            )
        return tuple(out)

    def _replay(
        self, b: BackendState, items: list[QueueItem], now_s: float, new: Prompt
    ) -> ReplayEstimate:
        return estimate(
            b.step_fit,
            b.config.engine,
            b.profile.chunk_tokens,
            items,
            now_s,
            b.health.rtt_ms / 2,
            new,
        )

    def _queue_items(self, b: BackendState) -> tuple[list[QueueItem], float]:
        """The backend's requests in flight as the queue and KV estimates see them, and its
        decode step now."""
        records = credible_records(b, self.fresh_engine_report(b, self.clock()))
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
                r.input_tokens - r.cached_tokens,
                r.cached_tokens,
                r.priority,
                r.expected_output_tokens,
            )
            for r in records
        ]
        decoding = [r for r in records if r.first_byte_s is not None]
        step_ms = (
            b.profile.decode_ms(len(decoding), sum(r.input_tokens for r in decoding))
            * b.learned.speed.decode_factor
        )
        return items, step_ms

    @property
    def grace_ms(self) -> float:
        """Stall detection's grace, once first bytes are seen at all."""
        return self.fleet.cfg.routing.stall_grace_ms if self.sees_first_bytes else 0.0

    def queue_estimate_ms(self, backend: str, now_s: float, need_kv_tokens: int = 0) -> float:
        """How long a new request needing need_kv_tokens of KV would wait on `backend`
        before its own prefill starts (the queue term, core.terms.queue)."""
        b = self.fleet.state.backends[backend]
        items, step_ms = self._queue_items(b)
        capacity = b.prefix.capacity_blocks * self.fleet.cfg.routing.block_tokens
        report = self.fresh_engine_report(b, now_s)
        return queue_ms(b, now_s, need_kv_tokens, items, step_ms, capacity, self.grace_ms, report)

    def fresh_engine_report(self, b: BackendState, now_s: float) -> EngineReport | None:
        """The engine's last load report, unless older than probes.metrics_stale_s."""
        at_s = b.engine.report_at_s
        if at_s is None or now_s - at_s > self.fleet.cfg.probes.metrics_stale_s:
            return None
        return b.engine.report

    def least_queue_ms(self, request: RouteRequest) -> float:
        """The shortest queue estimate over the active backends (admission)."""
        now_s = self.clock()
        need = kv_tokens(request)
        return min(
            (
                self.queue_estimate_ms(b.id, now_s, need)
                for b in self.fleet.state.backends.values()
                if b.lifecycle is _ACTIVE
            ),
            default=0.0,
        )


def _unstarted_ms(x: TermInputs) -> float:
    """The backend's work not yet started (estimate.cost.unstarted_ms), or the engine's own
    count of requests waiting priced as the queue term prices it, if more."""
    b = x.backend
    own_ms = unstarted_ms(
        x.items, x.now_s, b.health.rtt_ms / 2, x.step_ms, x.capacity_tokens, x.need_kv_tokens
    )
    below = x.request.priority if x.by_priority else None
    return max(own_ms, reported_waiting_ms(b, x.report, below))
