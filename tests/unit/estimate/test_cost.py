"""The cost functions in ms: the time and token forms, the prefill model, the queue
estimate (prefill owed, decode step, KV wait, lateness), the decode stall and the KV
headroom (estimate/cost.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.estimate.cost import (
    PrefillModel,
    QueueItem,
    decode_stall_ms,
    estimate_queue_ms,
    kv_headroom_ms,
    time_cost_ms,
    token_cost,
)
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.types import Weights

PROFILE = load_profile()
BIG_KV = 10**9


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.05, 2),
    st.floats(0.05, 2),
    st.floats(0, 500),
    st.floats(0, 5000),
    st.floats(0, 5000),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
    st.integers(0, 50_000),
)
def test_cost_never_falls_when_queue_or_uncached_tokens_grow(
    w_rtt: float, w_q: float, rtt: float, q1: float, q2: float, u1: int, u2: int, cached: int
) -> None:
    w = Weights(w_rtt, w_q)
    model = PrefillModel(PROFILE)
    lo_q, hi_q = sorted((q1, q2))
    lo_u, hi_u = sorted((u1, u2))
    p_lo, p_hi = model.prefill_ms(lo_u, cached), model.prefill_ms(hi_u, cached)
    assert p_lo <= p_hi
    assert time_cost_ms(w, rtt, lo_q, p_lo) <= time_cost_ms(w, rtt, hi_q, p_hi)
    assert token_cost(w, rtt, lo_u, int(lo_q)) <= token_cost(w, rtt, hi_u, int(hi_q))


def test_prefill_model_matches_the_profile_formula() -> None:
    m = PrefillModel(PROFILE)
    assert m.prefill_ms(10_000, 0) == pytest.approx(3 * 20 + 10_000 / 12 * (1 + 5_000 / 30_000))
    assert m.prefill_ms(0, 5_000) == 0


def test_queue_estimate_counts_prefill_still_owed() -> None:
    item = QueueItem(
        prefill_ms=400, kv_tokens=4100, output_tokens=100, dispatched_s=10.0, first_byte_s=None
    )
    assert estimate_queue_ms([], 20, 10.0, 0, BIG_KV, 100) == 0
    assert estimate_queue_ms([item], 20, 10.0, 0, BIG_KV, 100) == 400
    assert estimate_queue_ms([item, item], 20, 10.1, 0, BIG_KV, 100) == pytest.approx(
        700
    )  # 100 ms done
    # long past its own prefill (blocked engine): the head owes nothing, the rest is owed
    assert estimate_queue_ms([item, item], 20, 30.0, 0, BIG_KV, 100) == pytest.approx(400)
    decoding = QueueItem(0, 200, 100, dispatched_s=0, first_byte_s=9.0)
    assert estimate_queue_ms([decoding], 20, 10.0, 0, BIG_KV, 100) == 10  # half a decode step


def test_a_late_first_token_grows_the_queue_estimate_past_the_grace() -> None:
    # due 0.1 s after dispatch; grace 500 ms: lateness counts from 0.6 s on
    item = QueueItem(100, 4100, 100, dispatched_s=10.0, first_byte_s=None, due_s=10.1)
    assert estimate_queue_ms([item], 20, 10.6, 0, BIG_KV, 100, stall_grace_ms=500) == 0
    assert estimate_queue_ms([item], 20, 12.6, 0, BIG_KV, 100, stall_grace_ms=500) == pytest.approx(
        2000
    )
    assert estimate_queue_ms([item], 20, 12.6, 0, BIG_KV, 100, stall_grace_ms=0) == 0  # off
    # a long estimate is its own grace: 3 s due, late only after 6 s
    slow = QueueItem(3000, 4100, 100, dispatched_s=10.0, first_byte_s=None, due_s=13.0)
    assert estimate_queue_ms([slow], 20, 15.9, 0, BIG_KV, 100, stall_grace_ms=500) == 0
    assert estimate_queue_ms([slow], 20, 17.0, 0, BIG_KV, 100, stall_grace_ms=500) == pytest.approx(
        1000
    )


def test_a_full_kv_pool_waits_for_the_first_finishers() -> None:
    # two decoding requests hold 6k tokens each of an 12k pool; a 3k-token request must
    # wait until one of them finishes: the one with 10 tokens left (10 steps of 20 ms)
    soon = QueueItem(0, 6000, 500, dispatched_s=0.0, first_byte_s=100.0 - 490 * 0.02)
    later = QueueItem(0, 6000, 500, dispatched_s=0.0, first_byte_s=100.0 - 100 * 0.02)
    assert estimate_queue_ms([soon, later], 20, 100.0, 0, 12_000, 3000) == pytest.approx(200)
    assert estimate_queue_ms([soon, later], 20, 100.0, 0, 20_000, 3000) == 10  # fits: no wait


def test_decode_stall_is_the_prefill_time_times_the_requests_it_holds_up() -> None:
    assert decode_stall_ms(1500.0, 0) == 0
    assert decode_stall_ms(1500.0, 8) == 12_000


def test_kv_headroom_prices_the_wait_within_the_margin_beyond_the_queue() -> None:
    # 100k-token pool; two decoding requests hold 44k each (88 %), the first to finish
    # frees its KV in 10 steps of 20 ms, the other in 400
    soon = QueueItem(0, 44_000, 500, dispatched_s=0.0, first_byte_s=100.0 - 490 * 0.02)
    later = QueueItem(0, 44_000, 500, dispatched_s=0.0, first_byte_s=100.0 - 100 * 0.02)
    items = [soon, later]
    # 5k more fits the pool (93 %), not the pool less a 10 % margin: the first finisher
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 0.0) == pytest.approx(200)
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 1_000, 0.1, 0.0) == 0  # 89 %: room
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.0, 0.0) == 0  # no margin
    # the wait overlaps the queue: only what lasts beyond it counts
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 150.0) == pytest.approx(50)
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 5_000, 0.1, 500.0) == 0
    # a request larger than what the first finisher frees waits for the second too
    assert kv_headroom_ms(items, 20, 100.0, 100_000, 50_000, 0.1, 0.0) == pytest.approx(8000)
