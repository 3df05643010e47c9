"""Priority scheduling's settings, as the engines' flags set them: vLLM's
--scheduling-policy priority (lower values first, always) and SGLang's
--enable-priority-scheduling with --schedule-low-priority-values-first,
--priority-scheduling-preemption-threshold and --disable-priority-preemption. How the
engine model schedules by them (emulator/engine/model/scheduler.py): the waiting queue ordered by
`priority`, running requests preempted by recompute (KV freed, back to wait, prompt and
generated tokens prefilled again):
- "vllm" (v1/core/sched/request_queue.py, scheduler.py schedule): lower first, ties by
  arrival; KV grows a token per decode (no output reserved) and when it runs out, the
  running request with the largest (priority, arrival) is preempted until the decodes
  fit; a step that preempted admits nobody; a waiting request never preempts.
- "sglang" (managers/schedule_policy.py _sort_by_priority_and_fcfs, preempt_to_schedule;
  scheduler.py _set_or_validate_priority): higher first unless low_values_first, ties by
  entry into the queue, no priority is the lowest; admission takes one prefill batch (the
  chunk budget) at a time; a waiting head that finds the batch full (slots or KV)
  preempts decoding requests worse by more than the threshold, worst (then latest)
  first, if they free enough."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")


def priority_label(priority: int | None) -> str:
    return "none" if priority is None else str(priority)


# SGLang's default preemption threshold (server_args.py
# priority_scheduling_preemption_threshold = 10).
SGLANG_PREEMPTION_THRESHOLD = 10


@dataclass(frozen=True)
class PriorityScheduling:
    """The engine's priority scheduling (module docstring). `low_values_first`: vLLM
    always; SGLang with --schedule-low-priority-values-first. `preemption_threshold` and
    `preemption` (off: --disable-priority-preemption) are SGLang's; vLLM preempts on
    KV shortage whatever they say."""

    low_values_first: bool = False
    preemption_threshold: int = SGLANG_PREEMPTION_THRESHOLD
    preemption: bool = True

    @classmethod
    def vllm(cls) -> PriorityScheduling:
        return cls(low_values_first=True)

    def rank(self, priority: int | None, scheduler: str) -> int:
        """Lower is served first. No priority: vLLM's default 0 (protocol field default);
        SGLang's lowest (sys.maxsize or -sys.maxsize - 1, _set_or_validate_priority)."""
        if priority is None:
            if scheduler == "vllm":
                priority = 0
            else:
                priority = sys.maxsize if self.low_values_first else -sys.maxsize - 1
        return priority if self.low_values_first else -priority


def sglang_victims(
    rank: int,
    running: Iterable[R],
    order: Callable[[R], tuple[int, float]],
    frees: Callable[[R], int],
    threshold: int,
    need_tokens: int,
) -> list[R]:
    """Which running requests a waiting one of `rank` preempts (SGLang
    schedule_policy.py preempt_to_schedule): the worst first (largest rank, then the
    latest queued; `order` gives both), each while its rank is worse by more than
    `threshold`, until what they free (`frees`) covers `need_tokens`. None ([]) when the
    ones allowed cannot cover it."""
    victims: list[R] = []
    for r in sorted(running, key=lambda r: (-order(r)[0], -order(r)[1])):
        if order(r)[0] - rank <= threshold:
            break
        victims.append(r)
        need_tokens -= frees(r)
        if need_tokens <= 0:
            return victims
    return []
