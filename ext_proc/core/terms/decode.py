"""The request's own decode there, predicted: its decode steps replayed in the batch it
will decode in (estimate/decode_replay.py: those decoding there and those ahead of it,
each until its expected output is done), with the profile's step time, the backend's
learned decode speed and its decode calibration (docs/cost-model.md, "E2E"). Not in any
score: the predicted E2E."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.core.terms.base import TermInputs
from ext_proc.estimate.cost import QueueItem
from ext_proc.estimate.decode_replay import Decoder, replay_decode_ms
from ext_proc.vocab.terms import register_term


def decoders(items: list[QueueItem], now_s: float, step_ms: float) -> list[Decoder]:
    """The requests in flight as the decode replay sees them: a decoding one has generated
    a token a step since its first (at the backend's step now), of its expected output."""
    out = []
    for it in items:
        expected = (
            it.output_tokens if it.expected_output_tokens is None else it.expected_output_tokens
        )
        prompt = it.uncached_tokens + it.cached_tokens
        if it.first_byte_s is None:
            out.append(Decoder(prompt, expected))
            continue
        done = 1 + max(0.0, now_s - it.first_byte_s) * 1000 / step_ms if step_ms > 0 else expected
        out.append(Decoder(prompt + done, max(0.0, expected - done)))
    return out


@register_term("decode", cost=False)
def decode_ms(x: TermInputs, terms: Mapping[str, float]) -> float:
    out = x.output_tokens if x.expected_output_tokens is None else x.expected_output_tokens
    others = decoders(x.items, x.now_s, x.step_ms)
    profile_ms = replay_decode_ms(x.backend.profile, x.input_tokens + 1, out - 1, others)
    return profile_ms * x.speed.decode_factor * x.decode_calibration
