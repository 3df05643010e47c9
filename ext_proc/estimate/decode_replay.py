"""A request's decode time by replaying its decode steps (docs/cost-model.md, "E2E"): the
batch it will decode in, step by step, with the engine profile's step time; and the
multiplier that calibrates it to the E2E's relative error.

After its first token a request generates one token per decode step. Each step carries
every request decoding beside it: those decoding there now and those whose prefill
comes before its own (they will be decoding by then), each until its expected output is
done, when it leaves the batch. Every request's context grows by a token a step. At most
the engine's running limit decode in a step (the rest wait: their share is left out).
The batch changes only when one leaves (or, for a `Decoder` given a start, joins), so
the replay is a sum over those segments (no step loop), each step timed by the
profile's own formula (`EngineProfile.decode_ms`).

Not replayed: the requests arriving while it decodes, whose prefills stall it (SGLang
runs a waiting prefill before the next decode step) and who join its batch. Replaying
them at the backend's recent arrival rate was measured and made the prediction worse
(conversation trace, uniform and mixed-gpus fleets, ts 3 and 6: E2E MAPE +0.2 to +1.9
points): their effect is mostly noise at dispatch (which prompts arrive, how long), and
its mean is what the calibration takes in.

Pure: no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.estimate.profile import EngineProfile


@dataclass(frozen=True)
class Decoder:
    """A request in the batch beside the new one: its context when it joins (prompt and
    tokens generated so far), the tokens it has still to generate, the new request's step
    at which it joins (0: there already) and how many requests it stands for."""

    context_tokens: float
    remaining_tokens: float
    start_step: float = 0.0
    weight: float = 1.0


def replay_decode_ms(
    profile: EngineProfile, context_tokens: float, steps: float, others: Sequence[Decoder]
) -> float:
    """Profile milliseconds of the new request's `steps` decode steps (its output less its
    first token), its context starting at `context_tokens` (its prompt and first token),
    beside `others`."""
    if steps <= 0:
        return 0.0
    # (step, weight joining (+) or leaving (-), weight x (context - step)): the batch's
    # contexts at step t sum to  base + count * t.
    events: list[tuple[float, float, float]] = []
    for o in others:
        end = min(steps, o.start_step + o.remaining_tokens)
        if o.weight <= 0 or end <= o.start_step:
            continue
        offset = o.weight * (o.context_tokens - o.start_step)
        events.append((o.start_step, o.weight, offset))
        events.append((end, -o.weight, -offset))
    events.sort()
    count, base = 1.0, float(context_tokens)
    total_ms, t0, i = 0.0, 0.0, 0
    while t0 < steps:
        while i < len(events) and events[i][0] <= t0:
            count += events[i][1]
            base += events[i][2]
            i += 1
        t1 = min(steps, events[i][0]) if i < len(events) else steps
        length = t1 - t0
        context_sum = length * (base + count * (t0 + t1 - 1) / 2)
        running = min(count, profile.max_running_requests)
        share = running / count  # the running limit: the rest wait
        total_ms += length * profile.decode_ms(math.ceil(running), 0) + (
            profile.decode_per_1k_context_ms * context_sum * share / 1000
        )
        t0 = t1
    return total_ms


# The calibration's step in log space per completion (a few hundred completions to move
# it by 2x; ~3 % noise around its target) and its bounds.
CALIBRATION_STEP = 0.03
MIN_CALIBRATION, MAX_CALIBRATION = 0.2, 5.0
# A step's weight is the relative error's slope, predicted decode / measured E2E, at most
# this: a decode predicted many times too long pulls harder (the least relative error is
# where these slopes balance), but no one completion moves the multiplier by more than
# 4 x CALIBRATION_STEP (measured: 1 to 4 took the learned lengths' E2E MAPE on mixed-gpus
# from 74 / 67 % to 63 / 55 % at ts 3 / 6; 10 gave the same).
MAX_CALIBRATION_WEIGHT = 4.0


class DecodeCalibration:
    """A multiplier on the predicted decode per key (a backend, and whether the output
    length was known or learned), fitted online to the E2E's relative error: each
    completion moves its log by CALIBRATION_STEP x (predicted decode / measured E2E, at
    most MAX_CALIBRATION_WEIGHT), down when the E2E was over-predicted, up when under. It
    settles where over- and under-predictions weigh alike: the E2E prediction of least
    mean relative error (a decode time skewed by other requests' prefills, or an output
    length drawn from a wide distribution, is predicted below its mean: the bias is
    reported beside the MAPE)."""

    def __init__(self) -> None:
        self._log: dict[tuple[str, str], float] = {}
        self.samples: dict[tuple[str, str], int] = {}

    def multiplier(self, key: tuple[str, str]) -> float:
        return math.exp(self._log.get(key, 0.0))

    def observe(
        self,
        key: tuple[str, str],
        predicted_e2e_ms: float,
        predicted_decode_ms: float,
        measured_e2e_ms: float,
    ) -> None:
        """A completion's E2E, predicted with this key's multiplier at the time (its decode
        part `predicted_decode_ms`, multiplied), against measured."""
        if measured_e2e_ms <= 0 or predicted_decode_ms <= 0:
            return
        error = predicted_e2e_ms - measured_e2e_ms
        if error == 0:
            return
        weight = min(MAX_CALIBRATION_WEIGHT, predicted_decode_ms / measured_e2e_ms)
        step = CALIBRATION_STEP * weight * (1.0 if error > 0 else -1.0)
        log = self._log.get(key, 0.0) - step
        self._log[key] = min(math.log(MAX_CALIBRATION), max(math.log(MIN_CALIBRATION), log))
        self.samples[key] = self.samples.get(key, 0) + 1

    def backend_json(self, backend: str) -> dict[str, dict[str, float | int]]:
        """{"known"|"learned": {"multiplier", "samples"}} for the kinds it has seen."""
        return {
            kind: {
                "multiplier": round(self.multiplier((b, kind)), 4),
                "samples": self.samples.get((b, kind), 0),
            }
            for b, kind in self._log
            if b == backend
        }


def length_kind(expected_output_tokens: float, max_output_tokens: int | None) -> str:
    """ "known" when the request's max_tokens is its expected length (the client sets the
    length), else "learned"."""
    if max_output_tokens is not None and expected_output_tokens >= 0.98 * max_output_tokens:
        return "known"
    return "learned"
