"""The request's own decode there, predicted: its output budget x the decode step it comes
at (every request in flight there and itself in the batch, at most the engine's running
limit; docs/cost-model.md, "What is predicted"). Not in any score: the predicted E2E."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.backend import BackendState
from ext_proc.core.terms.base import TermInputs
from ext_proc.vocab.terms import register_term


def newcomer_step_ms(b: BackendState, input_tokens: int, decode_factor: float) -> float:
    """The decode step a newcomer's tokens come at there: with every request in flight
    (those ahead will be decoding by the time it is) and itself in the batch, at most the
    engine's running limit (the rest wait), their prompts as the context. A dispatch-time
    estimate: who finishes or arrives while it decodes is not foreseen."""
    profile = b.profile
    batch = b.load.in_flight + 1
    running = min(batch, profile.max_running_requests)
    context = (b.load.in_flight_tokens + input_tokens) * running // batch
    return profile.decode_ms(running, context) * decode_factor


@register_term("decode", cost=False)
def decode_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    step_ms = newcomer_step_ms(x.backend, x.input_tokens, x.speed.decode_factor)
    return x.output_tokens * step_ms
