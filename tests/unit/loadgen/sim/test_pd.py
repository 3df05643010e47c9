"""Prefill and decode apart in the simulator (loadgen/sim/kv_link.py, settings.pd): each
request's prefill leg on a prefill engine, its KV over the link between the two regions,
its decode on a decode engine; the router's books close both sides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from emulator.engine.disagg.prebuilt import PrebuiltModel
from loadgen.sim.kv_link import KvMover
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import SimResult, Simulation
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import window

SLICE = Path(__file__).resolve().parents[4] / "loadgen/data/mooncake-conversation-head400.jsonl"
REGIONS = ("us-ashburn", "eu-frankfurt", "ap-seoul")


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return window(read_trace(SLICE), limit=120)


def run(trace: list[TraceRequest], **kw: Any) -> tuple[Simulation, SimResult]:
    sim = Simulation(trace, SimSettings(policy="gorgo", time_scale=3.0, pd=True, **kw))
    return sim, sim.run()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_each_request_is_prefilled_on_one_engine_and_decoded_on_another(
    trace: list[TraceRequest], protocol: str
) -> None:
    sim, res = run(trace, pd_protocol=protocol)
    assert res.kv is not None
    assert set(sim.engines) == {*REGIONS, *(f"{r}-prefill" for r in REGIONS)}
    for r in res.requests:  # the client's answer comes from a decode engine, whole
        assert r.status == "ok" and r.backend in REGIONS
        assert r.ttft_ms is not None and r.e2e_ms is not None and 0 < r.ttft_ms <= r.e2e_ms
    prefills = {b: e for b, e in sim.engines.items() if b.endswith("-prefill")}
    decodes = {b: e for b, e in sim.engines.items() if b in REGIONS}
    assert all(isinstance(e, PrebuiltModel) for e in decodes.values())
    apart = [r for r in res.requests if r.id in sim.kv.sent]
    if protocol == "sglang":  # SGLang's decode engines take only requests with their KV
        assert len(apart) == len(trace)
    else:  # vLLM's prefill what comes without kv_transfer_params: the router chose some
        assert 0 < len(apart) < len(trace)
    # each prompt sent apart prefilled once on a prefill engine (one token there)...
    assert sum(e.stats.prompt_tokens for e in prefills.values()) == sum(
        r.input_tokens for r in apart
    )
    assert sum(e.stats.requests_admitted for e in prefills.values()) == len(apart)
    # ...its KV moved to a decode engine, which started it on that KV; the rest whole there
    assert sum(e.stats.requests_admitted for e in decodes.values()) == len(trace)
    assert res.kv.prefills == len(apart) and len(res.kv.transfer_ms) == len(apart)
    # the router's books: nothing in flight on either side, no leg left
    assert not res.router.in_flight and not res.router.fleet.state.legs
    assert all(b.load.in_flight == 0 for b in res.router.backends.values())
    assert sum(b.stats.completed for b in res.router.backends.values()) == len(trace)


def test_a_slower_link_sends_fewer_prefills_to_other_regions(
    trace: list[TraceRequest],
) -> None:
    fast, slow = (run(trace, kv_link_gbps=gbps)[1].kv for gbps in (100.0, 1.0))
    assert fast is not None and slow is not None
    assert fast.remote > 0 and slow.remote < fast.remote
    if slow.remote:  # what went remote anyway took longer
        assert slow.as_json()["remote_transfer_ms_p50"] > fast.as_json()["remote_transfer_ms_p50"]
    print(f"remote prefills: {fast.remote} at 100 Gbps, {slow.remote} at 1 Gbps")


def test_p_d_settings_are_checked() -> None:
    for bad, error in [
        ({"pd": True, "pd_aggregated": True}, "one layout"),
        ({"pd": True, "kv_link_gbps": 0.0}, "kv_link_gbps"),
        ({"pd": True, "pd_protocol": "nixl"}, "pd_protocol"),
        ({"pd": True, "rtt_profile": "paper"}, "network"),
    ]:
        with pytest.raises(ValueError, match=error):
            SimSettings(**bad)  # type: ignore[arg-type]


def test_a_transfer_waits_for_its_wire_and_vllms_two_steps() -> None:
    """Bytes / bandwidth, one transfer after another on a wire, plus the link's RTT once;
    vLLM's transfer starts only after the relay through the router."""
    regions = {"a-prefill": "us-ashburn", "a": "us-ashburn", "b": "eu-frankfurt"}
    mover = KvMover({}, regions, {"a": 1000, "b": 1000}, lambda a, b: 8e-6, False)  # 1 kB/s
    first, second, far = (TraceRequest(i, 0.0, 1000, 1, (), 512, f"s{i}") for i in range(3))
    mover.send(first, "a-prefill", "a")
    mover.send(second, "a-prefill", "a")
    mover.send(far, "a-prefill", "b", relay_s=0.5)
    # 1,000 tokens x 1,000 bytes at 1 kB/s: 1,000 s on the wire; the region's RTT 1 ms
    assert mover.prefilled("t0", 0, 10.0) == pytest.approx(10.0 + 1000 + 0.001)
    assert mover.prefilled("t1", 0, 10.0) == pytest.approx(10.0 + 2000 + 0.001)  # in turn
    # another wire (us -> eu), after the relay, then 90 ms of RTT
    assert mover.prefilled("t2", 0, 10.0) == pytest.approx(10.5 + 1000 + 0.090)
    assert (mover.stats.prefills, mover.stats.remote) == (3, 1)
