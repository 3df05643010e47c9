"""LoRA affinity: vLLM batches at most `max_lora` adapters at once, and a request for one
that is neither running nor waiting there while every slot is taken is passed over until
a request of another adapter finishes (vllm/v1/core/sched/scheduler.py): it waits at least
for the soonest of those in flight to finish. 0 where the adapter is already there, a slot
is free, the request names no adapter, or the engine reports no LoRA state."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.vocab.terms import register_term


@register_term("lora_wait", ttft=True, label="LoRA slot")
def lora_wait_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    report = x.report
    if (
        not x.adapter
        or x.model is None
        or report is None
        or report.max_lora is None
        or x.model in report.adapters
        or len(report.adapters) < report.max_lora
        or not x.items
    ):
        return 0.0
    return min(it.remaining_ms(x.now_s, x.step_ms) for it in x.items)
