"""What every cost term may read of one candidate backend for one request, gathered once
by the framework (core.features) before the terms are computed in order."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.core.backend import BackendState
from ext_proc.estimate.cost import QueueItem
from ext_proc.estimate.latency_model import LatencyModel
from ext_proc.estimate.replay import ReplayEstimate
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.vocab.types import RouteRequest


@dataclass(frozen=True)
class TermInputs:
    """One candidate backend for one request as every cost term reads it, gathered once
    per candidate (core.features) before its terms are computed in order. Times in ms,
    sizes in tokens, `now_s` on the router's clock."""

    backend: BackendState
    request: RouteRequest
    now_s: float
    # The model asked for (None: none named), and whether it is a LoRA adapter some
    # engine of the fleet serves.
    model: str | None
    adapter: bool
    input_tokens: int
    cached_tokens: int
    uncached_tokens: int
    # The output budget, and the KV the request will hold (prompt + budget).
    output_tokens: int
    need_kv_tokens: int
    # How fast the backend runs the request's model against its profile (learned).
    speed: LatencyModel
    # Its requests in flight as the queue and KV estimates see them (on an engine that
    # schedules by priority, those ahead of this request: estimate.cost.ahead_of), and its
    # decode step.
    items: list[QueueItem]
    step_ms: float
    # The engine's own last load report, unless stale (None).
    report: EngineReport | None
    # The KV pool the estimates count against, in tokens.
    capacity_tokens: int
    # Stall detection's grace (0 while no first byte has been seen: lateness is noise).
    stall_grace_ms: float
    # The scheduler's replay there (routing.ttft_model: replay; None: the profile's).
    replay: ReplayEstimate | None = None
    # Its engine schedules by priority (the router writes the request's class for it):
    # `items` are those ahead of this request, and the engine's own waiting count loses
    # the router's requests of lower classes.
    by_priority: bool = False
    # The output it is expected to generate (its max_tokens, or learned:
    # estimate/output_length.py; None: its budget, `output_tokens`).
    expected_output_tokens: float | None = None
    # The multiplier on its predicted decode there (estimate/decode_replay.py
    # DecodeCalibration).
    decode_calibration: float = 1.0
