"""What the request's prefill does to the others there: every request decoding there
stalls for it, and every one waiting ahead will be decoding by then (ms of their E2E,
summed; estimate.cost.decode_stall_ms)."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.estimate.cost import decode_stall_ms
from ext_proc.vocab.terms import register_term


@register_term("decode_stall", label="decode stall")
def decode_stall_term_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    return decode_stall_ms(terms["prefill"], x.backend.load.in_flight)
