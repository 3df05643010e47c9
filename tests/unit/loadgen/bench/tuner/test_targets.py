"""Issue 27's tuner targets: the table per target says pass or fail against its count."""

from loadgen.bench.tuner.targets import Row, Target


def test_a_target_passes_only_with_enough_seeds_and_shows_each_seed() -> None:
    rows = tuple(Row(s, (f"{s}.0",), ok=s != 4) for s in range(5))
    t = Target("(x)", "goal", 4, ("figure",), rows, "notes")
    md = t.markdown()
    assert t.met == 4 and "**PASS**: met in 4 of 5 seeds (needs 4)" in md
    assert "| 4 | 4.0 | no |" in md and "| 0 | 0.0 | yes |" in md
    strict = Target("(y)", "goal", 5, ("figure",), rows, "")
    assert "**FAIL**" in strict.markdown()
