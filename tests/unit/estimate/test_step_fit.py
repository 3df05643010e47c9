"""The replay's step model (estimate/replay.py `StepFit`, estimate/online_fit.py
`PriorTiedFit`) on the engines that broke the old fit: one several times slower than its
profile, one that changes speed mid-run, one that stalls. The fit follows a real change,
does not fit outliers, never runs away, and a backend whose fit is worse than its profile
falls back to the profile by itself and back to the fit once the fit is the better."""

import random
from collections.abc import Callable

import numpy as np
import pytest

from ext_proc.estimate.online_fit import PriorTiedFit
from ext_proc.estimate.profile import load_profile
from ext_proc.estimate.replay import (
    MAX_MULTIPLIER,
    Features,
    Prompt,
    StepFit,
    profile_coefficients,
    replay_features,
)

PROFILE = load_profile()
THETA = profile_coefficients(PROFILE)
B = PROFILE.chunk_tokens
# An A10G with the same 8B model: prefill ~5.5x the shipped profile's, its decode context
# read ~19x (another GPU: another speed and another shape).
A10G = profile_coefficients(load_profile("a10g-llama3.1-8b"))


def samples(n: int, seed: int = 0) -> list[Features]:
    """The replay's features for n requests meeting random queues and decode batches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ahead = [Prompt(rng.randint(100, 20_000), rng.randint(0, 20_000)) for _ in range(3)]
        _, f = replay_features("sglang", B, ahead[:-1], ahead[-1], rng.randint(0, 30), 50_000)
        out.append(f)
    return out


def feed(
    fit: StepFit, features: list[Features], truth: Callable[[int, Features], float], seed: int = 1
) -> list[float]:
    """Each request's relative error as predicted before the fit learned from it."""
    rng = random.Random(seed)
    errors = []
    for i, f in enumerate(features):
        measured = truth(i, f) * rng.uniform(0.95, 1.05)
        errors.append(abs(fit.ms(f) - measured) / measured)
        fit.observe(f, measured)
    return errors


def held_out_error(fit: StepFit, true_theta: Features) -> float:
    test = samples(200, seed=99)
    return max(abs(fit.ms(f) - true_theta @ f) / (true_theta @ f) for f in test)


@pytest.mark.parametrize("slower", [3.0, 5.0, 8.0])
def test_an_engine_several_times_slower_than_its_profile_is_followed_without_runaway(
    slower: float,
) -> None:
    fit = StepFit(THETA)
    errors = feed(fit, samples(600), lambda _, f: slower * float(THETA @ f))
    # within 60 completions its predictions are within 10 %, and stay there
    assert max(errors[60:]) < 0.10
    assert held_out_error(fit, slower * THETA) < 0.06
    # the common speed moved, not one coefficient traded against another
    assert fit.multipliers.max() < 1.5 * slower and fit.multipliers.min() > slower / 1.5
    assert fit.using_fit and fit.fallbacks == 0


def test_another_gpus_speed_and_shape_is_learned_and_stays_bounded() -> None:
    fit = StepFit(THETA)
    errors = feed(fit, samples(1500), lambda _, f: float(A10G @ f))
    assert float(np.mean(errors[-200:])) < 0.05 and max(errors[-200:]) < 0.15
    assert held_out_error(fit, A10G) < 0.15
    assert (fit.multipliers < MAX_MULTIPLIER).all()
    assert fit.using_fit


def test_an_engine_that_changes_speed_mid_run_is_followed() -> None:
    fit = StepFit(THETA)
    # as the profile for 300 completions, then 4x slower (another engine behind the name),
    # then 2x
    errors = feed(
        fit, samples(900), lambda i, f: (1.0 if i < 300 else 4.0 if i < 600 else 2.0) * THETA @ f
    )
    assert max(errors[100:300]) < 0.08
    assert max(errors[360:600]) < 0.10  # followed within 60 completions
    assert max(errors[660:]) < 0.10
    assert held_out_error(fit, 2.0 * THETA) < 0.08


def test_a_stall_is_not_fitted() -> None:
    fit = StepFit(THETA)
    features = samples(400)
    # five completions in a row behind a 20x stall, then the engine as its profile again
    stalled = range(200, 205)
    feed(fit, features, lambda i, f: (20.0 if i in stalled else 1.0) * THETA @ f)
    assert fit.as_json()["outliers_rejected"] >= 4
    assert held_out_error(fit, THETA) < 0.05
    assert fit.using_fit


def test_a_fit_worse_than_the_profile_falls_back_by_itself_and_returns_when_better() -> None:
    fit = StepFit(THETA)
    features = samples(700)

    # a long stall (60 completions at 10x) is taken for a change of speed; the engine then
    # runs as its profile again, so the fit is far off while the profile is right; later
    # it really becomes 3x slower, where only the fit can be right
    def truth(i: int, f: Features) -> float:
        return (10.0 if 100 <= i < 160 else 1.0 if i < 400 else 3.0) * float(THETA @ f)

    errors: list[float] = []
    using: list[str] = []
    profile_served: list[bool] = []
    rng = random.Random(1)
    for i, f in enumerate(features):
        measured = truth(i, f) * rng.uniform(0.95, 1.05)
        errors.append(abs(fit.ms(f) - measured) / measured)
        fit.observe(f, measured)
        using.append(fit.as_json()["using"])
        profile_served.append(fit.ms(f) == pytest.approx(float(THETA @ f)))
    assert all(u == "fit" for u in using[:160])
    fell = using.index("profile", 160)
    assert fell < 175  # within 15 completions of the recovery
    # while the profile serves, the router's predictions are the profile's
    assert all(profile_served[i] for i, u in enumerate(using) if u == "profile")
    # once the fit has relearned the engine and its window is better, it is taken back
    back = using.index("fit", fell)
    assert back < 400 and max(errors[back + 1 : 400]) < 0.10
    assert fit.fallbacks == 1  # and no fallback for the 3x engine, which the fit follows
    assert all(u == "fit" for u in using[back:])
    assert max(errors[460:]) < 0.10
    assert fit.fit_mape is not None and fit.profile_mape is not None
    assert fit.fit_mape < fit.profile_mape / 10
    assert "fit" in fit.why


def test_the_prior_holds_a_direction_the_data_does_not_tell() -> None:
    """Two features always in the same proportion: the data says only their sum; the
    prior keeps the split at the profile's (the old fit let such a pair run away)."""
    prior = [1.0, 1.0]
    fit = PriorTiedFit(prior, np.eye(2) * 2, forget=0.99)
    rng = random.Random(0)
    for _ in range(2000):
        s = rng.uniform(0.1, 1.0)
        fit.update([s, s], 3.0 * s)  # the sum is 3
    assert fit.theta.sum() == pytest.approx(3.0, rel=0.03)
    assert fit.theta[0] == pytest.approx(fit.theta[1], rel=0.02)


def test_an_engine_beyond_the_bounds_is_held_at_them() -> None:
    fit = StepFit(THETA)
    feed(fit, samples(400), lambda _, f: 100.0 * float(THETA @ f))
    assert fit.speed == pytest.approx(MAX_MULTIPLIER)
    assert (fit.multipliers <= MAX_MULTIPLIER).all()
    f = samples(1, seed=5)[0]
    assert fit.ms(f) <= MAX_MULTIPLIER * float(THETA @ f) * 1.0001
