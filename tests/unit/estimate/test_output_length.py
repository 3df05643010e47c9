"""Learned output lengths (estimate/output_length.py): the mean converging, the cap's
share, the keys' order, the session's pull."""

import pytest

from ext_proc.estimate.output_length import (
    DEFAULT_OUTPUT_TOKENS,
    MIN_WEIGHT,
    OutputLengths,
    keys_for,
)

MODEL = keys_for("m", "", "")


def test_before_enough_completions_the_cap_or_the_default() -> None:
    lengths = OutputLengths()
    for _ in range(int(MIN_WEIGHT) - 1):
        lengths.observe(MODEL, 100, None)
    assert lengths.expected(MODEL, None) == DEFAULT_OUTPUT_TOKENS
    assert lengths.expected(MODEL, 64) == 64


def test_the_learned_length_converges_to_the_mean() -> None:
    lengths = OutputLengths()
    for i in range(600):
        lengths.observe(MODEL, (100, 300)[i % 2], None)
    assert lengths.expected(MODEL, None) == pytest.approx(200, rel=0.01)
    # no completion set a cap: a request that sets one is believed (the prior)
    assert lengths.expected(MODEL, 150) == 150
    for i in range(600):
        lengths.observe(MODEL, (100, 300)[i % 2], 4096)
    # caps seldom reached: capped at 150, min(100, 150) and min(300, 150) half and half
    assert lengths.expected(MODEL, 150) == pytest.approx(125, rel=0.01)


def test_a_client_that_sets_the_length_is_believed() -> None:
    lengths = OutputLengths()
    for n in range(200):
        lengths.observe(MODEL, 10 + n, 10 + n)  # every answer stops at its max_tokens
    assert lengths.expected(MODEL, 77) == pytest.approx(77)


def test_a_far_cap_gives_the_learned_length() -> None:
    lengths = OutputLengths()
    for i in range(600):
        lengths.observe(MODEL, (100, 300)[i % 2], 4096)
    # the prior (the cap is the length) forgotten: the cap's share is ~0
    assert lengths.expected(MODEL, 4096) == pytest.approx(200, rel=0.02)


def test_a_shift_is_relearned() -> None:
    lengths = OutputLengths()
    for _ in range(600):
        lengths.observe(MODEL, 100, None)
    for _ in range(600):
        lengths.observe(MODEL, 1000, None)
    # 600 completions at a memory of ~200: 5 % of the weight still on the old length
    assert lengths.expected(MODEL, None) == pytest.approx(955, rel=0.01)


def test_the_most_specific_key_with_enough_completions_answers() -> None:
    lengths = OutputLengths()
    short, long = keys_for("m", "", "short"), keys_for("m", "", "long")
    for _ in range(50):
        lengths.observe(short, 50, None)
        lengths.observe(long, 500, None)
    assert lengths.expected(short, None) == pytest.approx(50)
    assert lengths.expected(long, None) == pytest.approx(500)
    # a tenant not seen yet: its model's lengths
    assert lengths.expected(keys_for("m", "", "new"), None) == pytest.approx(275, rel=0.01)
    # another model: every model's
    assert lengths.expected(keys_for("other", "", ""), None) == pytest.approx(275, rel=0.01)


def test_a_sessions_own_turns_pull_its_expectation() -> None:
    lengths = OutputLengths()
    for _ in range(100):
        lengths.observe(MODEL, 200, None)
    lengths.observe(MODEL, 600, None, session="s1")
    mean = lengths.expected(MODEL, None)
    # one turn of its own (600) against the key's mean, worth one turn
    assert lengths.expected(MODEL, None, session="s1") == pytest.approx((600 + mean) / 2)
    assert lengths.expected(MODEL, None, session="s2") == mean
