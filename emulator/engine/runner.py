"""The model runner: drives the pure `emulator.engine.model.scheduler.EngineModel` in real
time on the event loop's clock and hands each emitted token to its request's
`TokenChannel`; `EngineStats` holds the counters, emission lag and TTFT / ITL histograms
behind /stats, /server_info and /metrics."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from emulator.engine.kv_publisher import KvEventEmitter
from emulator.engine.model.scheduler import Emission, EngineModel
from emulator.engine.parse import GenRequest

# The event loop's timers wake up to 1 ms late (epoll's millisecond timeout is rounded up):
# sleep until this long before a step ends, then yield until it is due.
WAKE_EARLY_S = 0.0015
# Emission lag samples kept for /server_info (a ring: the recent past).
LAG_SAMPLES = 100_000


# Histogram buckets (seconds), SGLang-like ranges.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):  # above the last bucket: counted in +Inf only
            self.counts[i] += 1

    def prometheus(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [f"# TYPE {name} histogram"], 0
        for upper, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{upper}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        lines.append(f"{name}_count{{{labels}}} {self.n}")
        return lines


# How many request bodies /stats digests (the last ones received).
RECENT_BODIES = 32


def body_digest(raw: bytes) -> str:
    """The digest /stats reports a request body by (BLAKE2b, 16 bytes, hex)."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass
class EngineStats:
    """Counters behind GET /stats, token timing behind /server_info and /metrics. Only
    generation requests count: health checks and RTT probes must not look like served
    traffic."""

    requests_total: int = 0  # generation requests received, valid or not
    bad_requests_total: int = 0
    injected_errors_total: int = 0
    completed_total: int = 0  # responses fully written
    in_flight: int = 0  # valid requests being prefilled or decoded
    requests_by_path: Counter[str] = field(default_factory=Counter)
    # Valid generation requests by the priority they carried ("none": no priority).
    requests_by_priority: Counter[str] = field(default_factory=Counter)
    # GET requests by path and query (health, load, model and info probes), answered or
    # not: what a router in front reads, and how often.
    gets: Counter[str] = field(default_factory=Counter)
    tokens_written: int = 0
    # Prompt tokens of the generation requests served (SGLang's health probe is sent with
    # log_metrics=False: not in sglang:prompt_tokens_total).
    prompt_tokens: int = 0
    # How late each token left relative to the model's schedule (ms).
    lag_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    started_cpu_s: float = field(default_factory=time.process_time)  # for CPU per token
    # The last generation requests' bodies as received: (bytes, BLAKE2b digest), so a test
    # can see a proxy passed a body on byte for byte (/stats `recent_bodies`).
    recent_bodies: deque[tuple[int, str]] = field(
        default_factory=lambda: deque(maxlen=RECENT_BODIES)
    )

    def received(self, raw: bytes) -> None:
        """A generation request's body, as it arrived."""
        self.recent_bodies.append((len(raw), body_digest(raw)))

    def record(self, batch: list[Emission], arrival_s: float, last_s: float) -> float:
        """Account tokens about to be written: lag against the schedule, TTFT or ITL.
        Returns the time of the last one."""
        now_s = asyncio.get_running_loop().time()
        for e in batch:
            self.lag_ms.append((now_s - e.time_s) * 1e3)
            if e.index == 0:
                self.ttft_s.observe(e.time_s - arrival_s)
            else:
                self.itl_s.observe(e.time_s - last_s)
            last_s = e.time_s
        self.tokens_written += len(batch)
        return last_s

    def timing(self) -> dict[str, Any]:
        """Emission lag against the model's schedule and CPU per token written."""
        lags = sorted(self.lag_ms)

        def q(p: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(p * len(lags)))], 4) if lags else None

        cpu_s = time.process_time() - self.started_cpu_s
        tokens = self.tokens_written
        return {
            "tokens_written": tokens,
            "lag_ms_p50": q(0.50),
            "lag_ms_p95": q(0.95),
            "lag_ms_p99": q(0.99),
            "lag_ms_max": round(lags[-1], 4) if lags else None,
            "cpu_s": round(cpu_s, 4),
            "cpu_us_per_token": round(cpu_s / tokens * 1e6, 2) if tokens else None,
        }


class TokenChannel:
    """One request's emissions: the runner pushes, the handler takes all that are ready.
    Lighter than an asyncio.Queue, and a handler that fell behind writes a batch at once."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Emission] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, e: Emission) -> None:
        self._items.append(e)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Emission]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class ModelRunner:
    """Drives the engine model on the event loop's clock. One task sleeps until the
    running step ends, advances the model, and hands each emission to its request."""

    def __init__(self, model: EngineModel, events: KvEventEmitter | None = None) -> None:
        self.model = model
        # KV events: the model records its cache changes, published after each step.
        self.events = events
        if events is not None:
            model.cache.events = []
        self._channels: dict[str, TokenChannel] = {}
        self._blocks: dict[str, tuple[int, ...]] = {}
        # When the model last emitted any token (loop time): SGLang's /health is happy
        # with any output since it began.
        self.last_output_s = float("-inf")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, rid: str, req: GenRequest) -> TokenChannel:
        channel = TokenChannel()
        self._channels[rid] = channel
        now = asyncio.get_running_loop().time()
        adapter = req.adapter
        if self.events is not None:
            lora = None if adapter is None else (adapter.name, adapter.int_id)
            self.events.register(req.blocks, req.token_ids, lora)
            self._blocks[rid] = req.blocks
        lora_name, cost = (None, 1.0) if adapter is None else (adapter.name, adapter.slowdown)
        self.model.submit(
            rid,
            req.input_tokens,
            max(1, req.output_tokens),
            req.blocks,
            now,
            lora_name,
            cost,
            req.priority,
        )
        self._wake.set()
        return channel

    def release(self, rid: str) -> None:
        """The handler is done with rid (finished, or the client went away)."""
        if self._channels.pop(rid, None) is not None:
            self.model.cancel(rid, asyncio.get_running_loop().time())
            if self.events is not None:
                self.events.unregister(self._blocks.pop(rid, ()))
            self._wake.set()

    def publish_events(self) -> None:
        """Publish what the cache recorded since the last call (one batch). Called when a
        step ends, as the engines publish with each scheduled step (SGLang
        scheduler_metrics_mixin.py _publish_kv_events; vLLM with the step's outputs):
        what admission or a flush changed goes with the next step's batch."""
        changes = self.model.cache.events
        if self.events is not None and changes:
            self.model.cache.events = []
            self.events.emit(changes)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due_s = self.model.next_event_s()
            if due_s is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay_s = due_s - loop.time()
            if delay_s > WAKE_EARLY_S:
                await asyncio.sleep(delay_s - WAKE_EARLY_S)
            while loop.time() < due_s:  # the last stretch: yield to other tasks, not epoll
                await asyncio.sleep(0)
            emissions = self.model.advance(loop.time())
            for e in emissions:
                channel = self._channels.get(e.rid)
                if channel is not None:
                    channel.push(e)
            if emissions:
                self.last_output_s = loop.time()
            self.publish_events()
