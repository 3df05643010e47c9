"""A backend's latency model learned online: how much faster or slower its
engine is than its profile says, for prefill and for decode.

The profile gives the shape (prefill per chunk and per token of context-weighted work, a
decode step that grows with the batch and its context: ext_proc/estimate/profile.py); a
backend of other GPUs or another model keeps that shape at another speed. So each
completion teaches two speed factors, each the robust, forgetting mean of a log ratio
(`OnlineFit` on a constant: every completion counts alike, whatever its size, and a ratio's
outliers are clipped in log space; a backend that changes is relearned):
- prefill: the engine's part of the TTFT it had (TTFT - the RTT at dispatch) against what
  the profile predicted for it (the queue of prefill ahead plus its own prefill, both in
  profile milliseconds);
- decode: its mean step ((E2E - TTFT) / (output tokens - 1)) against the profile's step
  for the batch it was predicted to join.
The router multiplies its profile estimates by them; the features stay physical, so the
model extrapolates to loads it has not seen (a factor, not a table of loads).

Pure: no clock.
"""

from __future__ import annotations

import math

from ext_proc.estimate.online_fit import OnlineFit

# The profile's speed is worth this many completions: it holds for the first few only.
PRIOR_WEIGHT = 2.0
# Geometric forgetting per sample: an effective memory of ~100 completions.
FORGET = 0.99
# The spread of a log ratio expected before any is seen (~30 %): the first completions are
# clipped like the rest, so one request stuck behind something unseen cannot make its
# backend look many times slower.
PRIOR_SCALE = 0.3
# Factors are kept within this range of the profile's speed (a model gone wrong must not
# make a backend look free or hopeless).
MIN_FACTOR, MAX_FACTOR = 0.05, 20.0
# Decode samples need this many output tokens (fewer say little about the step).
MIN_DECODE_TOKENS = 8


class LatencyModel:
    """Speed factors of one backend against its profile (1.0 = as the profile says)."""

    def __init__(
        self, learn: bool = True, prefill_factor: float = 1.0, decode_factor: float = 1.0
    ) -> None:
        """The factors start at the profile's speed (1.0), or at a related model's (a LoRA
        adapter starts from its engine's base model)."""
        self.learn = learn
        # Each fits log(observed / profile) on a constant: its theta is log(factor).
        prior = math.log(prefill_factor), math.log(decode_factor)
        self._prefill = OnlineFit((prior[0],), PRIOR_WEIGHT, FORGET, scale=PRIOR_SCALE)
        self._decode = OnlineFit((prior[1],), PRIOR_WEIGHT, FORGET, scale=PRIOR_SCALE)
        self.prefill_factor = prefill_factor
        self.decode_factor = decode_factor

    def observe_ttft(self, profile_engine_ms: float, observed_engine_ms: float) -> None:
        """A completion's engine time to its first token against the profile's prediction
        of it (unscaled by this model)."""
        if not self.learn or profile_engine_ms <= 0 or observed_engine_ms <= 0:
            return
        self._prefill.update(_ONE, math.log(observed_engine_ms / profile_engine_ms))
        self.prefill_factor = _bounded(self._prefill.theta[0])

    def observe_decode(self, profile_step_ms: float, observed_step_ms: float) -> None:
        if not self.learn or profile_step_ms <= 0 or observed_step_ms <= 0:
            return
        self._decode.update(_ONE, math.log(observed_step_ms / profile_step_ms))
        self.decode_factor = _bounded(self._decode.theta[0])

    @property
    def samples(self) -> tuple[int, int]:
        return self._prefill.samples, self._decode.samples

    def as_json(self) -> dict[str, float | int]:
        return {
            "prefill_factor": round(self.prefill_factor, 4),
            "decode_factor": round(self.decode_factor, 4),
            "prefill_samples": self._prefill.samples,
            "decode_samples": self._decode.samples,
        }


_ONE = (1.0,)


def _bounded(log_factor: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, math.exp(log_factor)))
