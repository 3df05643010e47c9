"""Cost terms, in milliseconds: what it would take to get a request's first token from
each backend, and what sending it there does to the requests already there. The
framework computes the terms; policies weigh and compare them (docs/cost-model.md).

    cost_i = w_rtt * RTT_i + w_queue * Tqueue_i + Tprefill_i                    (time form,
                                                         `gorgo_time3`: the paper's three terms)
           + w_stall * Tstall_i + w_kv * Tkv_i                                 (`gorgo`)
    cost_i = w_rtt * RTT_i + uncached_tokens_i + w_queue * in_flight_tokens_i    (token form,
                                                                  the GORGO paper's code)
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.estimate.profile import EngineProfile
from ext_proc.vocab.types import Weights


def time_cost_ms(w: Weights, rtt_ms: float, queue_ms: float, prefill_ms: float) -> float:
    return w.rtt * rtt_ms + w.queue * queue_ms + prefill_ms


def token_cost(w: Weights, rtt_ms: float, uncached_tokens: int, in_flight_tokens: int) -> float:
    return w.rtt * rtt_ms + uncached_tokens + w.queue * in_flight_tokens


def decode_stall_ms(prefill_ms: float, held_requests: int) -> float:
    """The stall a newcomer's prefill inflicts on the requests already on a backend, in ms
    of their E2E, summed. Prefill runs before decode (chunked, FCFS; SGLang's default), so
    no request there emits a token while it prefills: every request decoding there stalls
    for the whole prefill, and every request still waiting ahead of it will be decoding by
    then (its own prefill comes first)."""
    return prefill_ms * held_requests


class PrefillModel:
    """Milliseconds to prefill U uncached tokens after C cached ones, on one backend's
    profile: base_ms per chunk + per_token_ms * U * (1 + (C + U/2) / context_tokens).
    How far a backend's engine is from its profile is learned apart, as a speed factor
    (ext_proc/estimate/latency_model.py), which replaced refitting these coefficients."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.base_ms = profile.prefill_base_ms
        self.per_token_ms = 1000.0 / profile.prefill_tokens_per_s

    def prefill_ms(self, uncached_tokens: int, cached_tokens: int) -> float:
        if uncached_tokens <= 0:
            return 0.0
        # One base cost per chunk: a long prompt is prefilled in several steps.
        chunks = -(-uncached_tokens // self.profile.chunk_tokens)
        work = uncached_tokens * (
            1 + (cached_tokens + uncached_tokens / 2) / self.profile.prefill_context_tokens
        )
        return chunks * self.base_ms + self.per_token_ms * work


@dataclass(frozen=True)
class QueueItem:
    """One request in flight on a backend, as the queue estimate needs it."""

    prefill_ms: float
    # KV the request holds until it finishes: prompt + expected output tokens.
    kv_tokens: int
    output_tokens: int
    dispatched_s: float
    # None while it waits for its first token.
    first_byte_s: float | None
    # When its first token was expected (dispatch + estimated TTFT); None: no estimate.
    due_s: float | None = None
    # Its prompt: tokens to prefill, after those cached (the replay, estimate/replay.py).
    uncached_tokens: int = 0
    cached_tokens: int = 0
    # Its objective's priority (higher: more important; `ahead_of`).
    priority: int = 0
    # The output it is expected to generate (None: its budget, `output_tokens`).
    expected_output_tokens: float | None = None

    def remaining_ms(self, now_s: float, step_ms: float) -> float:
        """Until it finishes and frees its KV."""
        if self.first_byte_s is None:
            return self.prefill_ms + self.output_tokens * step_ms
        done = (now_s - self.first_byte_s) * 1000 / step_ms if step_ms > 0 else self.output_tokens
        return max(0.0, self.output_tokens - done) * step_ms


def ahead_of(items: list[QueueItem], priority: int) -> list[QueueItem]:
    """What a request of `priority` finds ahead of it on a backend whose engine schedules
    by priority (ext_proc/feeds/server_info.py), as the queue and KV estimates count it:
    the requests of its priority and above (sent before it: ties go by arrival), and of
    those below only the oldest still waiting for its first token, whose prefill the
    engine is at work on (a running request's chunks go on: vLLM and SGLang reorder their
    waiting queues, v1/core/sched/scheduler.py, managers/schedule_policy.py). The other
    requests below it wait until it is served, and those running hold no KV it needs: the
    engine preempts them when it runs short (vLLM the running request of the lowest
    priority, latest arrival; SGLang running lower-priority requests past
    --priority-scheduling-preemption-threshold), so their KV is not waited for."""
    if all(it.priority >= priority for it in items):
        return items
    below = [it for it in items if it.priority < priority and it.first_byte_s is None]
    head = min(below, key=lambda it: it.dispatched_s) if below else None
    return [it for it in items if it.priority >= priority or it is head]


def estimate_queue_ms(
    items: list[QueueItem],
    decode_step_ms: float,
    now_s: float,
    one_way_ms: float,
    kv_capacity_tokens: int,
    need_kv_tokens: int,
    stall_grace_ms: float = 0.0,
) -> float:
    """Time a new request would wait on this backend before its own prefill starts.

    Prefill runs before decode (FCFS), so the wait is the prefill still owed to requests
    dispatched earlier and not yet past their first token (the oldest one credited with
    the time since it arrived, never more than its own prefill: an engine blocked on KV
    makes no progress), plus on average half a decode step already running.
    When the KV pool cannot hold the new request next to what is in flight, it is not
    admitted until enough requests finish: the wait is at least that long.
    A request whose first token is late by more than max(stall_grace_ms, its own estimate)
    means the backend is stalled or far slower than modelled: everything behind it waits
    at least as long again, so the excess lateness is added (0 grace = off).
    """
    pending = [it for it in items if it.first_byte_s is None]
    half_step_ms = decode_step_ms / 2 if len(items) > len(pending) else 0.0
    prefill_wait_ms = 0.0
    if pending:
        head = min(pending, key=lambda it: it.dispatched_s)
        elapsed_ms = max(0.0, (now_s - head.dispatched_s) * 1000 - one_way_ms)
        others_ms = sum(it.prefill_ms for it in pending) - head.prefill_ms
        prefill_wait_ms = others_ms + max(0.0, head.prefill_ms - elapsed_ms)
        prefill_wait_ms += stall_excess_ms(pending, now_s, stall_grace_ms)
    return max(
        prefill_wait_ms + half_step_ms,
        kv_wait_ms(items, decode_step_ms, now_s, kv_capacity_tokens, need_kv_tokens),
    )


def stall_excess_ms(items: list[QueueItem], now_s: float, stall_grace_ms: float) -> float:
    """The most a request waiting for its first token there is late by, past max(the
    grace, its own estimate): what everything behind it waits again (0 grace: off)."""
    if not stall_grace_ms:
        return 0.0
    pending = [it for it in items if it.first_byte_s is None]
    return max((late_ms(it, now_s, stall_grace_ms) for it in pending), default=0.0)


def unstarted_ms(
    items: list[QueueItem],
    now_s: float,
    one_way_ms: float,
    decode_step_ms: float,
    kv_capacity_tokens: int,
    need_kv_tokens: int,
) -> float:
    """The engine time owed to requests sent to this backend whose prefill has not begun
    there (flow control's room, ext_proc/flow/room.py): the prefill of those waiting for
    their first token, but the oldest one's once it has had time to arrive (the engine
    is at work on it, chunk by chunk beside the others); or the wait for KV when the pool
    cannot hold one more. Unlike the queue term, no lateness: a late request is work
    under way, not work waiting."""
    pending = [it for it in items if it.first_byte_s is None]
    owed_ms = sum(it.prefill_ms for it in pending)
    if pending:
        # the engine has worked through the backlog since its oldest request arrived
        head_s = min(it.dispatched_s for it in pending)
        owed_ms = max(0.0, owed_ms - max(0.0, (now_s - head_s) * 1000 - one_way_ms))
    kv_ms = kv_wait_ms(items, decode_step_ms, now_s, kv_capacity_tokens, need_kv_tokens)
    return max(owed_ms, kv_ms)


def late_ms(item: QueueItem, now_s: float, grace_ms: float) -> float:
    """How far past its due time, beyond the grace, a request still waits for its first
    token (0 when on time or without an estimate)."""
    if item.due_s is None:
        return 0.0
    due_in_ms = (item.due_s - item.dispatched_s) * 1000
    over_ms = (now_s - item.due_s) * 1000
    return max(0.0, over_ms - max(grace_ms, due_in_ms))


# The KV headroom term's margin: the share of a backend's pool beyond which admission
# probably waits (the router's KV count books outputs at their budget, not their length).
KV_HEADROOM_MARGIN = 0.1


def kv_headroom_ms(
    items: list[QueueItem],
    step_ms: float,
    now_s: float,
    capacity_tokens: int,
    need_tokens: int,
    margin: float,
    queue_ms: float,
) -> float:
    """The wait beyond queue_ms that a request meets when the backend's KV pool is nearly
    full: until the requests finishing first free enough KV for need_tokens next to what
    is in flight, in a pool `margin` smaller than its capacity (the queue estimate already
    counts the wait for the full pool; the two waits overlap, so only the excess counts).
    The router's KV count is an estimate (each request is booked at its output budget;
    the engine's cache pins the blocks in use), and near the edge an engine queues
    newcomers or evicts (SGLang retracts running decodes, which then redo their prefill):
    within the margin the wait is likely, and everything queued behind it waits too."""
    soft_tokens = int(capacity_tokens * (1.0 - margin))
    return max(0.0, kv_wait_ms(items, step_ms, now_s, soft_tokens, need_tokens) - queue_ms)


def kv_wait_ms(
    items: list[QueueItem], step_ms: float, now_s: float, capacity_tokens: int, need_tokens: int
) -> float:
    """How long until the requests finishing first free enough KV for need_tokens."""
    excess = sum(it.kv_tokens for it in items) + need_tokens - capacity_tokens
    if excess <= 0:
        return 0.0
    freed, wait_ms = 0, 0.0
    for remaining_ms, kv in sorted((it.remaining_ms(now_s, step_ms), it.kv_tokens) for it in items):
        freed, wait_ms = freed + kv, remaining_ms
        if freed >= excess:
            break
    return wait_ms
