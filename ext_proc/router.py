"""The routing core: compute each backend's features, let the policy choose, record the
dispatch, and learn from the first byte and the completion.

Pure and synchronous with an injected clock and RNG, so the live service and the offline
simulator drive the very same object.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ext_proc.config import Config
from ext_proc.cost import PrefillModel, QueueItem, queue_ms
from ext_proc.policy import Candidate, Policy, RouteRequest, make_policy
from ext_proc.prefix import Hashes, PrefixIndex, as_hashes
from ext_proc.profile import EngineProfile, load_profile
from ext_proc.state import OK, Completion, FleetState, InFlight
from ext_proc.tokens import APPROX, BYTES_PER_TOKEN, Tokenizer
from ext_proc.tuner import PAPER, Tuner, TunerSettings

log = logging.getLogger("gorgo.router")

# How many recent decisions /state shows.
RECENT_DECISIONS = 8
# Output budget assumed when a request names no max tokens (KV and decode estimates).
DEFAULT_OUTPUT_TOKENS = 256
# Weight of a new dispatch in a backend's mean prefill estimate (prices engine-reported
# queue lengths): about the last 20 requests.
PREFILL_EWMA = 0.05
# A block the router believed cached for this long that the engine no longer had was
# evicted (any prefill that could still be computing it is long over): see `learn_cached`.
SETTLED_S = 30.0


@dataclass(frozen=True)
class Decision:
    request_id: str
    backend: str
    policy: str
    input_tokens: int
    candidates: tuple[Candidate, ...]
    scores: dict[str, float]
    # The weights the policy used (None: a policy without weights) and the tuner's arm.
    weights: tuple[float, float] | None = None
    arm: str | None = None

    def ranked(self) -> list[str]:
        """The chosen backend, then the others from best score to worst: where a retry
        should go when the chosen one cannot be reached."""
        others = [c.backend_id for c in self.candidates if c.backend_id != self.backend]
        others.sort(key=lambda b: self.scores.get(b, float("inf")))
        return [self.backend, *others]

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "policy": self.policy,
            "input_tokens": self.input_tokens,
            "candidates": [
                {**c.as_json(), "score": round(self.scores[c.backend_id], 3)}
                if c.backend_id in self.scores
                else c.as_json()
                for c in self.candidates
            ],
        }


def make_tuner(cfg: Config, rng: random.Random, policy: Policy) -> Tuner | None:
    """The tuner the config asks for, for a policy with weights (else None)."""
    weights = getattr(policy, "weights", None)
    if cfg.tuner.mode == "off" or weights is None:
        return None
    paper_bounds = cfg.tuner.mode == PAPER or policy.name == "gorgo_tokens"
    base = TunerSettings.paper() if paper_bounds else TunerSettings()
    settings = replace(base, mode=cfg.tuner.mode, arm_size=cfg.tuner.arm_size)
    return Tuner(settings, weights, rng, cfg.tuner.state_file or None)


class Router:
    def __init__(
        self,
        cfg: Config,
        clock: Callable[[], float],
        rng: random.Random,
        tokenizer: Tokenizer = APPROX,
        policy: Policy | None = None,
        tuner: Tuner | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.tokenizer = tokenizer
        self.policy = policy or make_policy(cfg.policy, rng, cfg)
        # Only a policy with weights can be tuned.
        self.tuner = tuner if hasattr(self.policy, "weights") else None
        self.state = FleetState((b.id, b.rtt_prior_ms) for b in cfg.backends)
        self.addresses = {b.id: b.address for b in cfg.backends}
        self.profiles: dict[str, EngineProfile] = {
            b.id: load_profile(b.engine_profile) for b in cfg.backends
        }
        self.prefill = {
            b: PrefillModel(p, cfg.routing.refit_prefill) for b, p in self.profiles.items()
        }
        self.index = PrefixIndex(
            {
                b.id: b.kv_capacity_tokens or self.profiles[b.id].kv_capacity_tokens
                for b in cfg.backends
            },
            cfg.routing.block_tokens,
        )
        self.decisions = 0
        self.recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)
        self.sees_first_bytes = False

    # -- features -----------------------------------------------------------------------

    def prompt_blocks(self, request: RouteRequest) -> Hashes:
        if request.blocks is not None:
            return as_hashes(list(request.blocks))
        if request.llm is None:
            return as_hashes([])
        return as_hashes(
            self.tokenizer.block_hashes(request.llm.prompt, self.cfg.routing.block_tokens)
        )

    def output_tokens(self, request: RouteRequest) -> int:
        """The request's output budget (its max tokens), else a typical chat answer."""
        llm = request.llm
        return llm.max_output_tokens if llm and llm.max_output_tokens else DEFAULT_OUTPUT_TOKENS

    def affinity_key(self, request: RouteRequest) -> str:
        if request.session_key:
            return request.session_key
        if request.llm is None:
            return request.request_id
        head = request.llm.prompt[: self.cfg.routing.affinity_prefix_tokens * BYTES_PER_TOKEN]
        return f"prompt:{zlib.crc32(head.encode()):08x}"

    def candidates(self, request: RouteRequest, blocks: Hashes) -> tuple[Candidate, ...]:
        now_s = self.clock()
        input_tokens = request.llm.input_tokens if request.llm else 0
        need_kv = input_tokens + self.output_tokens(request)
        matched = self.index.match(blocks)
        bt = self.cfg.routing.block_tokens
        healthy = [b for b in self.state.backends.values() if self.state.available(b, now_s)]
        out = []
        for b in healthy or self.state.backends.values():  # all suspect: try them all
            # At least one prompt token is always computed.
            cached = min(matched[b.id] * bt, max(0, input_tokens - 1))
            uncached = input_tokens - cached
            out.append(
                Candidate(
                    backend_id=b.id,
                    in_flight=b.in_flight,
                    waiting_first_byte=b.waiting_first_byte,
                    queued_tokens=b.queued_tokens,
                    rtt_ms=b.rtt_ms,
                    queue_ms=self.queue_ms(b.id, now_s, need_kv),
                    prefill_ms=self.prefill[b.id].prefill_ms(uncached, cached),
                    cached_tokens=cached,
                    uncached_tokens=uncached,
                )
            )
        return tuple(out)

    def queue_ms(self, backend: str, now_s: float, need_kv_tokens: int = 0) -> float:
        b = self.state.backends[backend]
        profile = self.profiles[backend]
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
        step_ms = profile.decode_ms(len(decoding), sum(r.input_tokens for r in decoding))
        capacity = self.index.capacity_blocks[backend] * self.cfg.routing.block_tokens
        # No first byte ever seen means none is observed (an Envoy without the observing
        # filter): lateness would then be noise.
        grace_ms = self.cfg.routing.stall_grace_ms if self.sees_first_bytes else 0.0
        own_ms = queue_ms(items, step_ms, now_s, b.rtt_ms / 2, capacity, need_kv_tokens, grace_ms)
        fresh = (
            b.metrics_at_s is not None and now_s - b.metrics_at_s <= self.cfg.probes.metrics_stale_s
        )
        if fresh:
            # The engine's own count of requests waiting, priced at the mean prefill of
            # what we sent there lately: catches load we did not route (other routers,
            # direct clients).
            own_ms = max(own_ms, b.metrics_queue_reqs * b.mean_prefill_ms)
        return own_ms

    # -- decisions ------------------------------------------------------------------------

    def should_shed(self, request: RouteRequest) -> float | None:
        """With shedding on: seconds to wait before retrying when every backend's queue
        estimate is past the bound (None: serve the request)."""
        bound_ms = self.cfg.routing.shed_queue_ms
        if not bound_ms:
            return None
        now_s = self.clock()
        need = (request.llm.input_tokens if request.llm else 0) + self.output_tokens(request)
        least_ms = min(self.queue_ms(b, now_s, need) for b in self.state.backends)
        return least_ms / 1000 if least_ms > bound_ms else None

    def decide(self, request: RouteRequest) -> Decision:
        """Choose a backend and record the dispatch."""
        if not request.affinity_key:
            request = replace(request, affinity_key=self.affinity_key(request))
        blocks = self.prompt_blocks(request)
        candidates = self.candidates(request, blocks)
        arm = None
        if self.tuner is not None:  # the tuner's arm for this request sets the weights
            arm = self.tuner.arm_for(request.request_id)
            self.policy.weights = self.tuner.weights_for(request.request_id)  # type: ignore[attr-defined]
        choice = self.policy.choose(request, candidates)
        w = getattr(self.policy, "weights", None)
        chosen = next((c for c in candidates if c.backend_id == choice.backend_id), None)
        if chosen is None:
            raise ValueError(
                f"policy {self.policy.name!r} chose {choice.backend_id!r}, not a candidate"
            )
        now_s = self.clock()
        held = blocks[: chosen.cached_tokens // self.cfg.routing.block_tokens]
        rec = InFlight(
            request_id=request.request_id,
            backend=chosen.backend_id,
            dispatched_s=now_s,
            input_tokens=chosen.cached_tokens + chosen.uncached_tokens,
            output_tokens=self.output_tokens(request),
            cached_tokens=chosen.cached_tokens,
            prefill_ms=chosen.prefill_ms,
            rtt_ms=chosen.rtt_ms,
            queue_ms=chosen.queue_ms,
            blocks=blocks,
            matched_last_used_s=self.index.last_used_s(chosen.backend_id, held),
            streaming=request.llm.stream if request.llm else True,
        )
        self.state.dispatch(rec)
        self.index.insert(chosen.backend_id, blocks, now_s)
        b = self.state.backends[chosen.backend_id]
        b.mean_prefill_ms += PREFILL_EWMA * (chosen.prefill_ms - b.mean_prefill_ms)
        decision = Decision(
            request.request_id,
            chosen.backend_id,
            self.policy.name,
            rec.input_tokens,
            candidates,
            choice.scores,
            None if w is None else (w.rtt, w.queue),
            arm,
        )
        self.decisions += 1
        self.recent.append(decision)
        return decision

    # -- learning -------------------------------------------------------------------------

    def first_byte(self, request_id: str) -> float | None:
        """First response byte seen: TTFT in ms as the proxy saw it."""
        seen = self.state.first_byte(request_id, self.clock())
        if seen is None:
            return None
        self.sees_first_bytes = True
        return seen[0]

    def learn_cached(self, rec: InFlight, reported_cached_tokens: int) -> int:
        """The engine reported how much of the prompt it had cached. If that is less than
        the index claimed, the engine evicted a block the index still holds; an LRU cache
        evicts older blocks first, so everything not used since that block goes too.
        Returns how many index blocks were dropped."""
        bt = self.cfg.routing.block_tokens
        held = rec.matched_last_used_s
        kept = reported_cached_tokens // bt
        if held is None or kept >= len(held):
            return 0
        missing_last_used_s = float(held[kept])
        if rec.dispatched_s - missing_last_used_s < SETTLED_S:
            return 0  # maybe still being computed by an earlier request: not evidence
        return self.index.trim(rec.backend, missing_last_used_s)

    def complete(
        self,
        request_id: str,
        status: str,
        e2e_ms: float | None = None,
        cached_tokens: int | None = None,
        served_by: str | None = None,
    ) -> Completion | None:
        """Close the loop for one request; idempotent (a second call returns None).
        served_by: the backend that answered, when known (Envoy may have retried a connect
        failure on another one)."""
        now_s = self.clock()
        pending = self.state.in_flight.get(request_id)
        reached = pending is None or not served_by or served_by == pending.backend
        done = self.state.complete(request_id, now_s, status, e2e_ms, reached)
        if done is None:
            return None
        if not reached and served_by in self.state.backends and done.record.blocks is not None:
            self.index.insert(served_by, done.record.blocks, now_s)  # its KV is there now
        r = self.cfg.routing
        if r.eject_after_errors and self.state.eject_failing(
            done.backend, now_s, r.eject_after_errors, r.eject_s
        ):
            log.warning(
                "backend %s ejected: %d failed or unreachable requests in a row",
                done.backend,
                r.eject_after_errors,
            )
        rec = done.record
        if reached and status == OK:  # learn only from what the chosen backend did
            if rec.queue_ms == 0 and rec.input_tokens and done.ttft_ms is not None:
                # Met no queue: TTFT = RTT + prefill, a clean sample for the prefill model
                # (taken at completion: only then is it known Envoy did not retry elsewhere).
                self.prefill[rec.backend].observe(
                    rec.input_tokens - rec.cached_tokens,
                    rec.cached_tokens,
                    done.ttft_ms - rec.rtt_ms,
                )
            if cached_tokens is not None:
                self.learn_cached(rec, cached_tokens)
        if self.tuner is not None:
            ok = status == OK
            self.tuner.observe(
                request_id, done.ttft_ms if ok else None, done.e2e_ms if ok else None
            )
        return done

    def record_probe(self, backend: str, rtt_ms: float | None) -> None:
        p = self.cfg.probes
        self.state.record_probe(backend, rtt_ms, p.ewma_alpha, p.suspect_after)

    def record_fallback(self, backend: str) -> None:
        self.state.record_fallback(backend)

    def expire(self) -> list[Completion]:
        return self.state.expire(self.clock(), self.cfg.request_timeout_s)

    def snapshot(self) -> dict[str, Any]:
        now_s = self.clock()
        backends = {}
        for b in self.state.backends.values():
            backends[b.id] = {
                **b.as_json(),
                "queue_ms": round(self.queue_ms(b.id, now_s), 3),
                "cached_tokens": self.index.size_blocks(b.id) * self.cfg.routing.block_tokens,
            }
        weights = self.tuner.weights if self.tuner else getattr(self.policy, "weights", None)
        return {
            "policy": self.policy.name,
            "weights": None if weights is None else {"rtt": weights.rtt, "queue": weights.queue},
            "tuner": None if self.tuner is None else self.tuner.snapshot(),
            "decisions": self.decisions,
            "in_flight": len(self.state.in_flight),
            "backends": backends,
            "recent_decisions": [d.as_json() for d in self.recent],
        }
