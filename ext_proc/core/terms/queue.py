"""The wait before the request's own prefill starts: the prefill owed to the requests
ahead of it there, the decode step it meets, the KV it waits for when the pool is full,
lateness that says the backend stalls, and the engine's own count of requests waiting
(estimate.cost.estimate_queue_ms; docs/cost-model.md)."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.backend import BackendState
from ext_proc.core.terms.base import TermInputs
from ext_proc.estimate.cost import QueueItem, estimate_queue_ms, kv_wait_ms, stall_excess_ms
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.vocab.terms import register_term


def queue_ms(
    b: BackendState,
    now_s: float,
    need_kv_tokens: int,
    items: list[QueueItem],
    step_ms: float,
    capacity_tokens: int,
    grace_ms: float,
    report: EngineReport | None,
    priority: int | None = None,
) -> float:
    own_ms = estimate_queue_ms(
        items, step_ms, now_s, b.health.rtt_ms / 2, capacity_tokens, need_kv_tokens, grace_ms
    )
    return max(own_ms, reported_waiting_ms(b, report, priority))


def reported_waiting_ms(
    b: BackendState, report: EngineReport | None, priority: int | None = None
) -> float:
    """The engine's own count of requests waiting (load this router did not route: other
    routers, direct clients), priced at the mean prefill of what we sent there lately,
    plus what this router sent there since that report (0: no report). `priority`: the
    engine schedules by priority and the request is of this class: the router's own
    requests of lower classes waiting there are not ahead of it (the rest of the count,
    of classes the router cannot tell, is)."""
    if report is None or report.waiting is None or b.engine.report_at_s is None:
        return 0.0
    at_s = b.engine.report_at_s
    waiting = report.waiting
    since = 0.0
    for r in b.load.records.values():
        if r.first_byte_s is not None:
            continue
        if priority is not None and r.priority < priority:
            if r.dispatched_s <= at_s:
                waiting -= 1  # counted by the engine, behind this request
            continue
        if r.dispatched_s > at_s:
            since += r.prefill_ms
    return max(0.0, waiting) * b.load.mean_prefill_ms + since


@register_term("queue", ttft=True)
def queue_term_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    if x.replay is not None:  # the replayed wait; the KV wait and the engine's count stay
        kv_ms = kv_wait_ms(x.items, x.step_ms, x.now_s, x.capacity_tokens, x.need_kv_tokens)
        below = x.request.priority if x.by_priority else None
        # a stalled engine: the replay counts steps it is not taking (the stall term)
        wait_ms = x.replay.wait_ms + stall_excess_ms(x.items, x.now_s, x.stall_grace_ms)
        return max(wait_ms, kv_ms, reported_waiting_ms(x.backend, x.report, below))
    return queue_ms(
        x.backend,
        x.now_s,
        x.need_kv_tokens,
        x.items,
        x.step_ms,
        x.capacity_tokens,
        x.stall_grace_ms,
        x.report,
        x.request.priority if x.by_priority else None,
    )
