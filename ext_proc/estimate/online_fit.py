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
