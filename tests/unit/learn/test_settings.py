"""What both tuner modes share (learn/settings.py): the 1/5 rule, the bounds, mutation,
ties' wider steps, and how an arm's samples are scored."""

import random
from dataclasses import replace

import numpy as np
import pytest

from ext_proc.learn.settings import (
    PAIRED,
    PAPER,
    TunerSettings,
    p95,
    score,
    state_from_doc,
)
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.types import Weights
from tests.unit.learn.arms import PAIRED_S, TIES, route

EIGHT = np.arange(1.0, 9.0)  # 1, 2, ..., 8


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("p95", 7.65),  # linear: 1 + 0.95 x 7
        ("mean", 4.5),
        ("tail", 7.5),  # the slowest quarter: 7 and 8
    ],
)
def test_an_arms_score(how: str, expected: float) -> None:
    assert score(replace(TunerSettings(), score=how), EIGHT) == pytest.approx(expected)
    assert p95(list(EIGHT)) == pytest.approx(7.65)


def test_an_unknown_score_is_refused() -> None:
    with pytest.raises(ValueError, match="tuner score 'median'"):
        TunerSettings(score="median")


def test_clip_holds_each_weight_within_its_bounds() -> None:
    s = TunerSettings()
    assert s.clip((1000.0, 0.001)) == (256.0, 1 / 16)
    assert s.clip((0.001, 1000.0)) == (1 / 16, 16.0)
    assert TunerSettings.paper().clip((1.0, 1.0)) == (1.0, 0.5)


def test_a_saved_state_is_restored_for_its_own_mode_only() -> None:
    doc = {"mode": "paired", "parent": [1000.0, 2.0], "child": [1.0, 1.0], "sigma": 0.3}
    st = state_from_doc(doc, TunerSettings(mode=PAIRED))
    assert st is not None and st.parent == (256.0, 2.0) and st.sigma == 0.3  # clipped
    assert state_from_doc(doc, TunerSettings(mode=PAPER)) is None
    with pytest.raises(ValueError, match="positive"):
        state_from_doc({**doc, "sigma": 0.0}, TunerSettings())
    with pytest.raises(ValueError, match="not a tuner state"):
        state_from_doc({**doc, "nonsense": 1}, TunerSettings())


def test_one_fifth_rule_moves_sigma_as_specified() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    t.state.outcomes = [False] * 7
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 0 of 8 succeeded: shrink
    assert t.state.sigma == pytest.approx(0.5 * 0.817)
    t.state.outcomes = [True, True, False, False, False, False, False]
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 2 of 8 > 1/5: grow
    assert t.state.sigma == pytest.approx(0.5)
    t.state.outcomes = [True, False, False, False, False, False, False]
    t.finish_round(False, 1.0, 1.0, bounded=True)  # 1 of 8 < 1/5: shrink
    assert t.state.sigma == pytest.approx(0.5 * 0.817)
    t.state.sigma = 0.9
    t.state.outcomes = [True] * 7
    t.finish_round(True, 1.0, 1.0, bounded=True)
    assert t.state.sigma == PAIRED_S.sigma_max  # bounded in paired mode


def test_tail_mean_averages_the_slowest_fraction() -> None:
    import numpy as np

    from ext_proc.learn.settings import tail_mean

    assert tail_mean(np.arange(1.0, 9.0), 0.25) == pytest.approx(7.5)  # 7 and 8
    assert tail_mean(np.array([3.0, 1.0, 2.0]), 0.01) == 3.0  # at least one sample
    rows = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0]])
    assert np.asarray(tail_mean(rows, 0.5)).tolist() == pytest.approx([3.5, 5.0])


def test_default_bounds_hold_the_physical_weights_well_inside() -> None:
    """1.0 is a real millisecond of RTT or queue; the bounds reach from where a term
    stops changing decisions (1/16) to where it overrides the others, so the measured
    optimum (w_rtt 32-64 on the tuning window, docs/tuner.md) is inside them."""
    s = TunerSettings()
    (rlo, rhi), (qlo, qhi) = s.rtt_bounds, s.queue_bounds
    assert rlo <= 1 / 16 and rhi >= 256 and qlo <= 1 / 16 and qhi >= 16
    assert s.clip((1.0, 1.0)) == (1.0, 1.0)


def test_ties_grow_sigma_up_to_tie_sigma_max_and_a_verdict_bounds_it_again() -> None:
    s = replace(TIES, tie_sigma_max=3.0)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    for i in range(40 * s.tie_decisions):
        route(t, f"r{i}", alike=True)
    assert t.state.sigma == pytest.approx(s.tie_sigma_max)
    t.finish_round(False, 1.0, 1.0, bounded=True)
    assert t.state.sigma == s.sigma_max


def test_children_from_a_corner_are_reflected_inside_not_clipped_onto_it() -> None:
    s = TIES
    corner = Weights(s.rtt_bounds[1], s.queue_bounds[0])
    t = Tuner(s, corner, random.Random(0))
    children = [t.mutate(t.state.parent) for _ in range(200)]
    assert not any(c[0] == s.rtt_bounds[1] or c[1] == s.queue_bounds[0] for c in children)
    assert all(s.clip(c) == c for c in children)
