"""`gorgo bench decide`'s figures from given samples (no timing): a setting's quantiles and
target, the real-tokenizer rows against the approximation and the warm target, the index's
bytes per block; and one rendered table each."""

import pytest

from loadgen.bench.router.decide import (
    CHAT_TURNS,
    TARGET_P99_MS,
    TARGET_WARM_P99_MS,
    DecideRow,
    Quantiles,
    TokenizedRun,
    decide_line,
    decide_row,
    index_memory,
    tokenized_lines,
    tokenized_study,
)

SAMPLES = [float(i) for i in range(1, 101)]  # p50 50.5, p99 99.01


def test_a_setting_has_its_quantiles_and_a_target_on_the_longest_prompts() -> None:
    r = decide_row(64, 131_072, SAMPLES, [2 * x for x in SAMPLES])
    assert r.decide == pytest.approx(Quantiles(50.5, 99.01))
    assert r.full == pytest.approx(Quantiles(101.0, 198.02))
    assert r.target_p99_ms == TARGET_P99_MS[64]
    assert decide_row(3, 32_768, SAMPLES, SAMPLES).target_p99_ms is None


def test_the_tokenized_rows_against_the_approximation() -> None:
    run = TokenizedRun(
        approx_ms=[0.5] * 10,
        warm_ms=[1.0] * 9 + [6.0],
        warm_parse_ms=[1.5] * 10,
        tokens=32_000,
        new_tokens=900,
        cache={"hits": 10, "misses": 1, "mismatches": 0},
        failures=2,
    )
    s = tokenized_study(CHAT_TURNS, run)
    assert [r.label for r in s.rows] == [  # no cold samples: no cold row
        "approximation: decide",
        "warm: tokenize + decide",
        "warm: parse + tok + decide",
    ]
    approx, warm, parse = s.rows
    assert approx.x_approx == (1.0, 1.0) and parse.x_approx == pytest.approx((3.0, 3.0))
    assert warm.latency.p50 == 1.0 and warm.latency.p99 == pytest.approx(5.55)  # 1 + 0.91 x 5
    assert warm.x_approx == pytest.approx((2.0, 11.1))
    assert warm.target_p99_ms == TARGET_WARM_P99_MS and not warm.meets and not s.meets
    assert (s.tokens, s.new_tokens, s.failures) == (32_000, 900, 2)
    short = tokenized_study(CHAT_TURNS // 4, run)  # no target on the other conversation
    assert short.meets and all(r.target_p99_ms is None for r in short.rows)


def test_the_warm_index_takes_a_few_bytes_a_block() -> None:
    m = index_memory()
    assert m.blocks > 0 and m.bytes_per_block == m.memory_bytes / m.blocks
    assert 0 < m.bytes_per_block <= 64


def test_the_tables_render_a_setting_and_a_conversation() -> None:
    row = DecideRow(3, 131_072, Quantiles(0.1234, 0.9), Quantiles(0.2, 1.5), 1.0)
    assert decide_line(row) == (
        "       3    128k       0.123       0.900       0.200       1.500       <= 1"
    )
    run = TokenizedRun(approx_ms=[0.5], warm_ms=[2.0], tokens=32_768, new_tokens=1024)
    run.cache = {"hits": 3, "misses": 1, "mismatches": 0}
    lines = tokenized_lines(tokenized_study(CHAT_TURNS, run)).splitlines()
    assert lines[1] == (
        "    32  32,768  1,024  warm: tokenize + decide   2.000   2.000          4.0"
        "          4.0       <= 5"
    )
    assert lines[-1] == "       cache: 3 hits, 1 misses, 0 mismatches, 0 failures"
