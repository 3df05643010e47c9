"""The scheduler's replay (estimate/replay.py): the closed forms against the profile's
formulas, SGLang's prefill-first and vLLM's budgeted steps, the credit for work under
way, and the step model fitted from completions; the router with routing.ttft_model
replay uses it and learns it."""

import random

import numpy as np
import pytest

from ext_proc.estimate.cost import QueueItem
from ext_proc.estimate.profile import load_profile
from ext_proc.estimate.replay import (
    Prompt,
    StepFit,
    estimate,
    profile_coefficients,
    replay_features,
)
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router

PROFILE = load_profile()
THETA = profile_coefficients(PROFILE)
B = PROFILE.chunk_tokens


def ms(features: np.ndarray) -> float:
    return float(THETA @ features)


@pytest.mark.parametrize("scheduler", ["sglang", "vllm"])
def test_a_lone_prompt_takes_the_profiles_own_time(scheduler: str) -> None:
    for tokens in (100, 4096, 10_000, 60_000):
        _, total = replay_features(scheduler, B, [], Prompt(tokens, 0), 0, 0)
        assert ms(total) == pytest.approx(PROFILE.lone_ttft_ms(tokens))


def test_sglang_prompts_share_chunks_and_wait_out_half_a_decode_step() -> None:
    ahead = [Prompt(1000, 0), Prompt(2000, 500)]
    wait, total = replay_features("sglang", B, ahead, Prompt(500, 0), 0, 0)
    # 3,500 tokens: one step for all three, its base paid once
    assert wait[0] == 1 and total[0] == 1 and total[1] == pytest.approx(3.5)
    # the attention work is each prompt's own, however the chunks split it
    attention = sum(p.uncached_tokens * (p.cached_tokens + p.uncached_tokens / 2) for p in ahead)
    assert wait[2] == pytest.approx(attention / 1e6)
    # with requests decoding there, half of a decode step under way on average
    _, busy = replay_features("sglang", B, [], Prompt(500, 0), 8, 40_000)
    assert busy[0] == 1.5 and busy[3] == 4 and busy[4] == pytest.approx(20)


def test_vllm_decodes_take_the_budget_first_and_prompts_done_start_decoding() -> None:
    alone, _ = replay_features("vllm", B, [Prompt(B, 0)], Prompt(100, 0), 0, 0)
    busy, total = replay_features("vllm", B, [Prompt(B, 0)], Prompt(100, 0), 96, 96_000)
    assert alone[0] == 1 and busy[0] == 2  # 96 decode tokens push the prompt to a 2nd step
    assert busy[3] == 2 * 96  # a token per decode in each step
    # the prompt ahead decodes in the steps after its last chunk, until the new one's ends
    assert total[3] > busy[3] and ms(total) > ms(busy)


def items(*prompts: tuple[int, float]) -> list[QueueItem]:
    return [
        QueueItem(0.0, tokens + 10, 10, dispatched_s, None, None, tokens, 0)
        for tokens, dispatched_s in prompts
    ]


def test_the_work_under_way_is_credited_up_to_the_oldest_prompts_own_share() -> None:
    fit = StepFit(THETA)
    new = Prompt(100, 0)
    fresh = estimate(fit, "sglang", B, items((8000, 10.0)), 10.0, 0.0, new)
    half = estimate(fit, "sglang", B, items((8000, 10.0)), 10.0 + fresh.wait_ms / 2000, 0.0, new)
    assert half.wait_ms == pytest.approx(fresh.wait_ms / 2)
    late = estimate(fit, "sglang", B, items((8000, 10.0), (8000, 10.5)), 100.0, 0.0, new)
    head_ms = ms(replay_features("sglang", B, [Prompt(8000, 0)], new, 0, 0)[0])
    assert late.credit_ms == pytest.approx(head_ms)  # never more than the oldest's share
    assert late.wait_ms > 0  # the second prompt is still owed
    assert fresh.prefill_ms == pytest.approx(late.prefill_ms, rel=0.2)


def test_the_step_model_learns_an_engine_twice_as_slow() -> None:
    fit = StepFit(THETA)
    rng = random.Random(0)
    for _ in range(300):
        ahead = [Prompt(rng.randint(100, 20_000), rng.randint(0, 20_000)) for _ in range(3)]
        _, f = replay_features("sglang", B, ahead[:-1], ahead[-1], rng.randint(0, 30), 50_000)
        fit.observe(f, 2 * ms(f) * rng.uniform(0.95, 1.05))
    _, f = replay_features("sglang", B, [Prompt(5000, 0)], Prompt(3000, 1000), 10, 20_000)
    assert fit.ms(f) == pytest.approx(2 * ms(f), rel=0.05)
    assert fit.samples == 300 and (fit.multipliers > 0).all()


def test_the_router_with_the_replay_predicts_and_learns_from_each_completion() -> None:
    router, clock = make_router(
        "gorgo", backends=["a"], routing={"ttft_model": "replay"}, timeout_s=600
    )
    first = router.decide(chat("x " * 3000, rid="r1"))
    assert first.chosen.terms["prefill"] > 0 and first.chosen.terms["queue"] == 0
    second = router.decide(chat("y " * 3000, rid="r2"))
    assert second.chosen.terms["queue"] > 0  # the first is ahead of it
    b = router.backends["a"]
    assert b.learned.step is not None and b.learned.step.samples == 0
    for rid in ("r1", "r2"):
        clock.advance(2.0)
        router.first_byte(rid)
        clock.advance(0.5)
        router.close(rid, Status.OK, e2e_ms=2500.0)
    assert b.learned.step.samples == 2


def test_the_credit_starts_when_the_prompts_sent_before_had_their_first_token() -> None:
    fit = StepFit(THETA)
    new = Prompt(100, 0)
    head = QueueItem(0.0, 60_010, 10, 10.0, None, None, 60_000, 0)
    # sent before it, its first token reached the router at 12 s: the engine was on it
    earlier = QueueItem(0.0, 30_010, 10, 9.0, 12.0, None, 30_000, 0)
    with_earlier = estimate(fit, "sglang", B, [earlier, head], 14.0, 0.0, new)
    alone = estimate(fit, "sglang", B, [head], 14.0, 0.0, new)
    assert alone.credit_ms == pytest.approx(4000) and with_earlier.credit_ms == pytest.approx(2000)
    # its first byte came back a one-way trip after the engine's first token
    far = estimate(fit, "sglang", B, [earlier, head], 14.0, 500.0, new)
    assert far.credit_ms == pytest.approx(2500)


def test_vllm_a_prompt_prefilled_decodes_until_each_later_mark_not_past_it() -> None:
    ahead = [Prompt(B, 0), Prompt(B, 0)]
    wait, total = replay_features("vllm", B, ahead, Prompt(100, 0), 0, 0)
    # the first decodes through the second's one step; then both through the new one's
    assert wait[3] == pytest.approx(1.0)
    assert total[3] == pytest.approx((B + 100) / B + 100 / B)
    assert total[4] == pytest.approx(((B + 100) / B * B + 100 / B * B) / 1000)
