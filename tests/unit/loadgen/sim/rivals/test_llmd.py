"""llm-d's EPP: the 3:2:2 default's normalisations and max-score pick, its own prefix index,
and the guides' prefix-affinity filter with its TTFT escape, then the token-load scorer."""

from __future__ import annotations

import random

import pytest

from ext_proc.vocab.events import FirstByte
from loadgen.sim.rivals.base import EngineLoad
from loadgen.sim.rivals.llmd import LlmdSticky, LlmdWeighted, prefix_blocks
from loadgen.sim.rivals.trees import LruBlocks
from tests.unit.loadgen.sim.rivals.fakes import FakeView, fleet


def weighted(view: FakeView) -> LlmdWeighted:
    policy = LlmdWeighted(random.Random(0))
    policy.bind(view)
    return policy


def test_3_prefix_2_queue_2_kv_with_min_max_queue_and_one_minus_usage() -> None:
    view = FakeView()
    policy = weighted(view)
    policy.on_poll("a", EngineLoad(4, 0, 0.5))
    policy.on_poll("b", EngineLoad(0, 0, 0.1))
    policy.on_poll("c", EngineLoad(2, 0, 0.3))
    # a was sent the first block: of the new prompt's 16 64-token blocks it holds 8
    policy.choose(view.request("old", [1]), fleet(a=0, b=0, c=0), None)
    held = next(s for s in "abc" if policy.index.size(s))
    for s in "abc":
        policy.on_poll(
            s,
            {"a": EngineLoad(4, 0, 0.5), "b": EngineLoad(0, 0, 0.1), "c": EngineLoad(2, 0, 0.3)}[s],
        )
    choice = policy.choose(view.request("new", [1, 2]), fleet(a=0, b=0, c=0), None)
    queue = {"a": 0.0, "b": 1.0, "c": 0.5}
    kv = {"a": 0.5, "b": 0.9, "c": 0.7}
    want = {s: 3 * (0.5 if s == held else 0.0) + 2 * queue[s] + 2 * kv[s] for s in "abc"}
    assert {s: -v for s, v in choice.scores.items()} == pytest.approx(want)
    assert choice.backend_id == max(want, key=lambda s: want[s])


def test_equal_queues_score_1_each() -> None:
    view = FakeView()
    policy = weighted(view)
    for s in "ab":
        policy.on_poll(s, EngineLoad(3, 0, 0.0))
    choice = policy.choose(view.request("r", [5]), fleet(a=0, b=0), None)
    assert choice.scores == {"a": -4.0, "b": -4.0}


def test_the_prefix_index_is_per_server_lru_of_what_it_was_sent() -> None:
    index = LruBlocks()
    index.add([1, 2, 3], "a", capacity=3)
    index.add([1, 2], "b", capacity=3)
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    index.add([9], "a", capacity=3)  # 1 was a's least recent: gone from a
    assert index.match([1, 2, 3]) == {"b": 2, "a": 2}
    assert index.match([5, 1]) == {}


def test_blocks_are_at_least_64_tokens_and_full_only() -> None:
    view = FakeView()
    p = view.request("r", [1, 2], input_tokens=1000) and view.prompt("r")
    assert len(prefix_blocks(p, 64)) == 1000 // 64
    assert prefix_blocks(p, 64)[:8] == prefix_blocks(
        view.request("s", [1]) and view.prompt("s"), 64
    )


def sticky(view: FakeView) -> LlmdSticky:
    policy = LlmdSticky(random.Random(0))
    policy.bind(view)
    return policy


def test_sticky_keeps_servers_over_0_8_and_picks_the_least_in_flight_tokens() -> None:
    view = FakeView()
    policy = sticky(view)
    first = policy.choose(view.request("t1", [1, 2, 3, 4]), fleet(a=0, b=0, c=0), None).backend_id
    # 4 of 5 blocks there: 0.8 >= 0.8, sticky though it has 2048 tokens in flight
    again = policy.choose(view.request("t2", [1, 2, 3, 4, 5]), fleet(a=0, b=0, c=0), None)
    assert again.backend_id == first and list(again.scores) == [first]
    # 3 of 5: 0.6, nobody sticky: the least in-flight tokens (not `first`)
    other = policy.choose(view.request("t3", [1, 2, 3, 6, 7]), fleet(a=0, b=0, c=0), None)
    assert other.backend_id != first and len(other.scores) == 3


def test_stickiness_breaks_when_its_ttft_is_18_s_over_the_best_other() -> None:
    view = FakeView()
    policy = sticky(view)
    home = policy.choose(view.request("t1", [1]), fleet(a=0, b=0), None).backend_id
    other = "b" if home == "a" else "a"
    # 18000 ms at 15928 tok/s = 286,704 tokens: under that gap it stays home
    policy.in_flight_tokens[home] = 286_000
    assert policy.choose(view.request("t2", [1]), fleet(a=0, b=0), None).backend_id == home
    # a little more in flight there (t2 added none: all cached) and stickiness breaks
    policy.in_flight_tokens[home] = 286_705
    assert policy.choose(view.request("t3", [1]), fleet(a=0, b=0), None).backend_id == other


def test_in_flight_tokens_are_the_uncached_part_released_at_the_first_byte() -> None:
    view = FakeView()
    policy = sticky(view)
    home = policy.choose(view.request("t1", [1]), fleet(a=0), None).backend_id
    assert policy.in_flight_tokens[home] == 512
    policy.choose(view.request("t2", [1, 2]), fleet(a=0), None)
    assert policy.in_flight_tokens[home] == 512 + 512  # the first block is cached there
    policy.on_first_byte(FirstByte("t1", home, 100.0, 1.0))
    assert policy.in_flight_tokens[home] == 512
