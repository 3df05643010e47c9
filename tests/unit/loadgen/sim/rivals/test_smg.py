"""SMG's policies as its code documents them: least_load's expected wait W and its since-poll
credit, the overload veto, cache_aware's tree and spill gate, prefix_hash's bounded ring."""

from __future__ import annotations

import random

import pytest

from loadgen.sim.rivals.base import EngineLoad
from loadgen.sim.rivals.smg import SmgCacheAware, SmgLeastLoad, SmgParams, SmgPrefixHash
from tests.unit.loadgen.sim.rivals.fakes import FakeView, fleet

IDLE = EngineLoad(waiting_reqs=0, running_reqs=0, kv_usage=0.0)


def least_load(view: FakeView, **kw: object) -> SmgLeastLoad:
    policy = SmgLeastLoad(random.Random(0), SmgParams(**kw))  # type: ignore[arg-type]
    policy.bind(view)
    return policy


def test_w_is_queued_running_and_dispatched_work_over_throughput_plus_kv_pressure() -> None:
    view = FakeView()
    policy = least_load(view)
    policy.on_poll("a", EngineLoad(3, 2, 0.5, 1000.0, waiting_uncached_tokens=4000))
    # no waiting-token count: waiting requests x p; no throughput: the 2000 tok/s default
    policy.on_poll("b", EngineLoad(3, 0, 0.0))
    w = policy.expected_wait_s(fleet(a=5, b=3))
    assert w["a"] == pytest.approx((4000 + 2 * 1024) / 1000 + 0.15 * 0.5 / 0.5)
    assert w["b"] == pytest.approx(3 * 1024 / 2000)
    # KV usage is capped at 0.999: the barrier stays finite
    policy.on_poll("a", EngineLoad(0, 0, 1.0, 1000.0))
    assert policy.expected_wait_s(fleet(a=0))["a"] == pytest.approx(0.15 * 0.999 / 0.001)


def test_the_r_p_term_can_be_left_out_as_in_the_v1_9_code() -> None:
    policy = least_load(FakeView(), running_term=False)
    policy.on_poll("a", EngineLoad(0, 4, 0.0, 1000.0))
    assert policy.expected_wait_s(fleet(a=4))["a"] == 0.0


def test_dispatches_since_the_poll_water_fill_and_a_poll_releases_them() -> None:
    view = FakeView()
    policy = least_load(view)
    for b in "ab":
        policy.on_poll(b, IDLE)
    picks = [
        policy.choose(view.request(f"r{i}", [i]), fleet(a=0, b=0), None).backend_id
        for i in range(4)
    ]
    # each pick credits its worker p = 1024 tokens until the next poll: they alternate
    assert sorted(picks) == ["a", "a", "b", "b"]
    assert policy.since_poll == {"a": 2048.0, "b": 2048.0}
    policy.on_poll("a", IDLE)
    assert policy.since_poll["a"] == 0.0
    assert policy.choose(view.request("r9", [9]), fleet(a=0, b=0), None).backend_id == "a"


def test_without_reports_it_joins_the_shortest_queue_and_a_dark_worker_is_priced() -> None:
    view = FakeView()
    policy = least_load(view)
    assert policy.expected_wait_s(fleet(a=3, b=1)) == {"a": 3.0, "b": 1.0}
    policy.on_poll("a", EngineLoad(0, 0, 0.0, 4000.0))
    # b reports nothing: its in-flight count x p over the reporters' mean throughput
    assert policy.expected_wait_s(fleet(a=3, b=1))["b"] == pytest.approx(1024 / 4000)


@pytest.mark.parametrize(
    ("load", "vetoed"),
    [
        (EngineLoad(8, 0, 0.1), True),
        (EngineLoad(7, 0, 0.1), False),
        (EngineLoad(0, 0, 0.8), True),
        (EngineLoad(0, 0, 0.79), False),
    ],
)
def test_the_overload_veto_at_waiting_8_or_kv_0_8(load: EngineLoad, vetoed: bool) -> None:
    view = FakeView()
    policy = least_load(view)
    policy.on_poll("a", load)
    policy.on_poll("b", EngineLoad(0, 30, 0.7, 100.0))  # far worse W, but not overloaded
    picked = policy.choose(view.request("r", [1]), fleet(a=0, b=9), None).backend_id
    assert picked == ("b" if vetoed else "a")


def test_every_worker_vetoed_goes_to_the_least_loaded() -> None:
    view = FakeView()
    policy = least_load(view)
    policy.on_poll("a", EngineLoad(9, 0, 0.0))
    policy.on_poll("b", EngineLoad(0, 0, 0.9))
    assert policy.choose(view.request("r", [1]), fleet(a=5, b=2), None).backend_id == "b"


def test_the_bench_configuration_polls_every_2_s_with_the_profiles_throughput() -> None:
    view = FakeView(throughput_tok_s=3456.0)
    policy = SmgLeastLoad(random.Random(0))
    policy.bind(view)
    assert policy.poll_interval_s == 2.0 and policy.p.default_throughput_tok_s == 3456.0
    assert SmgCacheAware(random.Random(0)).poll_interval_s == 10.0


def cache_aware(view: FakeView, **kw: object) -> SmgCacheAware:
    policy = SmgCacheAware(random.Random(0), SmgParams(**kw))  # type: ignore[arg-type]
    policy.bind(view)
    for b in "abc":
        policy.on_poll(b, IDLE)
    return policy


def test_a_hit_above_0_3_follows_the_tree_and_a_miss_takes_argmin_w() -> None:
    view = FakeView()
    policy = cache_aware(view)
    policy.tree.insert(view.request("old", [1, 2, 3]) and view.prompt("old"), "c", 0.0)
    # c's W is the worst (busy engine), yet it holds 2 of 3 blocks: 0.67 > 0.3
    policy.on_poll("c", EngineLoad(5, 3, 0.5, 1000.0))
    assert (
        policy.choose(view.request("hit", [1, 2, 30]), fleet(a=0, b=0, c=2), None).backend_id == "c"
    )
    # 1 of 4 blocks matched: 0.25 <= 0.3, a miss: argmin W (a or b, not c)
    miss = policy.choose(view.request("miss", [1, 7, 8, 9]), fleet(a=0, b=0, c=2), None)
    assert miss.backend_id in {"a", "b"}
    # the chosen worker became a tenant of the whole prompt
    assert policy.tree.match(view.prompt("miss")).tenants == {miss.backend_id}


def test_a_holder_over_1_5_mean_and_mean_plus_margin_spills_to_argmin_w() -> None:
    view = FakeView()
    policy = cache_aware(view)
    policy.tree.insert(view.request("old", [1, 2]) and view.prompt("old"), "c", 0.0)
    # loads 0, 0, 9: mean 3, margin max(4, 2 sqrt 3 = 3.46) = 4: 9 > 4.5 and 9 > 7: spills
    spilled = policy.choose(view.request("r1", [1, 2, 5]), fleet(a=0, b=0, c=9), None)
    assert spilled.backend_id in {"a", "b"}
    # loads 0, 0, 6: 6 > 4.5 but not > 2 + 4 = 6: it stays
    kept = policy.choose(view.request("r2", [1, 2, 6]), fleet(a=0, b=0, c=6), None)
    assert kept.backend_id == "c"


def test_the_spill_margin_is_64_capped_at_two_sigma_never_under_4() -> None:
    policy = cache_aware(FakeView())
    assert policy.spill_margin(1.0) == 4.0
    assert policy.spill_margin(100.0) == 20.0
    assert policy.spill_margin(10_000.0) == 64.0
    assert cache_aware(FakeView(), balance_abs_threshold=2).spill_margin(100.0) == 2.0


def test_the_tree_is_evicted_to_its_size_at_the_interval() -> None:
    view = FakeView()
    # one 512-token block is 2048 characters; the tree may hold two
    policy = cache_aware(view, max_tree_chars=2 * 2048, eviction_interval_s=60.0)
    for i, b in enumerate([11, 12, 13]):
        view.t = float(i)
        policy.choose(view.request(f"r{i}", [b]), fleet(a=0, b=0, c=0), None)
    assert len(policy.tree) == 3
    view.t = 60.0
    policy.choose(view.request("r9", [14]), fleet(a=0, b=0, c=0), None)
    # evicted at 60 s down to two blocks (the oldest went), then r9 inserted
    assert len(policy.tree) == 3 and policy.tree.match(view.prompt("r0")).rate == 0.0


def prefix_hash(view: FakeView) -> SmgPrefixHash:
    policy = SmgPrefixHash(random.Random(0))
    policy.bind(view)
    return policy


def test_prefix_hash_keeps_a_prompts_owner_under_max_1_25_avg_avg_plus_10() -> None:
    view = FakeView()
    policy = prefix_hash(view)
    owner = policy.choose(view.request("r0", [42, 1]), fleet(a=0, b=0, c=0), None).backend_id
    assert (
        policy.choose(view.request("r1", [42, 2]), fleet(a=0, b=0, c=0), None).backend_id == owner
    )
    others = [b for b in "abc" if b != owner]
    # total 20 -> avg 7, bound max(8.75, 17) = 17: the owner at 17 keeps it
    loads = {owner: 17, others[0]: 2, others[1]: 1}
    assert policy.choose(view.request("r2", [42]), fleet(**loads), None).backend_id == owner
    # one more on the owner (total 21, avg 22/3, bound 17.33): the least loaded takes it
    loads[owner] = 18
    assert policy.choose(view.request("r3", [42]), fleet(**loads), None).backend_id == others[1]
