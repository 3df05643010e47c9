"""Online least squares for the per-backend latency model: recursive least
squares with exponential forgetting, robust to outliers.

A backend's prefill time is linear in its physically shaped features (per chunk a base
cost, per token a rate that grows with the context: ext_proc/estimate/cost.py), and so is
its decode step in the profile's step curve; what is not known is the coefficients of
*this* engine. `OnlineFit` starts from the profile's coefficients as a prior worth a few
samples, moves to the data as completions come (recursive least squares: O(k^2) per
sample, k = 2 here, microseconds), forgets old samples geometrically (`forget` per sample:
0.99 keeps an effective memory of ~100 completions, so a backend that changes is
relearned within a few hundred), and bounds each sample's pull (a residual beyond
`clip_sigmas` robust standard deviations counts as that many: a queue stall or a GC pause
does not drag the rates). The covariance is capped so that a long run of alike samples
(no excitation) cannot wind it up into a jump later.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# A residual's robust scale: an exponentially weighted mean absolute (clipped) residual,
# with this weight per sample; x1.25 turns a mean absolute deviation into a normal sigma.
SCALE_EWMA = 0.05
MAD_TO_SIGMA = 1.25


class OnlineFit:
    """y ~ theta . x, learned one sample at a time."""

    def __init__(
        self,
        prior: Sequence[float],
        prior_weight: float | Sequence[float] = 4.0,
        forget: float = 0.99,
        clip_sigmas: float = 3.0,
        max_covariance: float = 1e6,
        scale: float | None = None,
    ) -> None:
        """`prior`: the starting coefficients (the profile's); `prior_weight`: how many
        unit-feature samples the prior is worth (one for all, or one per coefficient: a
        coefficient held less firmly moves sooner); `scale`: the residuals' expected robust
        scale before any is seen (None: the first residual's, unclipped)."""
        self.theta: npt.NDArray[np.float64] = np.array(prior, dtype=float)
        self._p = np.diag(np.broadcast_to(1.0 / np.asarray(prior_weight, float), len(prior)))
        self.forget = forget
        self.clip_sigmas = clip_sigmas
        self.max_covariance = max_covariance
        self.samples = 0
        # The robust scale of the residuals (y units); None until the first residual.
        self.scale: float | None = scale

    def predict(self, x: Sequence[float]) -> float:
        return float(self.theta @ np.asarray(x, dtype=float))

    def update(self, x: Sequence[float], y: float) -> float:
        """Learn from one sample; returns its residual before the update (y - predicted)."""
        if len(self.theta) == 1:
            return self._update_one(float(x[0]), y)
        v = np.asarray(x, dtype=float)
        residual = y - float(self.theta @ v)
        pulled = self._pull(residual)
        pv = self._p @ v
        gain = pv / (self.forget + float(v @ pv))
        self.theta = self.theta + gain * pulled
        self._p = (self._p - np.outer(gain, pv)) / self.forget
        trace = float(np.trace(self._p))
        if trace > self.max_covariance:  # no excitation for long: do not wind up
            self._p *= self.max_covariance / trace
        self.samples += 1
        return residual

    def reset_confidence(self, prior_weight: float) -> None:
        """Hold the coefficients as loosely as a prior worth `prior_weight` samples again
        (a change detected: what was learned before no longer holds), keeping them."""
        self._p = np.diag(np.full(len(self.theta), 1.0 / prior_weight))

    def _pull(self, residual: float) -> float:
        """The residual as it may pull (clipped), the robust scale updated."""
        pulled = residual
        if self.scale is not None and self.scale > 0:
            bound = self.clip_sigmas * MAD_TO_SIGMA * self.scale
            pulled = max(-bound, min(bound, residual))
        # The scale learns from the clipped residual too, or outliers would widen their
        # own bound.
        self.scale = (
            abs(residual)
            if self.scale is None
            else self.scale + SCALE_EWMA * (abs(pulled) - self.scale)
        )
        return pulled

    def _update_one(self, v: float, y: float) -> float:
        """`update` for one coefficient (the speed factors) in floats: the same operations
        in the same order, so the same results, without numpy's per-call cost (~15 us of
        each request's close on 1x1 arrays)."""
        theta, p = float(self.theta[0]), float(self._p[0, 0])
        residual = y - theta * v
        pulled = self._pull(residual)
        pv = p * v
        gain = pv / (self.forget + v * pv)
        self.theta[0] = theta + gain * pulled
        p = (p - gain * pv) / self.forget
        if p > self.max_covariance:  # the trace of a 1x1 covariance is itself
            p *= self.max_covariance / p
        self._p[0, 0] = p
        self.samples += 1
        return residual


class PriorTiedFit:
    """y ~ theta . x by Bayesian least squares around a prior that is never forgotten
    (the replay's step model, estimate/replay.py `StepFit`).

    `OnlineFit` forgets its prior with its samples, so after a few hundred a direction
    the data barely excites (two coefficients that trade against each other) is held by
    nothing and can run away. Here the data's sufficient statistics are forgotten
    geometrically (`forget` per sample) but the prior's precision is not: theta solves
    (prior precision + data's X'WX) theta = prior precision . prior + X'Wy after every
    sample (k x k, k = 5: tens of microseconds). A direction the data tells much about
    follows the data; one it tells little about stays at the prior.

    Each sample is weighted by its residual against a robust scale (an exponentially
    weighted mean absolute residual): within `huber_sigmas` robust standard deviations it
    counts fully, beyond that less (Huber: weight k sigma / |r|), and beyond
    `reject_sigmas` not at all (a stalled engine, a preemption: not fitted). The scale
    learns from the residual bounded at `reject_sigmas`, so a change that persists widens
    the scale within ~10 samples and is then fitted, while a few outliers are not."""

    def __init__(
        self,
        prior: Sequence[float],
        prior_precision: npt.NDArray[np.float64],
        forget: float = 0.99,
        huber_sigmas: float = 2.0,
        reject_sigmas: float = 5.0,
        scale: float | None = None,
    ) -> None:
        """`prior`: the starting coefficients; `prior_precision`: k x k, how many
        unit-feature samples the prior is worth in each direction (its inverse covariance);
        `scale`: the residuals' expected robust scale before any is seen (None: the first
        residual's)."""
        self.prior: npt.NDArray[np.float64] = np.array(prior, dtype=float)
        k = len(self.prior)
        self._lambda = np.eye(k)
        self._lambda_prior = self.prior.copy()
        self.set_prior_precision(prior_precision)
        self._xtx = np.zeros((k, k))
        self._xty = np.zeros(k)
        self.theta: npt.NDArray[np.float64] = self.prior.copy()
        self.forget = forget
        self.huber_sigmas = huber_sigmas
        self.reject_sigmas = reject_sigmas
        self.scale: float | None = scale
        self.samples = 0
        # Samples given no weight (beyond reject_sigmas), and down-weighted (Huber).
        self.rejected = 0
        self.downweighted = 0

    def predict(self, x: Sequence[float]) -> float:
        return float(self.theta @ np.asarray(x, dtype=float))

    def set_prior_precision(self, prior_precision: npt.NDArray[np.float64]) -> None:
        """The prior's precision from now on (taken into theta at the next sample)."""
        k = len(self.prior)
        self._lambda = np.asarray(prior_precision, dtype=float).reshape(k, k)
        self._lambda_prior = self._lambda @ self.prior

    def weight(self, residual: float) -> float:
        """How much a sample with this residual counts (1 within huber_sigmas)."""
        if self.scale is None or self.scale <= 0:
            return 1.0
        sigma = MAD_TO_SIGMA * self.scale
        r = abs(residual)
        if r <= self.huber_sigmas * sigma:
            return 1.0
        if r > self.reject_sigmas * sigma:
            return 0.0
        return self.huber_sigmas * sigma / r

    def update(self, x: Sequence[float], y: float) -> float:
        """Learn from one sample; returns its residual before the update (y - predicted)."""
        v = np.asarray(x, dtype=float)
        residual = y - float(self.theta @ v)
        w = self.weight(residual)
        if self.scale is None:
            self.scale = abs(residual)
        else:
            bound = self.reject_sigmas * MAD_TO_SIGMA * self.scale
            self.scale += SCALE_EWMA * (min(abs(residual), bound) - self.scale)
        self.rejected += w == 0.0
        self.downweighted += 0.0 < w < 1.0
        if w > 0:  # a rejected sample tells nothing: it does not age the others either
            self._xtx *= self.forget
            self._xty *= self.forget
            self._xtx += w * np.outer(v, v)
            self._xty += w * y * v
            solved = np.linalg.solve(self._lambda + self._xtx, self._lambda_prior + self._xty)
            self.theta = np.asarray(solved, dtype=np.float64)
        self.samples += 1
        return residual
