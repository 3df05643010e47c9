"""The engine model and its runner as a P/D twin needs them: KV reserved in the pool while
a transfer lands (the decode's preallocation, the prefill's KV held for its decode), and a
request admitted on KV that arrived instead of a prefill of its own. `DisaggStats` holds
the P/D queue counts and transfer figures /v1/loads and /metrics report.

How a transferred request starts, as each engine starts it:
- SGLang (disaggregation/decode.py): the transfer carries the prefill's first token and
  its cached-token count (DecodeTransferQueue._commit_transfer_to_req); the request joins
  a "prebuilt" batch that runs no forward pass and emits that token at once, then decodes
  (SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch, at most the free batch
  slots).
- vLLM (v1/core/sched/scheduler.py with NIXL, nixl/scheduler.py): the loaded prompt tokens
  count as computed (and as cached: num_cached_tokens = num_computed_tokens when first
  scheduled), and the scheduler computes the last prompt token again for its logits: a
  one-token prefill in the next step, which emits the first token.

Both count against the batch slots (max_running_requests / max_num_seqs) like any running
request; a prebuilt request that finds them full waits (counted as waiting).

This subclass reaches into EngineModel's internals (ModelRequest, _reserved_tokens, requests,
prefilling, decoding, _plan, _emit, _free): keep it in step with emulator/engine/model/
(queues.py holds the books, scheduler.py the planning).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from emulator.engine.kv_publisher import KvEventEmitter
from emulator.engine.model.queues import DECODE, PREFILL, Emission, ModelRequest
from emulator.engine.model.scheduler import EngineModel, PriorityScheduling
from emulator.engine.parse import GenRequest
from emulator.engine.runner import Histogram, ModelRunner, TokenChannel
from ext_proc.estimate.profile import EngineProfile

# SGLang's KV transfer histograms (metrics/collector.py SchedulerMetricsCollector).
SPEED_BUCKETS_GB_S = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
# vLLM's NIXL histograms (kv_connector/v1/nixl stats.py NixlPromMetrics).
XFER_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))


@dataclass
class DisaggStats:
    """P/D queue counts (SGLang's names: scheduler_metrics_mixin.py stats) and transfers."""

    prefill_bootstrap: int = 0  # prefill: waiting for its decode's KV indices
    prefill_inflight: int = 0  # prefill: prefilled, its KV on the way
    decode_prealloc: int = 0  # decode: handshake, then waiting for KV room
    decode_transfer: int = 0  # decode: KV room reserved, the KV arriving
    bootstrap_failed: int = 0
    transfer_failed: int = 0
    kv_expired: int = 0  # vLLM producer: held KV no decode read in time
    transfers: int = 0
    # decode: the KV received, by the side-server address the prefill named (SGLang's
    # bootstrap_host:port, vLLM's remote_host:port): which prefill engine each came from
    received_from: Counter[str] = field(default_factory=Counter)
    last_speed_gb_s: float = 0.0
    last_latency_ms: float = 0.0
    speed_gb_s: Histogram = field(default_factory=lambda: Histogram(SPEED_BUCKETS_GB_S))
    latency_ms: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_MS))
    xfer_s: Histogram = field(default_factory=lambda: Histogram(XFER_BUCKETS_S))
    engine_bytes: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))

    def transferred(self, engine_bytes: int, seconds: float) -> None:
        """One transfer done: its size in the engine's bytes and how long it took."""
        seconds = max(seconds, 1e-9)
        self.transfers += 1
        self.last_speed_gb_s = engine_bytes / seconds / 1e9
        self.last_latency_ms = seconds * 1e3
        self.speed_gb_s.observe(self.last_speed_gb_s)
        self.latency_ms.observe(self.last_latency_ms)
        self.xfer_s.observe(seconds)
        self.engine_bytes.observe(float(engine_bytes))


class PrebuiltModel(EngineModel):
    """EngineModel with reservations for KV in transit and requests started on it."""

    def __init__(
        self,
        profile: EngineProfile,
        rng: random.Random,
        max_loras: int | None = None,
        scheduler: str = "sglang",
        priority: PriorityScheduling | None = None,
    ) -> None:
        super().__init__(profile, rng, max_loras, scheduler, priority)
        self.disagg = DisaggStats()
        # Tokens reserved per key (a request id, or a prefill's held KV).
        self.reservations: dict[str, int] = {}
        # First tokens due now (SGLang's prebuilt batch), returned by the next advance.
        self._pending: list[Emission] = []
        # Prebuilt requests waiting for a batch slot, with whether token 0 is known.
        self._slot_waiting: deque[tuple[ModelRequest, bool]] = deque()

    # -- reservations -----------------------------------------------------------------

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` more tokens of KV fit, evicting unused cache blocks if need be."""
        short = tokens - (self.profile.kv_capacity_tokens - self.used_tokens)
        return short <= 0 or self.cache.evict(short) >= short

    def reserve(self, key: str, tokens: int) -> None:
        self.release(key)
        self.reservations[key] = tokens
        self._reserved_tokens += tokens

    def release(self, key: str) -> None:
        self._reserved_tokens -= self.reservations.pop(key, 0)

    # -- prebuilt requests ------------------------------------------------------------

    def submit_prebuilt(
        self,
        rid: str,
        input_tokens: int,
        output_tokens: int,
        now_s: float,
        cached_tokens: int,
        first_token_known: bool,
    ) -> None:
        """A request whose prompt KV arrived: its reservation becomes the request's
        (prompt and output), and it starts as SGLang or vLLM starts it (module docstring)."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} already in the engine")
        self.release(rid)
        req = ModelRequest(rid, (), input_tokens, max(1, output_tokens), now_s)
        req.cached_tokens = cached_tokens
        req.reserved_tokens = input_tokens + req.output_tokens
        self._reserved_tokens += req.reserved_tokens
        self.requests[rid] = req
        self.stats.requests_admitted += 1
        self.stats.prompt_tokens += input_tokens
        self.stats.cached_tokens += cached_tokens
        self._slot_waiting.append((req, first_token_known))
        self._admit_prebuilt(now_s)
        if self.step is None or self.step.start_s >= now_s:
            self.step = None
            self._plan(now_s)

    def _admit_prebuilt(self, now_s: float) -> None:
        while self._slot_waiting and self.num_running < self.profile.max_running_requests:
            req, first_known = self._slot_waiting.popleft()
            if first_known:
                req.state = DECODE
                self.decoding[req.rid] = req
                self._emit(req, now_s, self._pending)
            else:
                req.state = PREFILL
                req.admitted_tokens = req.prefilled_tokens = req.input_tokens - 1
                self.prefilling.append(req)

    def cancel(self, rid: str, now_s: float) -> None:
        self.release(rid)
        for i, (req, _) in enumerate(self._slot_waiting):
            if req.rid == rid:
                del self._slot_waiting[i]
                self.requests.pop(rid, None)
                self._free(req, now_s)
                return
        super().cancel(rid, now_s)

    def _plan(self, now_s: float) -> None:
        self._admit_prebuilt(now_s)
        super()._plan(now_s)

    def next_event_s(self) -> float | None:
        if self._pending:
            return self._pending[0].time_s
        return super().next_event_s()

    def advance(self, now_s: float) -> list[Emission]:
        out, self._pending = self._pending, []
        return out + super().advance(now_s)

    @property
    def kv_coming(self) -> int:
        """Requests whose KV is still to come, counted as waiting where the engine does:
        vLLM's waiting queue holds them (waiting for blocks, then RequestStatus.
        WAITING_FOR_REMOTE_KVS); SGLang keeps them in its P/D queues, reported apart."""
        d = self.disagg
        return d.decode_prealloc + d.decode_transfer if self.scheduler == "vllm" else 0

    @property
    def num_waiting(self) -> int:
        return super().num_waiting + len(self._slot_waiting) + self.kv_coming

    @property
    def num_queued(self) -> int:
        return super().num_queued + len(self._slot_waiting) + self.kv_coming


class DisaggRunner(ModelRunner):
    """The model runner with a way in for prebuilt requests."""

    model: PrebuiltModel

    def __init__(self, model: EngineModel, events: KvEventEmitter | None = None) -> None:
        if not isinstance(model, PrebuiltModel):
            raise TypeError("a P/D twin runs a PrebuiltModel")
        super().__init__(model, events)

    def submit_prebuilt(
        self, rid: str, req: GenRequest, cached_tokens: int, first_token_known: bool
    ) -> TokenChannel:
        channel = TokenChannel()
        self._channels[rid] = channel
        now = asyncio.get_running_loop().time()
        self.model.submit_prebuilt(
            rid, req.input_tokens, req.output_tokens, now, cached_tokens, first_token_known
        )
        self._wake.set()
        return channel
