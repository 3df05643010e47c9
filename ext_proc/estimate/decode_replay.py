"""A request's decode time by replaying its decode steps (docs/cost-model.md, "E2E"): the
batch it will decode in, step by step, with the engine profile's step time.

After its first token a request generates one token per decode step. Each step carries
every request decoding beside it: those decoding there now and those whose prefill comes
before its own (they will be decoding by then), each until its own expected output is
done, then it leaves the batch; every request's context grows by a token a step. At most
the engine's running limit decode in a step (the rest wait: their share is left out).
Arrivals after it are not foreseen. The batch changes only when one of the others ends,
so the replay is a sum over those segments (no step loop), each step timed by the
profile's own formula (`EngineProfile.decode_ms`); the backend's learned decode speed
(estimate/latency_model.py) scales the total.

Pure: no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.estimate.profile import EngineProfile


@dataclass(frozen=True)
class Decoder:
    """A request in the batch beside the new one: its context now (prompt and tokens
    generated so far) and the tokens it has still to generate."""

    context_tokens: float
    remaining_tokens: float


def replay_decode_ms(
    profile: EngineProfile, context_tokens: float, steps: float, others: Sequence[Decoder]
) -> float:
    """Profile milliseconds of the new request's `steps` decode steps (its output less its
    first token), its context starting at `context_tokens` (its prompt and first token),
    beside `others`."""
    if steps <= 0:
        return 0.0
    # Segments [t0, t1) of its steps in which the same others decode: each other stays
    # for min(remaining, steps) steps.
    ends = sorted(min(max(0.0, o.remaining_tokens), steps) for o in others)
    total_ms = 0.0
    t0 = 0.0
    live = [o for o in others if o.remaining_tokens > 0]
    live.sort(key=lambda o: o.remaining_tokens)
    i = 0
    # the context summed over the live decoders at step 0, and their count
    context0 = context_tokens + sum(o.context_tokens for o in live)
    count = 1 + len(live)
    for t1 in [*ends, steps]:
        if t1 > t0:
            length = t1 - t0
            # contexts at t0 (each grew by t0), summed over its steps: + count * (0..len-1)
            at_t0 = context0 + count * t0
            context_sum = length * at_t0 + count * length * (length - 1) / 2
            running = min(count, profile.max_running_requests)
            share = running / count  # the running limit: the rest wait
            per_step = profile.decode_ms(running, 0)
            total_ms += length * per_step + (
                profile.decode_per_1k_context_ms * context_sum * share / 1000
            )
            t0 = t1
        # the other ending at t1 leaves the batch
        while i < len(live) and min(live[i].remaining_tokens, steps) <= t1:
            context0 -= live[i].context_tokens
            count -= 1
            i += 1
    return total_ms
