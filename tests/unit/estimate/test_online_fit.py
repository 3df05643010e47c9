"""The latency model's online fit: it converges from a wrong prior within ~200 samples,
relearns a backend that changes, is not dragged by outliers, and does not wind up on
samples that are all alike."""

import random

import numpy as np
import pytest

from ext_proc.estimate.online_fit import OnlineFit

TRUE = (3.0, 0.3)  # ms per chunk, ms per 1k work units: a backend 3x slower than assumed
PRIOR = (1.0, 0.1)


def sample(rng: random.Random, theta: tuple[float, float]) -> tuple[list[float], float]:
    chunks = rng.randint(1, 4)
    work_k = rng.uniform(0.2, 8.0) * chunks
    y = theta[0] * chunks + theta[1] * work_k
    return [chunks, work_k], y * rng.lognormvariate(0, 0.05)  # 5 % noise


def relative_error(fit: OnlineFit, theta: tuple[float, float]) -> float:
    x = [2.0, 6.0]
    truth = theta[0] * x[0] + theta[1] * x[1]
    return abs(fit.predict(x) - truth) / truth


def test_it_converges_from_a_wrong_prior_within_200_samples() -> None:
    rng = random.Random(1)
    fit = OnlineFit(PRIOR)
    assert relative_error(fit, TRUE) > 0.6  # the prior is far off
    for _ in range(200):
        fit.update(*sample(rng, TRUE))
    assert relative_error(fit, TRUE) < 0.05
    assert fit.theta == pytest.approx(TRUE, rel=0.1)


def test_a_backend_that_changes_is_relearned() -> None:
    rng = random.Random(2)
    fit = OnlineFit(PRIOR)
    for _ in range(400):
        fit.update(*sample(rng, TRUE))
    slower = (6.0, 0.9)
    for _ in range(300):
        fit.update(*sample(rng, slower))
    assert relative_error(fit, slower) < 0.05


def test_outliers_do_not_drag_the_rates() -> None:
    rng = random.Random(3)
    robust, plain = OnlineFit(PRIOR), OnlineFit(PRIOR, clip_sigmas=1e9)
    for i in range(400):
        x, y = sample(rng, TRUE)
        if i % 10 == 5:
            y *= 10  # a stall behind something the model did not see
        robust.update(x, y)
        plain.update(x, y)
    assert relative_error(robust, TRUE) < 0.1
    assert relative_error(plain, TRUE) > 2 * relative_error(robust, TRUE)


def test_alike_samples_do_not_wind_it_up() -> None:
    fit = OnlineFit(PRIOR, max_covariance=100.0)
    for _ in range(5000):
        fit.update([1.0, 2.0], 3.0 + 0.3 * 2.0)  # the same sample, long
    assert fit.predict([1.0, 2.0]) == pytest.approx(3.6, rel=1e-3)
    fit.update([4.0, 20.0], 4 * 3.0 + 0.3 * 20.0)  # one new kind of sample: no wild jump
    assert 0 < fit.theta[0] < 10 and 0 < fit.theta[1] < 2


def test_a_coefficient_held_loosely_moves_sooner() -> None:
    from ext_proc.estimate.online_fit import OnlineFit

    fit = OnlineFit([1.0, 1.0], prior_weight=[100.0, 0.1], scale=10.0)
    fit.update([1.0, 1.0], 4.0)  # 2 more than predicted, to share between the two
    firm, loose = fit.theta - 1.0
    assert loose > 100 * firm > 0


def test_one_coefficient_in_floats_is_the_general_fit_to_the_bit() -> None:
    """The speed factors' one-coefficient fit runs in floats; it must give exactly what
    the matrix form gives (the simulator's results depend on it): here the matrix form is
    a two-coefficient fit whose second feature is always 0, so its first coefficient
    follows the same recursion, with outliers clipped alike."""
    rng = np.random.default_rng(7)
    one = OnlineFit([0.3], 2.0, 0.99, scale=0.3, max_covariance=1e300)
    two = OnlineFit([0.3, 0.0], 2.0, 0.99, scale=0.3, max_covariance=1e300)
    for i in range(500):
        y = float(rng.normal(0.5, 0.2)) + (5.0 if i % 50 == 7 else 0.0)  # some outliers
        assert one.update([1.0], y) == two.update([1.0, 0.0], y)
        assert float(one.theta[0]) == float(two.theta[0])
        assert one.scale == two.scale
    assert one.samples == two.samples == 500
    assert abs(float(one.theta[0]) - 0.5) < 0.1  # and it learned
