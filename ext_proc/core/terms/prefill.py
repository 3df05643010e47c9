"""The request's own prefill there: its uncached tokens after the cached ones, on the
backend's profile (estimate.cost.PrefillModel), at the speed learned for its model."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.vocab.terms import register_term


@register_term("prefill", ttft=True)
def prefill_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    if x.replay is not None:  # the fitted step model's share of its own chunks
        return x.replay.prefill_ms
    model = x.backend.prefill
    return model.prefill_ms(x.uncached_tokens, x.cached_tokens) * x.speed.prefill_factor
