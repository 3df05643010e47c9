"""The policy seam (policy/base.py): the registry, and the lowest score with near-ties
drawn at random."""

import random
from collections import Counter

import pytest

from ext_proc.policy.base import NoParams, near_ties, pick_min, register

SCORES = {"a": 100.0, "b": 104.0, "c": 130.0, "d": 100.5, "e": 105.5}


@pytest.mark.parametrize(
    ("case", "tie_abs", "tie_frac", "tied"),
    [
        ("exact: the lowest alone", 0.0, 0.0, ["a"]),
        ("within 1 ms", 1.0, 0.0, ["a", "d"]),
        ("within 5 % of 100: 105", 0.0, 0.05, ["a", "b", "d"]),
        ("the wider of the two (5), not their sum", 1.0, 0.05, ["a", "b", "d"]),
        ("within 30 ms: all", 30.0, 0.0, ["a", "b", "c", "d", "e"]),
    ],
)
def test_near_ties_are_within_tie_abs_or_tie_frac_of_the_lowest(
    case: str, tie_abs: float, tie_frac: float, tied: list[str]
) -> None:
    assert sorted(near_ties(SCORES, tie_abs, tie_frac)) == tied, case


def test_a_negative_best_widens_by_its_magnitude() -> None:
    assert sorted(near_ties({"a": -100.0, "b": -96.0, "c": -90.0}, tie_frac=0.05)) == ["a", "b"]


def test_pick_min_draws_among_the_near_ties_only() -> None:
    rng = random.Random(0)
    got = Counter(pick_min(SCORES, rng, tie_abs=1.0) for _ in range(200))
    assert set(got) == {"a", "d"} and min(got.values()) > 60


def test_a_name_is_registered_once() -> None:
    from ext_proc.policy.catalog import POLICIES  # the built-in ones, registered

    assert "gorgo" in POLICIES
    with pytest.raises(ValueError, match="policy 'gorgo' registered twice"):
        register("gorgo", NoParams)(lambda rng, params: None)  # type: ignore[arg-type,return-value]
