"""The engine model's books: its requests (waiting, prefilling, decoding), the step it
runs, the KV its prefix cache holds and what admitted requests reserve beyond it, and what
the engines report of all that (the readings the twin's status bodies and the simulator's
scrapes render: emulator/engine/status.py). The scheduler (scheduler.py, `EngineModel`)
moves requests between the queues.

Pure, as the scheduler: time comes from the caller.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from emulator.engine.prefix_cache import PrefixCache
from ext_proc.estimate.profile import EngineProfile

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
# SGLang measures its generation throughput over every 40 decode steps and reports the last
# value until the next (server_args.py decode_log_interval 40; scheduler_metrics_mixin.py
# log_decode_stats: tokens decoded since the last log / seconds since it).
DECODE_LOG_INTERVAL = 40


@dataclass
class ModelRequest:
    """One request in the engine model, wherever it is (waiting, prefilling, decoding)."""

    rid: str
    blocks: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    arrival_s: float
    state: str = WAITING
    cached_tokens: int = 0
    # Prompt tokens whose KV exists (cached + prefilled so far).
    prefilled_tokens: int = 0
    generated: int = 0
    # Leading blocks pinned in the cache: the matched prefix, then each block as its
    # prefill completes (only computed KV is shared).
    pinned: int = 0
    # KV reserved at admission and not yet in the cache: uncomputed full blocks, the
    # prompt's partial tail and the whole output.
    reserved_tokens: int = 0
    # The LoRA adapter it runs (None: the base model) and its step-time factor.
    lora: str | None = None
    cost: float = 1.0
    # The body's priority (None: none given) and the rank the waiting queue orders by
    # (lower first; PriorityScheduling.rank), when it entered the queue, and a tie-break
    # in submission order.
    priority: int | None = None
    rank: int = 0
    queued_s: float = 0.0
    seq: int = 0
    # Generated tokens to recompute after a preemption (prefilled again with the prompt).
    resumed_tokens: int = 0
    # Tokens present when last admitted (cached prefix; tells "prefill not begun").
    admitted_tokens: int = 0
    preemptions: int = 0

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV a prefill computes: the prompt, plus after a preemption the
        tokens generated before it."""
        return self.input_tokens + self.resumed_tokens


@dataclass(frozen=True)
class Emission:
    """Token `index` (0 = first) of request `rid` is emitted at `time_s`."""

    rid: str
    index: int
    time_s: float
    finished: bool
    # Prompt tokens served from the prefix cache (known from the first token on).
    cached_tokens: int


@dataclass
class ModelStep:
    """The step the engine runs: a prefill chunk batch or a decode, and when it ends."""

    start_s: float
    end_s: float
    kind: str  # PREFILL or DECODE
    # PREFILL: (request, tokens prefilled by this step); DECODE: requests decoded.
    prefill: list[tuple[ModelRequest, int]]
    decode: list[ModelRequest]


@dataclass
class ModelStats:
    """The engine model's counters."""

    requests_admitted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens_emitted: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    # By the priority carried ("none": none); a preemption sends a running request back.
    submitted_by_priority: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0
    preempted_by_priority: Counter[str] = field(default_factory=Counter)


class EngineQueues:
    """The engine model's queues and KV books, and what the engines report of them; the
    scheduler (`EngineModel`) builds on it."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.cache = PrefixCache(profile.block_tokens)
        self.waiting: deque[ModelRequest] = deque()
        # Admitted requests still prefilling, in admission order (FCFS within chunks).
        self.prefilling: deque[ModelRequest] = deque()
        self.decoding: dict[str, ModelRequest] = {}
        self.requests: dict[str, ModelRequest] = {}
        self.step: ModelStep | None = None
        self.stats = ModelStats()
        # KV reserved by admitted requests beyond what they hold in the cache.
        self._reserved_tokens = 0
        # Generated tokens/s over the last DECODE_LOG_INTERVAL decode steps (0.0 before).
        self.gen_throughput = 0.0
        self._log_steps = 0
        self._log_tokens = 0
        self._log_start_s: float | None = None

    # -- what the engines report ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued(self) -> int:
        """Requests whose prefill has not begun: what the engines report as waiting (SGLang
        `num_queue_reqs` = len(waiting_queue), managers/scheduler_metrics_mixin.py; vLLM
        `num_requests_waiting`, v1/core/sched/scheduler.py: a request leaves `waiting` when
        its first chunk is scheduled). Here admission to the chunked-prefill queue comes
        first (it reserves KV), so admitted requests no step has reached yet count too."""
        step = self.step
        in_step = {r.rid for r, _ in step.prefill} if step is not None else set()
        not_begun = sum(
            1
            for r in self.prefilling
            if r.prefilled_tokens == r.admitted_tokens and r.rid not in in_step
        )
        return len(self.waiting) + not_begun

    @property
    def num_started(self) -> int:
        """Requests prefilling or decoding: what the engines report as running."""
        return self.num_running + self.num_waiting - self.num_queued

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter, running and waiting (split as num_started and num_queued),
        each in the order the scheduler meets them (vLLM v1/core/sched/scheduler.py
        make_stats: running_lora_adapters, waiting_lora_adapters)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        step = self.step
        in_step = {r.rid for r, _ in step.prefill} if step is not None else set()
        for r in (*self.prefilling, *self.decoding.values()):
            if r.lora is not None:
                begun = r.state == DECODE or r.prefilled_tokens > r.admitted_tokens
                into = running if begun or r.rid in in_step else waiting
                into[r.lora] = into.get(r.lora, 0) + 1
        for r in self.waiting:
            if r.lora is not None:
                waiting[r.lora] = waiting.get(r.lora, 0) + 1
        return running, waiting

    @property
    def held_tokens(self) -> int:
        """KV held by requests: cached blocks nobody holds are free to reuse and do not
        count (SGLang: used = total - (available + evictable),
        scheduler_runtime_checker_mixin.py; vLLM's kv_cache_usage_perc likewise)."""
        return self.used_tokens - self.cache.evictable_tokens

    @property
    def used_tokens(self) -> int:
        return self.cache.tokens + self._reserved_tokens

    @property
    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens waiting for prefill compute and not served from the cache: the
        waiting requests' whole prompts (matched only at admission here) and what the
        admitted ones have left (SGLang scheduler get_num_waiting_uncached_tokens: waiting
        seqlen - matched prefix, plus the chunked request's remainder)."""
        waiting = sum(r.prefill_target for r in self.waiting)
        return waiting + sum(r.prefill_target - r.prefilled_tokens for r in self.prefilling)

    @property
    def waiting_prompt_tokens(self) -> int:
        """The waiting (not yet admitted) requests' prompt tokens; SGLang adds them to the
        used tokens as num_total_tokens (admitted ones hold their KV here already)."""
        return sum(r.input_tokens for r in self.waiting)

    @property
    def cache_hit_rate(self) -> float:
        s = self.stats
        return s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0

    def flush_cache(self) -> int:
        """Drop every unpinned cached block (SGLang's /flush_cache). Returns tokens freed."""
        return self.cache.clear_unpinned()

    # -- the books, as the scheduler moves requests --------------------------------------

    def _log_decode(self, step: ModelStep, t: float) -> None:
        """A decode step ended at t: the generation throughput SGLang reports."""
        if self._log_start_s is None:
            self._log_start_s = step.start_s
        self._log_steps += 1
        self._log_tokens += len(step.decode)
        if self._log_steps >= DECODE_LOG_INTERVAL:
            elapsed_s = t - self._log_start_s
            if elapsed_s > 0:
                self.gen_throughput = self._log_tokens / elapsed_s
            self._log_steps, self._log_tokens, self._log_start_s = 0, 0, t

    def _cache_computed_blocks(self, req: ModelRequest, now_s: float) -> None:
        """Share the full blocks this request's prefill has computed so far."""
        done = min(len(req.blocks), req.prefilled_tokens // self.profile.block_tokens)
        if done > req.pinned:
            parent = req.blocks[req.pinned - 1] if req.pinned else None
            self.cache.acquire(req.blocks[req.pinned : done], now_s, parent)
            moved = (done - req.pinned) * self.profile.block_tokens
            req.reserved_tokens -= moved
            self._reserved_tokens -= moved
            req.pinned = done

    def _free(self, req: ModelRequest, now_s: float) -> None:
        self._reserved_tokens -= req.reserved_tokens
        req.reserved_tokens = 0
        self.cache.release(req.blocks[: req.pinned], now_s)
        req.pinned = 0
