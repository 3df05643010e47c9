"""The rivals in the simulator: every request served, the engine loads polled on the virtual
clock and answered a half-trip later, KV events reaching Dynamo, every rival's books closed;
and the product's registry left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.policy.catalog import POLICIES
from loadgen.sim.rivals.base import EngineLoad
from loadgen.sim.rivals.dynamo import DynamoKv
from loadgen.sim.rivals.llmd import LlmdSticky
from loadgen.sim.rivals.names import RIVAL_NAMES
from loadgen.sim.rivals.smg import SmgCacheAware
from loadgen.sim.rivals.vllm_router import VllmRouterStickyLeastLoaded
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import Simulation
from loadgen.traces.readers import read_trace
from loadgen.traces.windows import window

SLICE = Path(__file__).resolve().parents[5] / "loadgen/data/mooncake-conversation-head400.jsonl"


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return window(read_trace(SLICE), limit=80)


def test_the_rivals_stay_out_of_the_products_registry() -> None:
    import loadgen.sim.rivals.catalog  # noqa: F401  (registers them)

    assert not set(RIVAL_NAMES) & set(POLICIES)


@pytest.mark.parametrize("name", RIVAL_NAMES)
def test_each_rival_serves_every_request_deterministically(trace, name: str) -> None:  # type: ignore[no-untyped-def]
    runs = [Simulation(trace, SimSettings(policy=name, time_scale=3.0)).run() for _ in range(2)]
    res = runs[0]
    assert all(r.status == "ok" and r.ttft_ms is not None for r in res.requests)
    assert res.router.policy.name == name and not res.router.in_flight
    assert [r.backend for r in res.requests] == [r.backend for r in runs[1].requests]
    # a rival with load feedback spreads the work
    if name != "vllm_router_sticky_least_loaded":
        assert len({r.backend for r in res.requests}) >= 2


def test_smg_polls_every_10_s_of_virtual_time_a_half_trip_late(trace) -> None:  # type: ignore[no-untyped-def]
    sim = Simulation(trace, SimSettings(policy="smg_cache_aware", time_scale=3.0))
    rival = sim.rival
    assert isinstance(rival, SmgCacheAware)
    heard: list[tuple[float, str]] = []
    on_poll = rival.on_poll

    def spy(backend: str, load: EngineLoad) -> None:
        heard.append((sim.now_s, backend))
        on_poll(backend, load)

    rival.on_poll = spy  # type: ignore[method-assign]
    sim.run()
    seoul = [t for t, b in heard if b == "ap-seoul"]
    # read at 0, 10, 20 ... s; heard 90 ms (half of 180) later
    assert seoul[:3] == pytest.approx([0.09, 10.09, 20.09], abs=0.01)
    assert set(rival.loads) == {"us-ashburn", "eu-frankfurt", "ap-seoul"}


def test_the_rivals_books_close_with_the_run(trace) -> None:  # type: ignore[no-untyped-def]
    sim = Simulation(trace, SimSettings(policy="dynamo_kv", time_scale=3.0))
    sim.run()
    dyn = sim.rival
    assert isinstance(dyn, DynamoKv)
    assert any(dyn.cached.values())  # the engines' KV events reached it
    assert all(not b.blocks and not b.prefill_tokens for b in dyn.books.values())
    sim = Simulation(trace, SimSettings(policy="llmd_sticky", time_scale=3.0))
    sim.run()
    assert isinstance(sim.rival, LlmdSticky) and not any(sim.rival.in_flight_tokens.values())
    sim = Simulation(trace, SimSettings(policy="vllm_router_sticky_least_loaded"))
    sim.run()
    assert isinstance(sim.rival, VllmRouterStickyLeastLoaded)
    assert len(sim.rival.sessions) == len({r.session for r in trace})


def test_a_rival_decides_alone() -> None:
    with pytest.raises(ValueError, match="one router"):
        Simulation([], SimSettings(policy="smg_least_load", routers=2))


def test_single_puts_every_backend_1_ms_away() -> None:
    s = SimSettings(rtt_profile="single")
    assert {r: s.rtt_ms("", r)[0] for r in s.regions} == dict.fromkeys(s.regions, 1.0)
