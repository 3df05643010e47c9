import pytest

from ext_proc.estimate.transfer import (
    FACTOR_BOUNDS,
    PairKnobs,
    PairPrice,
    TransferFactors,
    best_pair,
    transfer_ms,
)


def price(prefill: str, total_ms: float, remote: bool, uncached: int = 10_000) -> PairPrice:
    return PairPrice(prefill, "d", 0.0, 0.0, total_ms, 0, 0.0, 0.0, 0.0, 0.0, 0.0, remote, uncached)


def test_a_transfer_is_the_links_rtt_plus_bytes_over_bandwidth() -> None:
    # Llama-3.1-8B fp16: 128 KiB a token; 10k tokens = 1.31 GB: ~1 s at 10 Gbps
    kv = 10_000 * 131_072
    assert transfer_ms(kv, 10.0, 5.0) == pytest.approx(5.0 + kv * 8 / 10e9 * 1e3)
    assert transfer_ms(kv, 100.0, 0.0) == pytest.approx(104.8576)
    assert transfer_ms(kv, 1.0, 0.0, factor=2.0) == pytest.approx(2 * 10485.76)


def test_the_price_sums_every_part() -> None:
    p = PairPrice("p", "d", 1.0, 2.0, 3.0, 100, 4.0, 0.0, 5.0, 6.0, 7.0)
    assert p.total_ms == pytest.approx(1 + 2 + 3 + 4 + 5 + 6 + 7)


def test_a_remote_prefill_must_win_by_the_margin() -> None:
    local, remote = price("pl", 500.0, False), price("pr", 450.0, True)
    assert best_pair([local, remote], PairKnobs()) is remote
    assert best_pair([local, remote], PairKnobs(remote_margin_ms=49.0)) is remote
    assert best_pair([local, remote], PairKnobs(remote_margin_ms=50.0)) is local
    assert best_pair([remote], PairKnobs(remote_margin_ms=1e9)) is remote  # nothing local
    assert best_pair([], PairKnobs()) is None


def test_below_the_threshold_a_prompt_is_prefilled_locally() -> None:
    local, remote = price("pl", 500.0, False, 300), price("pr", 100.0, True, 300)
    assert best_pair([local, remote], PairKnobs(local_threshold_tokens=300)) is remote
    assert best_pair([local, remote], PairKnobs(local_threshold_tokens=301)) is local
    assert best_pair([remote], PairKnobs(local_threshold_tokens=301)) is None


def test_the_transfer_factor_learns_toward_what_was_observed_within_bounds() -> None:
    f = TransferFactors()
    assert f.factor("a", "b") == 1.0
    for _ in range(200):  # the link moves 300 ms what bytes / bandwidth says is 100
        f.observe("b", "a", 100.0 * f.factor("a", "b"), 300.0)  # either direction: one link
    assert f.factor("a", "b") == pytest.approx(3.0, rel=0.01)
    for _ in range(500):
        f.observe("a", "b", 100.0, 1e6)
    assert f.factor("a", "b") == pytest.approx(FACTOR_BOUNDS[1], rel=0.01)
    f.observe("a", "b", 0.0, 10.0)  # nothing predicted: nothing learned
    f.observe("a", "c", 100.0, -5.0)
    assert f.factor("a", "c") == 1.0 and set(f.as_json()) == {"a|b"}
