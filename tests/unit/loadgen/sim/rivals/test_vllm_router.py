"""vllm-router's cache_aware (the old SGLang rule: a global imbalance switch, then the tree)
and sticky_least_loaded (sessions kept, new ones to the fewest sessions)."""

from __future__ import annotations

import random

from loadgen.sim.rivals.vllm_router import (
    VllmRouterCacheAware,
    VllmRouterParams,
    VllmRouterStickyLeastLoaded,
)
from tests.unit.loadgen.sim.rivals.fakes import FakeView, fleet


def cache_aware(view: FakeView, **kw: object) -> VllmRouterCacheAware:
    policy = VllmRouterCacheAware(random.Random(0), VllmRouterParams(**kw))  # type: ignore[arg-type]
    policy.bind(view)
    return policy


def test_a_hit_goes_to_the_trees_tenant_and_a_miss_to_the_least_loaded() -> None:
    view = FakeView()
    policy = cache_aware(view)
    policy.tree.insert(view.request("old", [1, 2]) and view.prompt("old"), "c", 0.0)
    # 2 of 3 blocks: a hit, whatever c's load (no global imbalance: 40 - 0 <= 64)
    assert (
        policy.choose(view.request("hit", [1, 2, 3]), fleet(a=0, b=0, c=40), None).backend_id == "c"
    )
    # a miss: min_by_key, the first of the least loaded
    assert policy.choose(view.request("miss", [7]), fleet(a=1, b=0, c=0), None).backend_id == "b"


def test_the_global_imbalance_switch_needs_both_max_min_over_64_and_1_5x() -> None:
    view = FakeView()
    policy = cache_aware(view)
    policy.tree.insert(view.request("old", [1, 2]) and view.prompt("old"), "c", 0.0)
    # 70 - 5 = 65 > 64 and 70 > 7.5: imbalanced, to the least loaded despite the hit
    assert (
        policy.choose(view.request("r1", [1, 2, 4]), fleet(a=5, b=6, c=70), None).backend_id == "a"
    )
    # 130 - 65 = 65 > 64 and 130 > 97.5: imbalanced
    assert (
        policy.choose(view.request("r2", [1, 2, 5]), fleet(a=65, b=66, c=130), None).backend_id
        == "a"
    )
    # 150 - 90 = 60: balanced, the tree wins
    assert (
        policy.choose(view.request("r3", [1, 2, 6]), fleet(a=90, b=90, c=150), None).backend_id
        == "c"
    )
    # 140 > 1.5 x 100 but 140 - 100 = 40 is not over 64: balanced, the tree
    assert (
        policy.choose(view.request("r4", [1, 2, 8]), fleet(a=100, b=100, c=140), None).backend_id
        == "c"
    )
    # 280 - 200 = 80 > 64 but 280 < 300: balanced
    assert (
        policy.choose(view.request("r5", [1, 2, 9]), fleet(a=200, b=200, c=280), None).backend_id
        == "c"
    )


def test_each_tenant_is_evicted_to_its_own_size() -> None:
    view = FakeView()
    policy = cache_aware(view, max_tree_chars=2048, eviction_interval_s=120.0)
    policy.tree.insert(view.request("a1", [1]) and view.prompt("a1"), "a", 0.0)
    policy.tree.insert(view.request("a2", [2]) and view.prompt("a2"), "a", 1.0)
    policy.tree.insert(view.request("b1", [3]) and view.prompt("b1"), "b", 0.0)
    view.t = 120.0
    policy.choose(view.request("r", [4]), fleet(a=0, b=0), None)
    # a held 2 blocks (4096 chars) over its 2048: its oldest went; b's one block stayed
    assert policy.tree.match(view.prompt("a1")).rate == 0.0
    assert policy.tree.match(view.prompt("a2")).tenants == {"a"}
    assert policy.tree.match(view.prompt("b1")).tenants == {"b"}


def sticky(view: FakeView) -> VllmRouterStickyLeastLoaded:
    policy = VllmRouterStickyLeastLoaded(random.Random(0))
    policy.bind(view)
    return policy


def test_a_session_sticks_and_new_sessions_go_to_the_fewest_sessions() -> None:
    view = FakeView()
    policy = sticky(view)
    first = [
        policy.choose(
            view.request(f"s{i}", [i], session=f"s{i}"), fleet(a=0, b=0, c=0), None
        ).backend_id
        for i in range(3)
    ]
    assert sorted(first) == ["a", "b", "c"]
    # s0 again: its worker, however loaded
    assert (
        policy.choose(
            view.request("s0b", [0, 9], session="s0"), fleet(a=50, b=50, c=50), None
        ).backend_id
        == first[0]
    )
    assert policy.active == {"a": 1, "b": 1, "c": 1}


def test_a_request_without_a_session_is_balanced_but_not_recorded() -> None:
    view = FakeView()
    policy = sticky(view)
    policy.choose(view.request("s", [1], session="s"), fleet(a=0, b=0), None)
    picked = policy.choose(view.request("anon", [2]), fleet(a=0, b=0), None).backend_id
    assert policy.active.get(picked, 0) == 0 and len(policy.sessions) == 1


def test_sessions_expire_after_2_h_unused() -> None:
    view = FakeView()
    policy = sticky(view)
    policy.choose(view.request("s", [1], session="s"), fleet(a=0, b=0), None)
    view.t = 7199.0
    policy.choose(view.request("t", [2], session="t"), fleet(a=0, b=0), None)
    assert len(policy.sessions) == 2
    view.t = 7200.0 + 60.0
    policy.choose(view.request("u", [3], session="u"), fleet(a=0, b=0), None)
    assert "s" not in policy.sessions and "t" in policy.sessions
