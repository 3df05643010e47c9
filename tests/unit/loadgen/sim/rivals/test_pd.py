"""The P/D routers' rules (loadgen/sim/rivals/pd.py): each leg by its own rule instance,
llm-d's decider and topology bonus, Dynamo's decode kept in the prefill's zone; and each
rule through a whole simulated P/D fleet, its legs on the engines of their roles."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadgen.sim.rivals.base import EngineLoad
from loadgen.sim.rivals.pd import LLMD_NON_CACHED_TOKENS, DynamoPd, LlmdPd, SmgPd, VllmRouterPd
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import Simulation
from loadgen.traces.readers import read_trace
from loadgen.traces.windows import window
from tests.unit.loadgen.sim.rivals.fakes import FakeView, fleet

SLICE = Path(__file__).resolve().parents[5] / "loadgen/data/mooncake-conversation-head400.jsonl"


def test_smg_and_vllm_router_pick_each_leg_with_a_rule_of_its_own() -> None:
    for cls in (SmgPd, VllmRouterPd):
        policy = cls(random.Random(0))
        view = FakeView()
        policy.bind(view)
        assert policy.prefill is not policy.decode  # two instances: two trees
        # the prefix goes to a-prefill and b-decode: each leg's tree holds its own pick
        pick = policy.choose_pair(
            view.request("r1", [1, 2, 3]), fleet(**{"b-decode": 0}), fleet(**{"a-prefill": 0})
        )
        assert (pick.decode, pick.prefill) == ("b-decode", "a-prefill")
        decodes, prefills = (
            fleet(**{"a-decode": 0, "b-decode": 0}),
            fleet(**{"a-prefill": 0, "b-prefill": 0}),
        )
        pick = policy.choose_pair(view.request("r2", [1, 2, 3]), decodes, prefills)
        assert (pick.decode, pick.prefill) == ("b-decode", "a-prefill"), cls.name


def test_llmd_prefills_on_the_decode_pod_below_the_threshold_and_prefers_its_zone() -> None:
    policy = LlmdPd(random.Random(0))
    view = FakeView(block_tokens=64, engine_block_tokens=64)
    policy.bind(view)
    for b in ("a-prefill", "b-prefill"):  # equal queues: the topology bonus decides
        policy.on_poll(b, EngineLoad(0, 0, 0.0))
    decodes, prefills = fleet(**{"a-decode": 0}), fleet(**{"a-prefill": 0, "b-prefill": 0})
    first = policy.choose_pair(view.request("r1", [1, 2]), decodes, prefills)
    assert first.prefill == "a-prefill"  # zone 0.05 over nothing
    # the same prompt again: all of it matched on the decode pod, fewer than 16 uncached
    again = policy.choose_pair(
        view.request("r2", [1, 2], 128 + LLMD_NON_CACHED_TOKENS - 1), decodes, prefills
    )
    assert again == type(first)("a-decode", None)


def test_dynamo_keeps_the_decode_in_the_prefill_workers_zone() -> None:
    policy = DynamoPd(random.Random(0))
    view = FakeView()
    policy.bind(view)
    view.request("w", [7])
    policy.on_kv_events("b-prefill", [("stored", k, None) for k in view.engine_keys("w")])
    pick = policy.choose_pair(
        view.request("r", [7, 8]),
        fleet(**{"a-decode": 0, "b-decode": 5}),
        fleet(**{"a-prefill": 0, "b-prefill": 0}),
    )
    assert pick.prefill == "b-prefill"  # its cache holds the prefix
    assert pick.decode == "b-decode"  # though a-decode is idle: another zone


@pytest.mark.parametrize("rule", ["smg_pd", "vllm_router_pd", "llmd_pd", "dynamo_pd"])
def test_each_rule_runs_a_p_d_fleet_and_its_books_close(rule: str) -> None:
    trace = window(read_trace(SLICE), limit=60)
    sim = Simulation(trace, SimSettings(policy=rule, time_scale=3.0, pd=True))
    res = sim.run()
    assert all(r.status == "ok" and r.ttft_ms is not None for r in res.requests)
    assert all(r.backend in sim.s.regions for r in res.requests)  # decoded on decode engines
    assert res.kv is not None
    if rule == "llmd_pd":  # below the threshold the decode pod prefills: fewer legs apart
        assert res.kv.prefills <= len(trace)
    else:
        assert res.kv.prefills == len(trace)
    if rule == "dynamo_pd":
        assert res.kv.remote == 0
    assert not res.router.in_flight and not res.router.fleet.state.legs
