"""The policies known by name (policy/catalog.py): every built-in one registered, built
from its name and parameters, and always choosing one of its candidates."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.policy.baselines import PrefixCacheParams
from ext_proc.policy.catalog import POLICIES, make_policy, policy_info, policy_params
from tests.builders import candidate, chat, make_config

BASELINES = {"round_robin", "random", "least_request", "least_load", "session_affinity"}


def test_every_built_in_policy_is_registered() -> None:
    assert {*BASELINES, "prefix_cache", "gorgo", "gorgo_time3", "gorgo_tokens"} <= set(POLICIES)
    assert not any(POLICIES[name].weighted for name in BASELINES | {"prefix_cache"})
    assert POLICIES["gorgo"].weighted


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'gorgoo' \(known: .*gorgo, "):
        policy_info("gorgoo")


def test_a_policy_is_built_with_its_parameters_or_its_defaults() -> None:
    cfg = make_config("prefix_cache", policies={"prefix_cache": {"balance_abs": 9}})
    assert policy_params(cfg) == PrefixCacheParams(balance_abs=9)
    assert policy_params(cfg, "session_affinity").prefix_tokens == 256  # its default
    assert make_policy("prefix_cache", random.Random(0)).name == "prefix_cache"


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(sorted(POLICIES)),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=8),
    st.integers(0, 2**32),
)
def test_a_policy_always_returns_one_of_its_candidates(
    name: str, loads: list[tuple[int, int]], seed: int
) -> None:
    policy = make_policy(name, random.Random(seed))
    weights = policy_params(make_config(), name).weights if POLICIES[name].weighted else None
    candidates = [
        candidate(
            f"b{i}",
            in_flight=n,
            waiting_first_byte=min(n, w),
            in_flight_tokens=n * 100,
            rtt_ms=10.0 * w,
            queue_ms=5.0 * n,
            prefill_ms=20.0,
            cached_tokens=64 * w,
            uncached_tokens=100,
        )
        for i, (n, w) in enumerate(loads)
    ]
    for i in range(5):
        chosen = policy.choose(chat(rid=f"r{i}", stream=False), candidates, weights).backend_id
        assert chosen in {c.backend_id for c in candidates}
