"""Priority scheduling in the engine model (emulator/engine/model/scheduler.py PriorityScheduling),
on the model's virtual clock: the waiting queue's order and the preemption of running
requests, as vLLM (--scheduling-policy priority) and SGLang (--enable-priority-scheduling)
do them."""

import random
from dataclasses import replace
from itertools import pairwise

import pytest

from emulator.engine.model.scheduler import Emission, EngineModel, PriorityScheduling
from ext_proc.estimate.profile import load_profile

BASE = replace(load_profile(), jitter_sigma=0.0)
# Two batch slots: a burst queues in the engine.
TWO_SLOTS = replace(BASE, max_running_requests=2)
SGLANG = PriorityScheduling()


def run(model: EngineModel) -> list[Emission]:
    out: list[Emission] = []
    while (t := model.next_event_s()) is not None:
        out += model.advance(t)
    return out


def first_token_s(emissions: list[Emission]) -> dict[str, float]:
    return {e.rid: e.time_s for e in emissions if e.index == 0}


def burst_then_urgent(
    model: EngineModel, urgent: int | None, low: int | None = 0, n: int = 6
) -> dict[str, float]:
    """n low-priority requests at t=0, then one more at t=0.01 (a step is running)."""
    for i in range(n):
        model.submit(f"low{i}", 2_000, 50, [], now_s=0.0, priority=low)
    model.submit("urgent", 2_000, 50, [], now_s=0.01, priority=urgent)
    return first_token_s(run(model))


@pytest.mark.parametrize("scheduler", ["sglang", "vllm"])
def test_without_the_flag_priority_is_ignored(scheduler: str) -> None:
    """Priority off: FCFS, the very same schedule as requests carrying no priority."""
    a = EngineModel(TWO_SLOTS, random.Random(0), scheduler=scheduler)
    b = EngineModel(TWO_SLOTS, random.Random(0), scheduler=scheduler)
    with_priority = burst_then_urgent(a, urgent=100 if scheduler == "sglang" else -100)
    without = burst_then_urgent(b, urgent=None, low=None)
    assert with_priority == without
    # the urgent request waits behind the whole burst
    assert with_priority["urgent"] > max(with_priority[f"low{i}"] for i in range(6))


def test_sglang_serves_a_higher_value_first_ahead_of_the_waiting_burst() -> None:
    m = EngineModel(TWO_SLOTS, random.Random(0), priority=SGLANG)
    # 10 over 0 is not past the preemption threshold (10): order only, no preemption
    first = burst_then_urgent(m, urgent=10)
    waiting_at_arrival = [f"low{i}" for i in range(2, 6)]  # two took the slots at t=0
    # admitted with the first slot that frees (sharing its prefill with one low request)
    assert all(first["urgent"] <= first[r] for r in waiting_at_arrival)
    assert sum(first["urgent"] < first[r] for r in waiting_at_arrival) == 3
    assert first["urgent"] > max(first["low0"], first["low1"])
    assert m.stats.preemptions == 0
    assert m.stats.submitted_by_priority == {"0": 6, "10": 1}


def test_vllm_serves_a_lower_value_first() -> None:
    m = EngineModel(
        TWO_SLOTS, random.Random(0), scheduler="vllm", priority=PriorityScheduling.vllm()
    )
    first = burst_then_urgent(m, urgent=-1)
    assert all(first["urgent"] <= first[f"low{i}"] for i in range(2, 6))
    assert sum(first["urgent"] < first[f"low{i}"] for i in range(2, 6)) == 3
    # a higher value is served last
    m = EngineModel(
        TWO_SLOTS, random.Random(0), scheduler="vllm", priority=PriorityScheduling.vllm()
    )
    first = burst_then_urgent(m, urgent=1)
    assert first["urgent"] > max(first[f"low{i}"] for i in range(6))


def test_vllm_refuses_a_high_values_first_setting() -> None:
    with pytest.raises(ValueError, match="lower values first"):
        EngineModel(BASE, random.Random(0), scheduler="vllm", priority=SGLANG)


@pytest.mark.parametrize(
    ("setting", "order"),
    [
        (SGLANG, ["p5", "p3a", "p3b", "p1"]),  # higher first, ties by arrival
        (PriorityScheduling(low_values_first=True), ["p1", "p3a", "p3b", "p5"]),  # flipped
    ],
)
def test_sglang_sign_and_ties_by_arrival(setting: PriorityScheduling, order: list[str]) -> None:
    one_slot = replace(BASE, max_running_requests=1)
    m = EngineModel(one_slot, random.Random(0), priority=setting)
    m.submit("head", 1_000, 20, [], now_s=0.0, priority=0)  # holds the slot
    for t, rid, prio in ((0.01, "p3a", 3), (0.02, "p1", 1), (0.03, "p5", 5), (0.04, "p3b", 3)):
        m.submit(rid, 1_000, 20, [], now_s=t, priority=prio)
    first = first_token_s(run(m))
    assert sorted(order, key=first.__getitem__) == order


def test_sglang_gives_a_request_without_priority_the_lowest() -> None:
    """_set_or_validate_priority: no priority is -sys.maxsize - 1 (higher first) or
    sys.maxsize (lower first): it goes after every prioritized request, even a -1000."""
    for setting, worst in ((SGLANG, -1000), (PriorityScheduling(low_values_first=True), 1000)):
        m = EngineModel(replace(BASE, max_running_requests=1), random.Random(0), priority=setting)
        m.submit("head", 1_000, 20, [], now_s=0.0, priority=0)
        m.submit("none", 1_000, 20, [], now_s=0.01)
        m.submit("worst", 1_000, 20, [], now_s=0.02, priority=worst)
        first = first_token_s(run(m))
        assert first["worst"] < first["none"]


def test_vllm_without_priority_is_zero() -> None:
    """vLLM's field defaults to 0: a -1 goes before a request that names none, a 1 after."""
    m = EngineModel(
        replace(BASE, max_running_requests=1),
        random.Random(0),
        scheduler="vllm",
        priority=PriorityScheduling.vllm(),
    )
    m.submit("head", 1_000, 20, [], now_s=0.0)
    m.submit("late", 1_000, 20, [], now_s=0.01, priority=1)
    m.submit("none", 1_000, 20, [], now_s=0.02)
    m.submit("early", 1_000, 20, [], now_s=0.03, priority=-1)
    first = first_token_s(run(m))
    assert first["early"] < first["none"] < first["late"]


def test_sglang_preempts_running_lower_priority_past_the_threshold() -> None:
    """Both slots decode long answers; a request 50 better arrives: the worst running
    (ties: the latest queued) is preempted, the newcomer starts at once, and the victim's
    prefill (prompt + what it generated) is done again later."""
    m = EngineModel(TWO_SLOTS, random.Random(0), priority=SGLANG)
    m.submit("old", 1_000, 400, [], now_s=0.0, priority=0)
    m.submit("young", 1_000, 400, [], now_s=0.001, priority=0)
    out = m.advance(1.0)  # both decoding
    generated = sum(e.rid == "young" for e in out)
    assert generated > 10
    m.submit("urgent", 1_000, 5, [], now_s=1.0, priority=50)
    step_end = m.next_event_s()  # the decode step running at 1.0 ends; then it plans
    assert step_end is not None
    out += m.advance(step_end)
    generated = sum(e.rid == "young" for e in out)
    assert m.stats.preemptions == 1 and m.stats.preempted_by_priority == {"0": 1}
    assert m.num_waiting == 1  # young is back in the waiting queue
    rest = run(m)
    urgent_first = next(e.time_s for e in rest if e.rid == "urgent" and e.index == 0)
    assert urgent_first - step_end == pytest.approx(BASE.lone_ttft_ms(1_000) / 1e3)
    young = [e for e in out + rest if e.rid == "young"]
    # every token once, in order: the recompute emits no token twice
    assert [e.index for e in young] == list(range(400))
    # the recompute: a prefill of the prompt and the tokens generated before
    resumed = next(e for e in young if e.index == generated)
    before = next(e for e in young if e.index == generated - 1)
    assert resumed.time_s - before.time_s >= BASE.prefill_ms(1_000 + generated, 0) / 1e3
    assert all(e.cached_tokens == 0 for e in young)
    old = [e.time_s for e in out + rest if e.rid == "old"]
    assert max(b - a for a, b in pairwise(old)) < 0.2  # never preempted


@pytest.mark.parametrize(
    "setting",
    [PriorityScheduling(preemption_threshold=50), PriorityScheduling(preemption=False)],
)
def test_sglang_does_not_preempt_within_the_threshold_or_when_disabled(
    setting: PriorityScheduling,
) -> None:
    m = EngineModel(TWO_SLOTS, random.Random(0), priority=setting)
    m.submit("a", 1_000, 400, [], now_s=0.0, priority=0)
    m.submit("b", 1_000, 400, [], now_s=0.0, priority=0)
    m.advance(1.0)
    m.submit("urgent", 1_000, 5, [], now_s=1.0, priority=50)
    first = first_token_s(run(m))
    assert m.stats.preemptions == 0
    assert first["urgent"] > 2.0  # waited for a slot


def test_vllm_preempts_the_largest_priority_when_kv_runs_out() -> None:
    """A pool of 2,000 tokens; two requests of 600 + 800 tokens each fit their prompts,
    not their answers: when decoding fills the pool, the one with the larger priority is
    preempted (its KV freed), the other runs on, and the victim's prefill is redone."""
    small = replace(BASE, kv_capacity_tokens=2_000)
    m = EngineModel(small, random.Random(0), scheduler="vllm", priority=PriorityScheduling.vllm())
    m.submit("keep", 600, 800, [], now_s=0.0, priority=0)
    m.submit("victim", 600, 800, [], now_s=0.0, priority=5)
    out: list[Emission] = []
    peak = 0
    waited = False
    while (t := m.next_event_s()) is not None:
        out += m.advance(t)
        peak = max(peak, m.held_tokens)
        waited |= m.num_waiting == 1
    assert waited and m.stats.preemptions >= 1
    assert set(m.stats.preempted_by_priority) == {"5"}
    assert peak <= small.kv_capacity_tokens
    keep = [e.time_s for e in out if e.rid == "keep"]
    victim = [e for e in out if e.rid == "victim"]
    assert [e.index for e in victim] == list(range(800))
    # keep never stalled longer than a decode step; the victim resumed only after keep
    # had freed room, with a prefill of its prompt and generated tokens
    gaps = [b - a for a, b in pairwise(keep)]
    assert max(gaps) < 0.05
    stall = max((b.time_s - a.time_s, b.index) for a, b in pairwise(victim))
    assert stall[0] >= small.prefill_ms(600 + stall[1], 0) / 1e3


def test_vllm_preempts_the_later_arrival_among_equals() -> None:
    small = replace(BASE, kv_capacity_tokens=2_000)
    m = EngineModel(small, random.Random(0), scheduler="vllm", priority=PriorityScheduling.vllm())
    m.submit("first", 600, 800, [], now_s=0.0, priority=3)
    m.submit("second", 600, 800, [], now_s=0.001, priority=3)
    run(m)
    assert m.stats.preemptions >= 1
    assert m.stats.preempted_by_priority == {"3": m.stats.preemptions}
    # the earlier one was never preempted: it finished first, in one go
    assert m.num_running == 0


def test_a_lone_request_larger_than_the_pool_is_never_preempted() -> None:
    small = replace(BASE, kv_capacity_tokens=1_000)
    m = EngineModel(small, random.Random(0), scheduler="vllm", priority=PriorityScheduling.vllm())
    m.submit("big", 900, 300, [], now_s=0.0, priority=0)
    out = run(m)
    assert [e.index for e in out] == list(range(300))
    assert m.stats.preemptions == 0
