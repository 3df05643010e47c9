"""The engine model: an SGLang-like scheduler on one GPU group, as pure code.

No sockets, no sleeping: time comes from the caller and randomness from an injected RNG,
so the live emulated engine (`gorgo engine`, wall clock) and the offline simulator
(virtual clock) run the very same schedule.

What it models:
- FCFS waiting queue; at most `max_running_requests` admitted; a request is admitted only
  when the KV pool can hold its prompt and its output (LRU-evicting unused cache blocks).
- Two schedulers, as the engines schedule (`scheduler`):
  - "sglang": prefill runs before decode (SGLang's default: managers/scheduler.py
    get_next_batch_to_run takes a new prefill batch before the running decode batch).
    Prompts are prefilled in chunks of `chunk_tokens` (chunked_prefill_size); several
    short prompts share one chunk; a long prompt holds the GPU until its last chunk,
    delaying every running decode.
  - "vllm": vLLM v1's budgeted steps (v1/core/sched/scheduler.py schedule: "there's no
    decoding phase nor prefill phase"): each step has a token budget (`chunk_tokens` as
    max_num_batched_tokens); the running requests take it first, a token per decode and
    then the partial prefills' next chunks in order, and what is left goes to waiting
    requests in arrival order (a chunk each, while the budget, the batch slots and the KV
    pool allow). Decodes and prefill chunks share one forward pass.
- Continuous batching: each decode step emits one token for every running request.
- A radix prefix cache over blocks of `block_tokens` tokens (chained block hashes): a new
  prompt reuses the longest cached prefix; blocks in use by running requests are pinned;
  unpinned leaves are evicted least recently used first.
- Step times from the profile's formulas, times a seedable lognormal jitter.
- Priority scheduling when the engine's flag is on (off: FCFS as above): the waiting
  queue by `priority`, running requests preempted by recompute, as each engine does it
  (emulator/engine/priority.py says how).

The model answers, through `advance`, when each request's first and later tokens are
emitted and how many of its prompt tokens were cached.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from emulator.engine.model.queues import (
    DECODE,
    DECODE_LOG_INTERVAL,
    DONE,
    PREFILL,
    WAITING,
    Emission,
    EngineQueues,
    ModelRequest,
    ModelStats,
    ModelStep,
)
from emulator.engine.prefix_cache import PrefixCache
from emulator.engine.priority import PriorityScheduling, priority_label, sglang_victims
from ext_proc.estimate.profile import EngineProfile

__all__ = [
    "DECODE_LOG_INTERVAL",
    "Emission",
    "EngineModel",
    "ModelStats",
    "PrefixCache",
    "PriorityScheduling",
]


SCHEDULERS = ("sglang", "vllm")


class EngineModel(EngineQueues):
    """The scheduler: requests submitted, cancelled, admitted, prefilled in chunks,
    decoded and preempted as the engine named by `scheduler` does it; `advance` runs the
    steps due and returns their emissions. Its queues and readings are `EngineQueues`'."""

    def __init__(
        self,
        profile: EngineProfile,
        rng: random.Random,
        max_loras: int | None = None,
        scheduler: str = "sglang",
        priority: PriorityScheduling | None = None,
    ) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler: one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
        super().__init__(profile)
        # Which engine's step planning it follows (the module's docstring).
        self.scheduler = scheduler
        # Priority scheduling (None: off, FCFS). vLLM orders lower values first always.
        if priority is not None and scheduler == "vllm" and not priority.low_values_first:
            raise ValueError("vLLM's priority scheduling serves lower values first")
        self.priority = priority
        # vLLM with priority: KV grows with each decoded token and running requests are
        # preempted when it runs out (no output reserved at admission).
        self._grow_kv = priority is not None and scheduler == "vllm"
        self._submitted = 0
        self.rng = rng
        # At most this many adapters among running requests (None: no limit).
        self.max_loras = max_loras

    # -- inputs -------------------------------------------------------------------------

    def submit(
        self,
        rid: str,
        input_tokens: int,
        output_tokens: int,
        blocks: Sequence[int],
        now_s: float,
        lora: str | None = None,
        cost: float = 1.0,
        priority: int | None = None,
    ) -> None:
        """A request arrives. `blocks`: chained hashes of its prompt's full blocks; `lora`:
        the adapter it runs, whose steps take `cost` times the base model's; `priority`:
        its body's (None: none given), ignored unless priority scheduling is on."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} already in the engine")
        if input_tokens < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one input and one output token")
        full_blocks = input_tokens // self.profile.block_tokens
        req = ModelRequest(rid, tuple(blocks[:full_blocks]), input_tokens, output_tokens, now_s)
        req.lora, req.cost = lora, cost
        self.requests[rid] = req
        self.stats.submitted_by_priority[priority_label(priority)] += 1
        req.priority, req.queued_s, req.seq = priority, now_s, self._submitted
        self._submitted += 1
        self._enqueue(req)
        if self.step is None or self.step.start_s >= now_s:
            # Idle, or a step that starts this very instant: (re)plan so requests arriving
            # together are scheduled together.
            self.step = None
            self._plan(now_s)

    def cancel(self, rid: str, now_s: float) -> None:
        """The client went away: drop the request wherever it is."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if req.state == WAITING:
            self.waiting.remove(req)
        else:
            if req.state == PREFILL:
                self.prefilling.remove(req)
                if self.step is not None:
                    self.step.prefill = [(r, n) for r, n in self.step.prefill if r is not req]
            else:
                self.decoding.pop(rid, None)
                if self.step is not None and req in self.step.decode:
                    self.step.decode.remove(req)
            self._free(req, now_s)
        req.state = DONE
        if self.step is None:
            self._plan(now_s)

    # -- time -------------------------------------------------------------------------------

    def next_event_s(self) -> float | None:
        """When the running step ends (None: idle)."""
        return None if self.step is None else self.step.end_s

    def advance(self, now_s: float) -> list[Emission]:
        """Complete every step that ends at or before now_s; return their emissions."""
        out: list[Emission] = []
        while self.step is not None and self.step.end_s <= now_s:
            step, self.step = self.step, None
            self._complete(step, out)
            self._plan(step.end_s)
        return out

    # -- metrics --------------------------------------------------------------------------

    # -- internals ------------------------------------------------------------------------

    def _jitter(self) -> float:
        sigma = self.profile.jitter_sigma
        return math.exp(self.rng.gauss(0.0, sigma)) if sigma > 0 else 1.0

    def _admit(self, now_s: float, budget: float = math.inf) -> None:
        """FCFS admission while a slot and KV room exist (head-of-line blocking). A request
        for an adapter that would make more than max_loras among the running is passed
        over (it keeps its place), as vLLM's scheduler skips it (v1/core/sched/scheduler.py
        schedule: "Scheduling would exceed max_loras, skip")."""
        skipped: list[ModelRequest] = []
        try:
            self._admit_fcfs(now_s, skipped, budget)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_fcfs(
        self, now_s: float, skipped: list[ModelRequest], budget: float = math.inf
    ) -> None:
        """`budget`: admit only while the prompt tokens still to prefill of the requests
        admitted so far this step are below it (vLLM: a waiting request is scheduled only
        with budget left)."""
        p = self.profile
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self.num_running >= p.max_running_requests:
                # SGLang: the batch is full; a waiting request may preempt running ones.
                if self._preempt_to_schedule(req, 0, now_s):
                    continue
                return
            if req.lora is not None and self.max_loras is not None:
                active = {r.lora for r in (*self.prefilling, *self.decoding.values())}
                active.discard(None)
                if req.lora not in active and len(active) >= self.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
            # At least one prompt token is always computed (it yields the first logits).
            matched = min(self.cache.match(req.blocks), (req.input_tokens - 1) // p.block_tokens)
            # Pin the matched prefix first, so making room cannot evict it.
            self.cache.acquire(req.blocks[:matched], now_s)
            reserve = req.prefill_target - matched * p.block_tokens
            if not self._grow_kv:
                reserve += req.output_tokens - req.resumed_tokens
            need = reserve - (p.kv_capacity_tokens - self.used_tokens)
            # Wait for running requests to free KV; alone on the engine, a request larger
            # than the pool is admitted anyway rather than blocking the queue forever.
            if need > 0 and self.cache.evict(need) < need and self.num_running:
                self.cache.release(req.blocks[:matched], now_s)
                if self._preempt_to_schedule(req, need, now_s):
                    continue
                return
            self.waiting.popleft()
            req.pinned = matched
            req.admitted_tokens = req.prefilled_tokens = matched * p.block_tokens
            req.reserved_tokens = reserve
            self._reserved_tokens += reserve
            req.state = PREFILL
            self.prefilling.append(req)
            budget -= req.prefill_target - req.prefilled_tokens
            if req.preemptions:
                continue  # counted when first admitted; the usage keeps that first count
            req.cached_tokens = req.admitted_tokens
            self.stats.requests_admitted += 1
            self.stats.prompt_tokens += req.input_tokens
            self.stats.cached_tokens += req.cached_tokens

    def _order(self, req: ModelRequest) -> tuple[int, float, int]:
        """The waiting queue's order under priority scheduling: rank, then vLLM's arrival
        (Request.__lt__: priority, arrival_time) or SGLang's entry into the waiting queue
        (wait_queue_entry_time, reset when a preempted request returns), then submission."""
        return req.rank, req.queued_s, req.seq

    def _enqueue(self, req: ModelRequest) -> None:
        if self.priority is None:
            self.waiting.append(req)
            return
        req.rank = self.priority.rank(req.priority, self.scheduler)
        at = bisect.bisect_right(self.waiting, self._order(req), key=self._order)
        self.waiting.insert(at, req)

    def _preempt(self, req: ModelRequest, now_s: float) -> None:
        """Recompute (vLLM _preempt_request; SGLang release_req): KV freed, back to wait,
        prompt and generated tokens prefilled again when admitted next."""
        if req.state == PREFILL:
            self.prefilling.remove(req)
        else:
            self.decoding.pop(req.rid)
        self._free(req, now_s)
        req.state = WAITING
        req.resumed_tokens = req.generated
        req.prefilled_tokens = req.admitted_tokens = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.stats.preempted_by_priority[priority_label(req.priority)] += 1
        if self.scheduler == "sglang":
            req.queued_s = now_s  # _add_request_to_queue stamps the entry time anew
        self._enqueue(req)

    def _make_room_for_decodes(self, now_s: float) -> bool:
        """vLLM with priority: when the pool cannot take a token per decode (after evicting
        unused cache), preempt max(running, key=(priority, arrival)) until it can; never
        a lone request (it would only come back). Returns whether any was."""
        p = self.profile
        preempted = False
        while True:
            short = len(self.decoding) - (p.kv_capacity_tokens - self.used_tokens)
            if short <= 0 or self.cache.evict(short) >= short or self.num_running <= 1:
                return preempted
            running = (*self.prefilling, *self.decoding.values())
            self._preempt(max(running, key=lambda r: (r.rank, r.arrival_s, r.seq)), now_s)
            preempted = True

    def _preempt_to_schedule(self, req: ModelRequest, need_tokens: int, now_s: float) -> bool:
        """SGLang with priority: the waiting head `req` finds the batch full (no slot, or
        `need_tokens` of KV short); decoding requests it may preempt (sglang_victims),
        what each holds counted as freed. Returns whether any was."""
        prio = self.priority
        if prio is None or self.scheduler != "sglang" or not prio.preemption:
            return False
        bt = self.profile.block_tokens
        victims = sglang_victims(
            req.rank,
            self.decoding.values(),
            lambda r: (r.rank, r.queued_s),
            lambda r: r.reserved_tokens + r.pinned * bt,
            prio.preemption_threshold,
            need_tokens,
        )
        for r in victims:
            self._preempt(r, now_s)
        return bool(victims)

    def _plan(self, now_s: float) -> None:
        if self.scheduler == "vllm":
            self._plan_budgeted(now_s)
        else:
            self._plan_prefill_first(now_s)

    def _plan_budgeted(self, now_s: float) -> None:
        """vLLM v1: decodes first, a token each, then partial prefills, then new requests,
        under one token budget; one forward pass for all."""
        p = self.profile
        budget = p.chunk_tokens
        decode = list(self.decoding.values())[:budget]
        budget -= len(decode)
        if self._grow_kv and self._make_room_for_decodes(now_s):
            # a step that preempted admits no waiting request (scheduler.py schedule)
            decode = list(self.decoding.values())[: p.chunk_tokens]
            budget = p.chunk_tokens - len(decode)
        else:
            owed = sum(r.prefill_target - r.prefilled_tokens for r in self.prefilling)
            self._admit(now_s, budget - owed)
        batch, ms = self._chunks(budget, 0.0)
        if not batch and not decode:
            return
        if decode:
            context = sum(r.input_tokens + r.generated for r in decode)
            ms += p.decode_ms(len(decode), context) * max(r.cost for r in decode)
        else:
            ms += p.prefill_base_ms
        kind = PREFILL if batch else DECODE
        self.step = ModelStep(now_s, now_s + ms * self._jitter() / 1e3, kind, batch, decode)

    def _chunks(self, budget: int, ms: float) -> tuple[list[tuple[ModelRequest, int]], float]:
        """The admitted prompts' next chunks in order within `budget` tokens, and `ms`
        plus their prefill time."""
        batch: list[tuple[ModelRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, req.prefill_target - req.prefilled_tokens)
            ms += self.profile.prefill_ms(n, req.prefilled_tokens) * req.cost
            batch.append((req, n))
            budget -= n
        return batch, ms

    def _plan_prefill_first(self, now_s: float) -> None:
        """SGLang: prefill first (chunked), else one decode step. With priority, only what
        the next prefill batch takes leaves the waiting queue (PrefillAdder's chunk
        budget), so the queue's order decides the prefill order; FCFS admits at once."""
        p = self.profile
        if self.priority is None:
            self._admit(now_s)
        else:
            owed = sum(r.prefill_target - r.prefilled_tokens for r in self.prefilling)
            self._admit(now_s, p.chunk_tokens - owed)
        if self.prefilling:
            batch, ms = self._chunks(p.chunk_tokens, p.prefill_base_ms)
            self.step = ModelStep(now_s, now_s + ms * self._jitter() / 1e3, PREFILL, batch, [])
        elif self.decoding:
            reqs = list(self.decoding.values())
            context = sum(r.input_tokens + r.generated for r in reqs)
            # An adapter's kernels run over the whole batch: the costliest one sets it.
            ms = p.decode_ms(len(reqs), context) * max(r.cost for r in reqs)
            self.step = ModelStep(now_s, now_s + ms * self._jitter() / 1e3, DECODE, [], reqs)

    def _complete(self, step: ModelStep, out: list[Emission]) -> None:
        t = step.end_s
        if step.kind == PREFILL:
            self.stats.prefill_steps += 1
        else:
            self.stats.decode_steps += 1
        for req, n in step.prefill:
            req.prefilled_tokens += n
            self._cache_computed_blocks(req, t)
            if req.prefilled_tokens >= req.prefill_target:
                self.prefilling.remove(req)
                req.state = DECODE
                self.decoding[req.rid] = req
                self._emit(req, t, out)
        for req in step.decode:
            self._emit(req, t, out)
        if step.decode:
            self._log_decode(step, t)

    def _emit(self, req: ModelRequest, t: float, out: list[Emission]) -> None:
        req.generated += 1
        if self._grow_kv:  # the token's KV, written by the next step
            req.reserved_tokens += 1
            self._reserved_tokens += 1
        finished = req.generated >= req.output_tokens
        out.append(Emission(req.rid, req.generated - 1, t, finished, req.cached_tokens))
        self.stats.tokens_emitted += 1
        if finished:
            self.decoding.pop(req.rid, None)
            self.requests.pop(req.rid, None)
            req.state = DONE
            self._free(req, t)
