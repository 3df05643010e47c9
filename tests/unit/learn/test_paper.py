"""The tuner's `paper` mode (learn/paper.py): the GORGO paper's rule, kept to reproduce
it. The weights under evaluation serve everything; every `rescore_every` completions the
p95 TTFT of the last `window` scores them; a child up to 0.5 % worse is kept; the
parent's score is never measured again."""

import random
from dataclasses import replace

import pytest

from ext_proc.learn.paper import PaperRule
from ext_proc.learn.settings import CHILD, PARENT, Step, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.types import Weights
from tests.unit.learn.arms import feed

# Windows of 8, scored every 4 completions.
PAPER_S = replace(TunerSettings.paper(), window=8, rescore_every=4)


def paper(settings: TunerSettings = PAPER_S) -> tuple[Tuner, PaperRule]:
    t = Tuner(settings, Weights(0.5, 0.1), random.Random(0))
    return t, PaperRule(t)


def play(rule: PaperRule, ttfts: list[float]) -> list[Step]:
    """Completions (every one scores the weights in force); the steps they ended."""
    return [step for ttft in ttfts if (step := rule.observe(CHILD, ttft, 5 * ttft)) is not None]


def test_one_arm_serves_everything_and_decisions_are_not_compared() -> None:
    _, rule = paper()
    assert {rule.arm_for(f"r{i}", f"s{i}") for i in range(16)} == {CHILD}
    assert rule.arm_sizes() == {PARENT: 0, CHILD: 0}
    assert rule.decided(False) is None


def test_the_first_full_window_scores_the_initial_weights() -> None:
    t, rule = paper()
    assert play(rule, [1000.0] * 7) == []  # the window is not full yet
    (step,) = play(rule, [2000.0])
    # p95 of seven 1,000s and a 2,000: 1,000 + 0.65 x 1,000
    assert step.note == "parent scored" and step.parent_p95_ms == pytest.approx(1650.0)
    assert t.state.parent_score_ms == pytest.approx(1650.0)
    assert t.state.child != t.state.parent and t.state.outcomes == []  # a child: no verdict


def test_a_child_is_scored_every_rescore_every_on_the_last_window() -> None:
    t, rule = paper()
    play(rule, [1000.0] * 8)  # the parent: 1,000
    child = t.state.child
    assert play(rule, [1004.0] * 3) == []  # 3 of rescore_every (4) since the last score
    (step,) = play(rule, [1004.0])
    # the window is the last 8: four 1,000s and four 1,004s, p95 1,004 (0.4 % worse)
    assert step.child_p95_ms == pytest.approx(1004.0) and step.accepted
    assert t.state.parent == child and t.state.parent_score_ms == pytest.approx(1004.0)


@pytest.mark.parametrize(
    ("case", "child_ms", "accepted"),
    [
        ("better", 900.0, True),
        ("0.4 % worse: kept (the paper's tolerance sign)", 1004.0, True),
        ("0.6 % worse: rejected", 1006.0, False),
    ],
)
def test_a_child_up_to_half_a_percent_worse_is_kept(
    case: str, child_ms: float, accepted: bool
) -> None:
    t, rule = paper(replace(PAPER_S, rescore_every=8))
    play(rule, [1000.0] * 8)
    parent, child = t.state.parent, t.state.child
    (step,) = play(rule, [child_ms] * 8)
    assert step.accepted is accepted, case
    assert step.parent_p95_ms == (child_ms if accepted else 1000.0)
    assert t.state.parent == (child if accepted else parent)
    # a rejected child leaves the parent's old score standing: it is never re-measured
    assert t.state.parent_score_ms == (child_ms if accepted else 1000.0)


def test_the_window_is_kept_across_a_change_of_weights() -> None:
    _, rule = paper()
    play(rule, [1000.0] * 6)
    rule.reset()  # what an operator's new weights do to the round: nothing, here
    (step,) = play(rule, [1000.0] * 2)  # 8 in the window: scored
    assert step.note == "parent scored"


def test_paper_mode_accepts_a_child_half_a_percent_worse() -> None:
    s = TunerSettings.paper()
    s = replace(s, window=8, rescore_every=8)
    t = Tuner(s, Weights(0.5, 0.1), random.Random(0))
    assert t.state.child == t.state.parent  # the initial weights are scored first
    feed(t, lambda w, arm: 1000.0, 8)
    assert t.state.parent_score_ms == 1000.0 and t.state.child != t.state.parent
    child = t.state.child
    feed(t, lambda w, arm: 1004.0, 8, start=8)  # 0.4 % worse: the paper keeps it
    assert t.state.parent == child and t.state.parent_score_ms == 1004.0
    assert s.rtt_bounds == (0.05, 2.0) and s.queue_bounds == (0.05, 0.5)
