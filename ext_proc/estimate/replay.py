"""TTFT by replaying the engine's scheduler over what the router knows is on a backend,
with the step time a small physical model fitted online (docs/cost-model.md, "Replay").

What is on the backend: the requests sent there (this router's and its peers') that have
not had their first token, in the order sent, each with its uncached and cached prompt
tokens, and the requests decoding there with their context. The replay plans the
engine's steps until the new request's last prefill chunk, as the engine plans them:

- "sglang" (managers/scheduler.py `get_next_batch_to_run`, schedule_policy.py): a prefill
  batch runs before the decode batch, so the waiting prompts are prefilled back to back
  in chunks of `chunked_prefill_size` tokens (several short prompts share one chunk);
  the decode step already running when the request arrives is waited out (half a step
  on average).
- "vllm" (v1/core/sched/scheduler.py `schedule`): each step has a token budget
  (`max_num_batched_tokens`); the running decodes take a token each first, the prefills
  share what is left in arrival order, and a request whose prefill ends decodes in the
  steps after. One forward pass carries both.

Both are closed forms (no step loop): a chunked prefill's attention work sums to the
same u * (c + u/2) however it is split, so only the number of steps depends on the
chunking.

A step takes  a + b * prefill tokens + e * attention work + c * decodes + d * context
read by the decodes  (the engine profile's own formulas, estimate/profile.py). The
replay returns how much of each of those the request's wait and prefill hold (its
`features`); the time is their dot product with the coefficients. `StepFit` learns one
multiplier per coefficient per backend from every streamed completion, starting from the
profile's: a common speed in log space and a shape tied to the profile's by a prior that
is never forgotten (estimate/online_fit.py), outliers not fitted; and it falls back to the
profile's coefficients while its recent error is worse than theirs.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ext_proc.estimate.cost import QueueItem
from ext_proc.estimate.online_fit import MAD_TO_SIGMA, OnlineFit, PriorTiedFit
from ext_proc.estimate.profile import EngineProfile

SCHEDULERS = ("sglang", "vllm")
# The features, in the coefficients' order: forward passes, prefill tokens (thousands),
# attention work (u * (c + u/2), millions of token pairs), decode tokens, and context
# tokens read by decodes (thousands). Requests that reach the engine before the last
# step is planned fill its room (a short prompt sent just before a long one waits for the
# long one's first chunk): that room is steps x budget - tokens, so the fitted step and
# token coefficients take it in without a feature of its own.
FEATURES = ("steps", "prefill_ktokens", "attention_mpairs", "decodes", "decode_context_ktokens")
Features = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Prompt:
    """A prompt still to prefill there: its uncached tokens after its cached ones."""

    uncached_tokens: int
    cached_tokens: int


def profile_coefficients(p: EngineProfile) -> Features:
    """The step model's coefficients (ms per feature unit) the profile implies."""
    per_token_ms = 1000.0 / p.prefill_tokens_per_s
    return np.array(
        [
            p.prefill_base_ms,
            per_token_ms * 1000,
            per_token_ms / p.prefill_context_tokens * 1e6,
            p.decode_per_request_ms,
            p.decode_per_1k_context_ms,
        ]
    )


def _attention(p: Prompt) -> float:
    return p.uncached_tokens * (p.cached_tokens + p.uncached_tokens / 2)


def replay_features(
    scheduler: str,
    budget_tokens: int,
    ahead: Sequence[Prompt],
    new: Prompt,
    decoding: int,
    decode_context_tokens: int,
) -> tuple[Features, Features]:
    """(the features until the last prompt ahead is prefilled, the features until the
    new request's last chunk is): the wait and the wait plus its own prefill."""
    if scheduler == "vllm":
        return _budgeted(budget_tokens, ahead, new, decoding, decode_context_tokens)
    return _prefill_first(budget_tokens, ahead, new, decoding, decode_context_tokens)


def _prefill_first(
    budget: int, ahead: Sequence[Prompt], new: Prompt, decoding: int, context: int
) -> tuple[Features, Features]:
    # the decode step under way when it arrives, half of one on average
    half = 0.5 if decoding else 0.0
    running = np.array([half, 0.0, 0.0, half * decoding, half * context / 1000])
    tokens = float(sum(p.uncached_tokens for p in ahead))
    attention = sum(_attention(p) for p in ahead)

    def until(t: float, a: float) -> Features:
        steps = math.ceil(t / budget) if t > 0 else 0
        return np.asarray(running + np.array([steps, t / 1000, a / 1e6, 0.0, 0.0]), dtype=float)

    total_t = tokens + max(1, new.uncached_tokens)
    return until(tokens, attention), until(total_t, attention + _attention(new))


def _budgeted(
    budget: int, ahead: Sequence[Prompt], new: Prompt, decoding: int, context: int
) -> tuple[Features, Features]:
    per_step = max(1, budget - decoding)  # the decodes take their tokens first
    prompts = [*ahead, new]
    sizes = [p.uncached_tokens for p in ahead] + [max(1, new.uncached_tokens)]
    done_t = done_a = 0.0
    # The prompts already prefilled decode in every step after their last chunk: their
    # count and context, and the same weighted by where their prefill ended (tokens).
    n = n_at = ctx = ctx_at = 0.0
    marks: list[Features] = []
    for p, size in zip(prompts, sizes, strict=True):
        done_t += size
        done_a += _attention(p)
        steps = math.ceil(done_t / per_step)
        extra_decodes = (n * done_t - n_at) / per_step
        extra_context = (ctx * done_t - ctx_at) / per_step
        marks.append(
            np.array(
                [
                    steps,
                    done_t / 1000,
                    done_a / 1e6,
                    steps * decoding + extra_decodes,
                    (steps * context + extra_context) / 1000,
                ]
            )
        )
        n, n_at = n + 1, n_at + done_t
        tokens = p.cached_tokens + p.uncached_tokens
        ctx, ctx_at = ctx + tokens, ctx_at + tokens * done_t
    ahead_f = marks[len(ahead) - 1] if ahead else np.zeros(len(FEATURES))
    return ahead_f, marks[-1]


# The step model is the profile's coefficients x a common speed x a shape multiplier per
# feature (docs/cost-model.md, "Replay"). An engine is most likely the profile's shape at
# another speed, so:
# - the speed is learned as the learned speed factors are (estimate/online_fit.py
#   `OnlineFit` on log(measured / predicted): every completion's ratio counts alike, the
#   profile's speed worth SPEED_PRIOR_WEIGHT completions, a residual beyond 3 robust sigmas
#   counts as 3), except that a shift that persists (CHANGE_RUN completions in a row off by
#   more than CHANGE_SIGMAS the same way) is a change of engine: the speed's confidence is
#   reset to the prior's, so it follows within a few tens of completions, not hundreds;
# - the shape is tied to the profile's by a prior worth SHAPE_PRIOR_WEIGHT unit-feature
#   completions that is never forgotten (`PriorTiedFit`, ridge toward 1): a coefficient
#   carrying a small share of each TTFT moves only on much evidence, and two that trade
#   against each other cannot run away together.
SPEED_PRIOR_WEIGHT = 2.0
SHAPE_PRIOR_WEIGHT = 5.0
CHANGE_RUN, CHANGE_SIGMAS = 8, 2.0
# The data's memory (0.99 per completion: ~100 completions).
FORGET = 0.99
# For the shape: a completion off by more than HUBER_SIGMAS robust standard deviations of
# the relative residual counts less, beyond REJECT_SIGMAS not at all (a stall, a
# preemption).
HUBER_SIGMAS, REJECT_SIGMAS = 2.0, 5.0
# A multiplier stays within these: a coefficient is never negative, nor absurd.
MIN_MULTIPLIER, MAX_MULTIPLIER = 0.05, 20.0
LOG_MIN_SPEED, LOG_MAX_SPEED = math.log(MIN_MULTIPLIER), math.log(MAX_MULTIPLIER)
# The fit and the profile are judged side by side on the same completions, over the last
# DIVERGENCE_WINDOW: the fit is set aside for the profile when its error is over
# FALLBACK_RATIO times the profile's plus FALLBACK_MARGIN (and the window holds at least
# MIN_JUDGED), and taken back once it is below the profile's. Each completion's error is
# capped at MAX_ERROR so one stall does not decide alone.
DIVERGENCE_WINDOW = 32
MIN_JUDGED = 16
FALLBACK_RATIO, FALLBACK_MARGIN = 1.1, 0.02
MAX_ERROR = 5.0


class StepFit:
    """One backend's step coefficients: the profile's times a multiplier per feature (a
    common speed times a shape, learned from completions), and whether the router uses
    them or the profile's, judged by their errors side by side."""

    def __init__(self, prior: Features) -> None:
        self.prior = prior
        k = len(prior)
        self._speed = OnlineFit([0.0], SPEED_PRIOR_WEIGHT, FORGET, scale=0.1)
        self._shape = PriorTiedFit(
            [1.0] * k, np.eye(k) * SHAPE_PRIOR_WEIGHT, FORGET, HUBER_SIGMAS, REJECT_SIGMAS, 0.1
        )
        self._run = 0  # completions in a row off the same way (+ slower, - faster)
        self.changes = 0
        # Each judged completion's relative error: the fit's (before it learned from it)
        # and the profile's.
        self._fit_errors: deque[float] = deque(maxlen=DIVERGENCE_WINDOW)
        self._profile_errors: deque[float] = deque(maxlen=DIVERGENCE_WINDOW)
        self.using_fit = True
        self.fallbacks = 0
        self.why = "no completion judged yet: the fit starts at the profile's coefficients"

    @property
    def coefficients(self) -> Features:
        """The coefficients the replay uses: the fit's, or the profile's after a fallback."""
        return self.fitted if self.using_fit else self.prior

    @property
    def fitted(self) -> Features:
        return self.prior * self.multipliers

    @property
    def speed(self) -> float:
        """The engine's common speed against its profile (> 1 slower)."""
        return math.exp(float(self._speed.theta[0]))

    @property
    def multipliers(self) -> Features:
        return np.clip(self.speed * self._shape.theta, MIN_MULTIPLIER, MAX_MULTIPLIER)

    @property
    def samples(self) -> int:
        return self._speed.samples

    @property
    def fit_mape(self) -> float | None:
        e = self._fit_errors
        return sum(e) / len(e) if e else None

    @property
    def profile_mape(self) -> float | None:
        e = self._profile_errors
        return sum(e) / len(e) if e else None

    def as_json(self) -> dict[str, Any]:
        fit_mape, profile_mape = self.fit_mape, self.profile_mape
        return {
            "using": "fit" if self.using_fit else "profile",
            "why": self.why,
            "speed": round(self.speed, 4),
            "multipliers": dict(zip(FEATURES, self.multipliers.round(4).tolist(), strict=True)),
            "samples": self.samples,
            "changes": self.changes,
            "outliers_rejected": self._shape.rejected,
            "outliers_downweighted": self._shape.downweighted,
            "fit_mape": None if fit_mape is None else round(fit_mape, 4),
            "profile_mape": None if profile_mape is None else round(profile_mape, 4),
            "judged": len(self._fit_errors),
            "fallbacks": self.fallbacks,
        }

    def ms(self, features: Features) -> float:
        return float(self.coefficients @ features)

    def observe(self, features: Features, measured_ms: float) -> None:
        """A request whose engine time (first token, less the trip and what was credited)
        was `measured_ms`, with the replay's `features` at its dispatch."""
        shaped = self.prior * features * np.clip(self._shape.theta, MIN_MULTIPLIER, None)
        predicted = self.speed * float(shaped.sum())
        if measured_ms <= 0 or predicted <= 0:
            return
        self._judge(float(self.fitted @ features), float(self.prior @ features), measured_ms)
        # the speed, in log space
        residual = self._speed.update([1.0], math.log(measured_ms / float(shaped.sum())))
        self._speed.theta = np.clip(self._speed.theta, LOG_MIN_SPEED, LOG_MAX_SPEED)
        sigma = MAD_TO_SIGMA * (self._speed.scale or 0.0)
        off = 0 if abs(residual) <= CHANGE_SIGMAS * sigma else (1 if residual > 0 else -1)
        self._run = self._run + off if off and (self._run * off) >= 0 else off
        if abs(self._run) >= CHANGE_RUN:
            # a shift that persists: another engine, or one that changed; not a stall
            self._speed.reset_confidence(SPEED_PRIOR_WEIGHT)
            self.changes += 1
            self._run = 0
        # the shape, on relative error at the speed just learned
        predicted = self.speed * float(shaped.sum())
        scale = max(predicted, measured_ms)
        x = self.speed * self.prior * features / scale
        self._shape.update(x.tolist(), measured_ms / scale)

    def _judge(self, fit_ms: float, profile_ms: float, measured_ms: float) -> None:
        self._fit_errors.append(min(MAX_ERROR, abs(fit_ms - measured_ms) / measured_ms))
        self._profile_errors.append(min(MAX_ERROR, abs(profile_ms - measured_ms) / measured_ms))
        fit_mape, profile_mape = self.fit_mape or 0.0, self.profile_mape or 0.0
        n = len(self._fit_errors)
        said = (
            f"over the last {n} completions the fit's TTFT error is {fit_mape:.1%}, "
            f"the profile's {profile_mape:.1%}"
        )
        if (
            self.using_fit
            and n >= MIN_JUDGED
            and fit_mape > FALLBACK_RATIO * profile_mape + FALLBACK_MARGIN
        ):
            self.using_fit = False
            self.fallbacks += 1
            self.why = f"fell back to the profile: {said}"
        elif not self.using_fit and fit_mape < profile_mape:
            self.using_fit = True
            self.why = f"back to the fit: {said}"
        elif not self.using_fit:
            self.why = f"fell back to the profile: {said}"
        elif n >= MIN_JUDGED:
            self.why = f"the fit: {said}"


@dataclass(frozen=True)
class ReplayEstimate:
    """A request's wait and own prefill on one backend, by replay, in ms of engine time;
    `features` and `credit_ms` are kept with its dispatch to learn from its first token."""

    wait_ms: float
    prefill_ms: float
    features: Features
    credit_ms: float


def estimate(
    fit: StepFit,
    scheduler: str,
    budget_tokens: int,
    items: Sequence[QueueItem],
    now_s: float,
    one_way_ms: float,
    new: Prompt,
) -> ReplayEstimate:
    """The replay over `items` (the backend's requests in flight, estimate.cost): those
    without a first token, in the order sent, are ahead; those with one decode. The
    engine has been at work on the oldest one ahead since it arrived (a one-way trip after
    its dispatch) or since the prompts sent before it had their first token there: that
    time is credited, up to that prompt's own share."""
    pending = sorted(
        (it for it in items if it.first_byte_s is None), key=lambda it: it.dispatched_s
    )
    decoding = [it for it in items if it.first_byte_s is not None]
    context = sum(it.kv_tokens - it.output_tokens for it in decoding)
    ahead = [Prompt(it.uncached_tokens, it.cached_tokens) for it in pending]
    ahead_f, total_f = replay_features(scheduler, budget_tokens, ahead, new, len(decoding), context)
    credit_ms = 0.0
    if pending:
        # The engine began the oldest prompt when it arrived, or when the prompts sent
        # before it had their first token there (a first byte reaches the router a
        # one-way trip after the engine's first token), if later.
        head, one_way_s = pending[0], one_way_ms / 1000
        before = [
            it.first_byte_s - one_way_s
            for it in decoding
            if it.first_byte_s is not None and it.dispatched_s <= head.dispatched_s
        ]
        began_s = max([head.dispatched_s + one_way_s, *before])
        elapsed_ms = max(0.0, (now_s - began_s) * 1000)
        head_f, _ = replay_features(
            scheduler, budget_tokens, ahead[:1], new, len(decoding), context
        )
        credit_ms = min(elapsed_ms, fit.ms(head_f))
    ahead_ms = fit.ms(ahead_f)
    return ReplayEstimate(
        max(0.0, ahead_ms - credit_ms), fit.ms(total_f) - ahead_ms, total_f, credit_ms
    )
