"""The request's trip to the backend and its first token's back: the probes' smoothed
round trip (docs/cost-model.md)."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.vocab.terms import register_term


@register_term("rtt", ttft=True, label="RTT")
def rtt_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    return x.backend.health.rtt_ms
