"""The engine model pinned against its profile's formulas."""

import random
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.engine.model.scheduler import Emission, EngineModel, PrefixCache
from ext_proc.estimate.profile import EngineProfile, load_profile

PROFILE = replace(load_profile(), jitter_sigma=0.0)
BT = PROFILE.block_tokens


def run(model: EngineModel, until_s: float = 1e9) -> list[Emission]:
    out: list[Emission] = []
    while (t := model.next_event_s()) is not None and t <= until_s:
        out += model.advance(t)
    return out


def blocks(prefix: int, n: int) -> list[int]:
    """n chained block ids of a prompt family: same prefix -> same leading ids."""
    return [prefix * 1_000_000 + i for i in range(n)]


def test_lone_request_ttft_equals_the_formula() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    m.submit("a", 10_000, 3, blocks(1, 10_000 // BT), now_s=5.0)
    first = run(m)[0]
    # 10k tokens = chunks of 4096, 4096, 1808; each base + U/P * (1 + (C + U/2)/30k)
    expected_ms = sum(
        20 + u / 12000 * 1000 * (1 + (c + u / 2) / 30000)
        for c, u in ((0, 4096), (4096, 4096), (8192, 1808))
    )
    assert (first.time_s - 5.0) * 1e3 == pytest.approx(expected_ms)
    assert PROFILE.lone_ttft_ms(10_000) == pytest.approx(expected_ms)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_itl_at_batch_size_matches_the_profile(batch: int) -> None:
    m = EngineModel(PROFILE, random.Random(0))
    for i in range(batch):
        m.submit(f"r{i}", 100, 50, [], now_s=0.0)
    em = run(m)
    # a decode step in the middle, all requests running: one token each, equal spacing
    times = sorted({e.time_s for e in em if e.index in (10, 11)})
    assert len(times) == 2
    context = batch * (100 + 11)  # every request holds its prompt and 11 generated tokens
    assert (times[1] - times[0]) * 1e3 == pytest.approx(PROFILE.decode_ms(batch, context))


def test_itl_profile_shape() -> None:
    """Light load ~8-10 ms; many long-context requests in the batch cost 20+ ms."""
    assert 7.5 < PROFILE.decode_ms(1, 2_000) < 10
    assert 9 < PROFILE.decode_ms(4, 40_000) < 12
    assert PROFILE.decode_ms(64, 64 * 8_000) > 20


def test_cache_hit_shortens_ttft_by_the_predicted_amount() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    prompt = blocks(7, 8192 // BT)
    m.submit("cold", 8192, 1, prompt, now_s=0.0)
    cold = run(m)[0]
    m.submit("warm", 8192, 1, prompt, now_s=10.0)
    warm = run(m)[0]
    assert cold.cached_tokens == 0
    # everything cached but the last block (one prompt token is always computed)
    assert warm.cached_tokens == 8192 - BT
    assert (warm.time_s - 10.0) * 1e3 == pytest.approx(PROFILE.lone_ttft_ms(8192, 8192 - BT))
    saved_ms = cold.time_s * 1e3 - (warm.time_s - 10.0) * 1e3
    assert saved_ms == pytest.approx(
        PROFILE.lone_ttft_ms(8192) - PROFILE.lone_ttft_ms(8192, 8192 - BT)
    )
    assert m.cache_hit_rate == pytest.approx((8192 - BT) / (2 * 8192))


def test_shared_prefix_only_counts_the_common_blocks() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    m.submit("a", 40 * BT, 1, blocks(1, 40), now_s=0.0)
    run(m)
    m.submit("b", 40 * BT, 1, blocks(1, 25) + blocks(2, 15), now_s=5.0)
    assert run(m)[0].cached_tokens == 25 * BT


def test_eviction_keeps_the_cache_within_capacity_lru_first() -> None:
    small = replace(PROFILE, kv_capacity_tokens=100 * BT)
    m = EngineModel(small, random.Random(0))
    for i in range(6):  # 6 prompts of 30 blocks: 180 blocks of cache wanted, room for 100
        m.submit(f"p{i}", 30 * BT, 1, blocks(i, 30), now_s=float(i))
        run(m)
        assert m.used_tokens <= small.kv_capacity_tokens
    # the most recent prompts stayed, the oldest went
    assert m.cache.match(blocks(5, 30)) == 30
    assert m.cache.match(blocks(0, 30)) == 0


def test_a_long_chunked_prefill_delays_running_decodes() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    m.submit("chat", 200, 40, [], now_s=0.0)
    em = run(m, until_s=0.3)
    m.submit("doc", 32_768, 1, [], now_s=0.3)  # 8 chunks, each holding the GPU
    em += run(m)
    chat_times = [e.time_s for e in em if e.rid == "chat"]
    gaps_ms = [(b - a) * 1e3 for a, b in pairwise(chat_times)]
    doc_prefill_ms = PROFILE.lone_ttft_ms(32_768)
    # one inter-token gap of the chat swallowed the whole 8-chunk prefill
    assert max(gaps_ms) > doc_prefill_ms
    assert sorted(gaps_ms)[-2] < 15


def test_max_running_requests_queues_the_rest_fcfs() -> None:
    p = replace(PROFILE, max_running_requests=2)
    m = EngineModel(p, random.Random(0))
    for i in range(4):
        m.submit(f"r{i}", 100, 5, [], now_s=0.0)
    assert (m.num_running, m.num_waiting) == (2, 2)
    firsts = {e.rid: e.time_s for e in run(m) if e.index == 0}
    assert firsts["r0"] == firsts["r1"] < firsts["r2"] == firsts["r3"]


def test_cancel_frees_everything() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    m.submit("a", 5000, 100, blocks(1, 5000 // BT), now_s=0.0)
    m.submit("b", 100, 100, [], now_s=0.0)
    run(m, until_s=0.2)
    m.cancel("a", 0.2)
    m.cancel("b", 0.2)
    assert m.num_running == m.num_waiting == 0
    assert m.used_tokens == m.cache.tokens  # only unpinned cache left
    assert m.cache.evictable_tokens == m.cache.tokens


def test_jitter_is_seeded() -> None:
    p = replace(PROFILE, jitter_sigma=0.05)

    def times(seed: int) -> list[float]:
        m = EngineModel(p, random.Random(seed))
        m.submit("a", 3000, 20, [], now_s=0.0)
        return [e.time_s for e in run(m)]

    assert times(1) == times(1) != times(2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 9_000),  # input tokens
            st.integers(1, 30),  # output tokens
            st.integers(0, 3),  # prompt family (shared prefixes)
            st.floats(0, 2.0),  # arrival gap s
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(20, 400),
)
def test_every_request_gets_all_its_tokens_in_order(
    reqs: list[tuple[int, int, int, float]], capacity_blocks: int
) -> None:
    p = replace(PROFILE, kv_capacity_tokens=capacity_blocks * BT, max_running_requests=8)
    m = EngineModel(p, random.Random(0))
    now, out = 0.0, []
    for i, (n_in, n_out, fam, gap) in enumerate(reqs):
        now += gap
        out += run(m, until_s=now)
        m.submit(f"r{i}", n_in, n_out, blocks(fam, n_in // BT), now_s=now)
    out += run(m)
    for i, (n_in, n_out, _, _) in enumerate(reqs):
        mine = [e for e in out if e.rid == f"r{i}"]
        assert [e.index for e in mine] == list(range(n_out))
        assert all(a.time_s < b.time_s for a, b in pairwise(mine))
        assert mine[-1].finished and 0 <= mine[0].cached_tokens < n_in
    assert m.num_running == m.num_waiting == 0
    assert m.used_tokens == m.cache.tokens


def test_prefix_cache_pins_what_is_in_use() -> None:
    c = PrefixCache(block_tokens=1)
    c.acquire([1, 2, 3], now_s=0.0)
    assert c.evict(10) == 0  # all pinned
    c.release([1, 2, 3], now_s=1.0)
    c.acquire([1, 2, 9], now_s=2.0)  # shares 1, 2; adds a sibling of 3
    assert c.evict(10) == 1  # only 3 can go (1, 2 pinned, 9 pinned)
    assert c.match([1, 2, 3]) == 2


def test_profile_file_errors_name_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ext_proc.estimate.profile import profile_from_dict

    raw = {f: getattr(PROFILE, f) for f in EngineProfile.__dataclass_fields__}
    with pytest.raises(ValueError, match="chunk_tokens"):
        profile_from_dict({**raw, "chunk_tokens": -1})
    with pytest.raises(ValueError, match="unknown key 'chunk'"):
        profile_from_dict({**raw, "chunk": 1})
    with pytest.raises(ValueError, match="unknown engine profile 'nope'"):
        load_profile("nope")


def test_admission_never_evicts_the_prefix_it_matched() -> None:
    tight = replace(PROFILE, kv_capacity_tokens=4 * BT)
    m = EngineModel(tight, random.Random(0))
    prompt = blocks(3, 3)
    m.submit("a", 3 * BT, 1, prompt, now_s=0.0)
    run(m)
    # needs room for 1 uncomputed block + 100 output tokens: evicting its own cached
    # prefix would be the only way, so it must keep (and report) exactly what stays cached
    m.submit("b", 3 * BT, 100, prompt, now_s=1.0)
    first = run(m)[0]
    assert first.cached_tokens == 2 * BT
    assert m.cache.match(prompt) >= 2


def test_only_computed_blocks_are_shared() -> None:
    m = EngineModel(PROFILE, random.Random(0))
    prompt = blocks(4, 16_384 // BT)
    m.submit("long", 16_384, 1, prompt, now_s=0.0)
    first_chunk_end = m.next_event_s()
    assert first_chunk_end is not None
    m.advance(first_chunk_end)  # one 4,096-token chunk done
    m.cancel("long", first_chunk_end)
    assert m.cache.match(prompt) == 4096 // BT


def test_vllm_decodes_go_on_while_a_long_prompt_prefills_sglang_stalls_them() -> None:
    """vLLM v1 mixes a decode token per running request into each prefill chunk's step;
    SGLang runs the new prefill first and decodes wait for its last chunk."""
    first_tokens_during: dict[str, int] = {}
    for scheduler in ("vllm", "sglang"):
        m = EngineModel(PROFILE, random.Random(0), scheduler=scheduler)
        m.submit("talker", 100, 500, [], now_s=0.0)
        run(m, until_s=0.1)  # decoding by now
        m.submit("long", 20_000, 2, blocks(2, 20_000 // BT), now_s=0.1)
        em = run(m)
        long_first = next(e.time_s for e in em if e.rid == "long" and e.index == 0)
        first_tokens_during[scheduler] = sum(
            1 for e in em if e.rid == "talker" and 0.1 < e.time_s < long_first
        )
    # 20k tokens are 5 chunks of 4,096 (less a token per decode): a token each step
    assert first_tokens_during["vllm"] >= 4
    assert first_tokens_during["sglang"] <= 1


def test_vllm_step_budget_is_shared_decodes_first_then_prefill_chunks() -> None:
    m = EngineModel(PROFILE, random.Random(0), scheduler="vllm")
    for i in range(10):
        m.submit(f"d{i}", 64, 100, [], now_s=0.0)
    run(m, until_s=0.05)
    m.submit("long", 10_000, 2, blocks(3, 10_000 // BT), now_s=0.05)
    step = m.step
    assert step is not None
    # the step running at 0.05 s was planned before "long"; the next one takes it
    run(m, until_s=step.end_s)
    step = m.step
    assert step is not None and len(step.decode) == 10
    [(req, chunk)] = step.prefill
    assert req.rid == "long" and chunk == PROFILE.chunk_tokens - 10
    # one forward pass: the decode step's time plus the chunk's prefill share
    context = sum(r.input_tokens + r.generated for r in step.decode)
    expected_ms = PROFILE.decode_ms(10, context) + PROFILE.prefill_ms(chunk, 0)
    assert (step.end_s - step.start_s) * 1e3 == pytest.approx(expected_ms)


def test_an_unknown_scheduler_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduler"):
        EngineModel(PROFILE, random.Random(0), scheduler="trt")


def test_the_evictable_count_kept_as_pins_change_matches_a_recount() -> None:
    rng = random.Random(3)
    cache = PrefixCache(16)
    held: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            blocks = [hash((rng.randrange(4), j)) for j in range(rng.randrange(1, 5))]
            cache.acquire(blocks, float(step))
            held.append(blocks)
        elif op < 0.85 and held:
            cache.release(held.pop(rng.randrange(len(held))), float(step))
        else:
            cache.evict(rng.randrange(1, 64))
        recount = sum(1 for n in cache.nodes.values() if n.refs == 0) * 16
        assert cache.evictable_tokens == recount
