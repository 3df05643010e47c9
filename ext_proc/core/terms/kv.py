"""The wait beyond the queue's when the backend's KV pool is nearly full: until requests
finishing first free enough KV within a margin of the pool (estimate.cost.kv_headroom_ms)."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.estimate.cost import KV_HEADROOM_MARGIN, kv_headroom_ms
from ext_proc.vocab.terms import register_term


@register_term("kv", label="KV wait")
def kv_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    waited_ms = terms["queue"] + terms["lora_wait"]
    return kv_headroom_ms(
        x.items,
        x.step_ms,
        x.now_s,
        x.capacity_tokens,
        x.need_kv_tokens,
        KV_HEADROOM_MARGIN,
        waited_ms,
    )
