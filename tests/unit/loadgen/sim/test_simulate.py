"""The offline simulator: complete, deterministic, and driving the real router."""

from dataclasses import replace
from pathlib import Path

import pytest

from loadgen.client.protocol import OPEN
from loadgen.results import RequestResult, summarize
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import Simulation, simulate
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.synthetic import synthetic
from loadgen.traces.windows import scaled, window
from tests.builders import Dispatches

SLICE = Path(__file__).resolve().parents[4] / "loadgen/data/mooncake-conversation-head400.jsonl"


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return window(read_trace(SLICE), limit=150)


def test_every_request_completes_with_sane_timings(trace) -> None:  # type: ignore[no-untyped-def]
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0))
    assert [r.id for r in res.requests] == [r.id for r in trace]
    for r, t in zip(res.requests, trace, strict=True):
        assert r.status == "ok" and r.backend in {"us-ashburn", "eu-frankfurt", "ap-seoul"}
        assert r.ttft_ms is not None and r.e2e_ms is not None
        assert 0 < r.ttft_ms <= r.e2e_ms
        assert (r.input_tokens, r.output_tokens) == (t.input_tokens, t.output_tokens)
        assert 0 <= r.cached_tokens < r.input_tokens
    # the router's books are closed: nothing left in flight
    assert not res.router.in_flight
    assert sum(b.stats.completed for b in res.router.backends.values()) == len(trace)
    assert len(res.itl_ms) == sum(t.output_tokens - 1 for t in trace)


def test_progress_counts_finished_requests_up_to_the_runs_total(trace) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[int, int]] = []
    res = simulate(trace, SimSettings(policy="gorgo"), progress=lambda *a: seen.append(a))
    done = [d for d, _ in seen]
    assert {t for _, t in seen} == {len(trace)} and done[-1] == len(trace)
    assert done == sorted(done) and len(set(done)) > len(trace) // 2  # as they finish
    # the protocol's drops are not in the run: its total is what is left
    seen.clear()
    capped = SimSettings(policy="gorgo", protocol=replace(OPEN, max_input_tokens=20_000))
    res = simulate(trace, capped, progress=lambda *a: seen.append(a))
    assert res.dropped > 0 and seen[-1] == (len(trace) - res.dropped,) * 2


def test_deterministic_for_a_seed(trace) -> None:  # type: ignore[no-untyped-def]
    def run(seed: int) -> list[tuple[str, float | None]]:
        res = simulate(trace[:60], SimSettings(policy="gorgo", time_scale=3.0, seed=seed))
        return [(r.backend, r.ttft_ms) for r in res.requests]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_lighter_load_lowers_ttft(trace) -> None:  # type: ignore[no-untyped-def]
    heavy = summarize(simulate(trace, SimSettings(policy="least_request", time_scale=1.0)).requests)
    light = summarize(simulate(trace, SimSettings(policy="least_request", time_scale=6.0)).requests)
    assert light["ttft_ms"]["p95"] < heavy["ttft_ms"]["p95"]


def test_cache_aware_policies_reuse_prefixes() -> None:
    # 30 sessions of 4 turns, each turn carrying its history: a cache-aware router hits
    trace = synthetic(sessions=30, turns=4, rate_rps=1.0, system_tokens=512, turn_tokens=1500)
    hits = {}
    for policy in ("gorgo", "session_affinity", "random"):
        res = simulate(trace, SimSettings(policy=policy, time_scale=1.0))
        hits[policy] = summarize(res.requests)["cache_hit_rate"]
    assert hits["gorgo"] > hits["random"] + 0.1
    assert hits["session_affinity"] > hits["random"] + 0.1


def test_the_paper_rtt_profile_slows_distant_regions(trace) -> None:  # type: ignore[no-untyped-def]
    # Pacing off: it would reorder requests differently under each profile's jitter.
    unpaced = {"routing": {"pace_sigmas": 0}}
    net = simulate(
        trace[:40],
        SimSettings(policy="round_robin", time_scale=6.0, rtt_profile="network", router=unpaced),
    )
    paper = simulate(
        trace[:40],
        SimSettings(policy="round_robin", time_scale=6.0, rtt_profile="paper", router=unpaced),
    )
    seoul = [
        (a.ttft_ms, b.ttft_ms)
        for a, b in zip(net.requests, paper.requests, strict=True)
        if a.backend == "ap-seoul"
    ]
    assert seoul and all(b > a for a, b in seoul if a is not None and b is not None)


def test_scaled_stretches_arrivals() -> None:
    t = synthetic(sessions=3, turns=2)
    assert [r.arrival_s * 2 for r in t] == [r.arrival_s for r in scaled(t, 2)]


def test_precise_prefix_state_predicts_what_the_engines_report(trace) -> None:  # type: ignore[no-untyped-def]
    """With the engines' own cache changes (as KV events deliver them), the router's
    predicted cached tokens for its choice match the engine's report within 2 % of the
    prompt on average; the approximate state is reported beside it."""
    from loadgen.sim.run import prediction_error

    precise = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0, prefix_state="precise"))
    approximate = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0))
    err_precise = prediction_error(precise.requests)
    err_approximate = prediction_error(approximate.requests)
    print(f"cache prediction error: precise {err_precise:.2%}, approximate {err_approximate:.2%}")
    assert err_precise <= 0.02
    assert all(r.predicted_cached_tokens is not None for r in precise.requests)
    assert any(r.cached_tokens > 0 for r in precise.requests)  # the trace reuses prefixes
    assert {b for b, s in precise.router.backends.items() if s.precise} == {
        "us-ashburn",
        "eu-frankfurt",
        "ap-seoul",
    }


def test_several_routers_share_the_load_and_close_what_they_dispatched(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.sim.simulate import Simulation

    sim = Simulation(trace, SimSettings(policy="gorgo", time_scale=3.0, routers=3))
    res = sim.run()
    assert all(r.status == "ok" for r in res.requests)
    decisions = [router.decisions for router in sim.routers]
    assert sum(decisions) == len(trace) and min(decisions) > 0  # every router decided some
    for router in sim.routers:  # each closed exactly what it dispatched
        assert not router.in_flight
        assert sum(b.stats.completed for b in router.backends.values()) == router.decisions


def test_shared_dispatches_reach_every_other_router_and_are_all_closed(trace) -> None:  # type: ignore[no-untyped-def]
    """--share-dispatches: while the run goes, each router counts the others' requests in
    flight; at the end none is left, and no router learned from another's."""
    from loadgen.sim.simulate import Simulation

    sim = Simulation(
        trace, SimSettings(policy="gorgo", time_scale=3.0, routers=3, share_dispatches=True)
    )
    peak = [0, 0, 0]

    def hook(_res, _router) -> None:  # type: ignore[no-untyped-def]
        for i, r in enumerate(sim.routers):
            peak[i] = max(peak[i], len(r.peer_in_flight))

    sim.hook = hook
    res = sim.run()
    assert all(r.status == "ok" for r in res.requests)
    assert min(peak) > 0  # each router carried the others' load at some point
    for router in sim.routers:
        assert not router.in_flight and not router.peer_in_flight
        assert sum(b.load.in_flight for b in router.backends.values()) == 0
        assert sum(b.stats.completed for b in router.backends.values()) == router.decisions


def test_engine_reports_reach_the_routers(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.sim.simulate import Simulation

    sim = Simulation(trace, SimSettings(policy="gorgo", time_scale=1.0, engine_reports=True))
    sim.run()
    reports = [b.engine.report for b in sim.router.backends.values()]
    assert all(r is not None and r.running is not None for r in reports)
    assert all(b.engine.report_at_s is not None for b in sim.router.backends.values())


def test_front_doors_give_each_region_its_door_and_access_leg(trace) -> None:  # type: ignore[no-untyped-def]
    """Three doors: each session's client region is stable, its door's router decides, and
    TTFT counts the access leg: a single proxy in us-ashburn adds ap-seoul clients' 180 ms
    round trip, their own door 1 ms."""
    from loadgen.sim.settings import PROXY
    from loadgen.sim.simulate import Simulation

    one = Simulation(trace, SimSettings(policy="round_robin", time_scale=3.0, front_doors=1))
    three = Simulation(trace, SimSettings(policy="round_robin", time_scale=3.0, front_doors=3))
    assert list(one.routers_at) == ["us-ashburn"] and PROXY not in three.routers_at
    assert list(three.routers_at) == ["us-ashburn", "eu-frankfurt", "ap-seoul"]
    r1, r3 = one.run(), three.run()
    regions = {r.region for r in r1.requests}
    assert regions == {"us-ashburn", "eu-frankfurt", "ap-seoul"}
    assert [r.region for r in r1.requests] == [r.region for r in r3.requests]
    sessions: dict[str, str | None] = {}
    for t, r in zip(trace, r3.requests, strict=True):
        assert sessions.setdefault(t.session, r.region) == r.region  # a session stays put
    assert sum(router.decisions for router in three.routers) == len(trace)
    assert all(router.decisions > 0 for router in three.routers)
    # The config names the door's own RTTs: seoul's router sees its own backend at 1 ms.
    seoul = three.routers_at["ap-seoul"][0]
    assert seoul.backends["ap-seoul"].rtt_prior_ms == 1.0
    assert seoul.backends["eu-frankfurt"].rtt_prior_ms == 250.0


def test_each_front_door_has_its_own_routers(trace) -> None:  # type: ignore[no-untyped-def]
    """--front-doors 3 --routers 2: two routers behind each door, a session through one
    of its door's, every router deciding."""
    world = Simulation(trace, SimSettings(policy="gorgo", time_scale=3.0, front_doors=3, routers=2))
    world.run()
    assert {d: len(rs) for d, rs in world.routers_at.items()} == {
        "us-ashburn": 2,
        "eu-frankfurt": 2,
        "ap-seoul": 2,
    }
    assert all(router.decisions > 0 for router in world.routers)
    assert sum(router.decisions for router in world.routers) == len(trace)


def test_front_door_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"front_doors: 0\.\.3"):
        SimSettings(front_doors=4)
    with pytest.raises(ValueError, match="origin_shares"):
        SimSettings(front_doors=3, origin_shares=(1.0, 1.0))
    with pytest.raises(ValueError, match="network"):
        SimSettings(front_doors=3, rtt_profile="paper")
    shares = SimSettings(front_doors=3, origin_shares=(1.0, 0.0, 0.0))
    assert {shares.origin(f"s{i}") for i in range(50)} == {"us-ashburn"}


def test_spread_arrivals_keeps_each_request_within_its_step(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.traces.windows import spread_arrivals

    spread = spread_arrivals(trace, 3.0)
    assert sorted(r.id for r in spread) == sorted(r.id for r in trace)
    by_id = {r.id: r.arrival_s for r in trace}
    assert all(0 <= r.arrival_s - by_id[r.id] < 3.0 for r in spread)
    assert [r.arrival_s for r in spread] == sorted(r.arrival_s for r in spread)
    assert len({r.arrival_s for r in spread}) > len({r.arrival_s for r in trace})
    assert spread_arrivals(trace, 3.0) == spread  # deterministic


# The client protocol (loadgen.client.protocol): a concurrency cap with slip, forced output
# lengths, long prompts dropped.


def _max_in_flight(res, trace) -> int:  # type: ignore[no-untyped-def]
    """The most requests the client held at once: each holds its slot from dispatch
    (arrival + slip) until it sees the end (E2E later); one freed and one taken at the same
    instant count as a hand-over."""
    ts = res.settings.time_scale
    arrival = {r.id: r.arrival_s for r in trace}
    events = []
    for r in res.requests:
        sent_s = arrival[r.id] * ts + r.slip_ms / 1000
        events += [(sent_s, 1), (sent_s + r.e2e_ms / 1000 - 1e-9, -1)]
    held = most = 0
    for _, step in sorted(events):
        held += step
        most = max(most, held)
    return most


def test_a_concurrency_cap_holds_arrivals_and_measures_from_dispatch(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.client.protocol import Protocol

    open_loop = simulate(trace, SimSettings(policy="least_request", time_scale=1.0))
    capped = simulate(
        trace,
        SimSettings(policy="least_request", time_scale=1.0, protocol=Protocol(max_concurrency=8)),
    )
    assert all(r.slip_ms == 0.0 for r in open_loop.requests)
    assert _max_in_flight(open_loop, trace) > 8  # the load needs more than the cap
    assert _max_in_flight(capped, trace) == 8
    slips = [r.slip_ms for r in capped.requests]
    assert min(slips) == 0.0 and sum(s > 0 for s in slips) > len(trace) // 4
    # TTFT counts from dispatch: the wait is in the slip, not in the TTFT
    s_open, s_capped = summarize(open_loop.requests), summarize(capped.requests)
    assert s_capped["ttft_ms"]["p95"] < s_open["ttft_ms"]["p95"]
    assert s_capped["slip_ms"]["p95"] > s_capped["ttft_ms"]["p95"]
    assert s_capped["slip_ms"]["waited"] == sum(s > 0 for s in slips)
    assert not capped.router.in_flight


def test_one_slot_sends_each_request_when_the_one_before_ends(trace) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from loadgen.client.protocol import Protocol

    burst = [replace(r, arrival_s=0.0) for r in trace[:4]]
    res = simulate(burst, SimSettings(policy="round_robin", protocol=Protocol(max_concurrency=1)))
    done_s = 0.0
    for r in res.requests:  # first come, first served: the slip is the wait for the slot
        assert r.slip_ms == pytest.approx(done_s * 1000, abs=1e-6)
        assert r.ttft_ms is not None and r.e2e_ms is not None and r.ttft_ms < r.e2e_ms
        done_s += r.e2e_ms / 1000
    alone = simulate(burst[-1:], SimSettings(policy="round_robin"))
    assert res.requests[-1].ttft_ms < 2 * alone.requests[0].ttft_ms  # type: ignore[operator]


def test_the_protocol_forces_output_lengths_and_drops_long_prompts(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.client.protocol import PAPER

    long = sum(r.input_tokens > 24_000 for r in trace)
    assert long > 0
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0, protocol=PAPER))
    assert res.dropped == long and len(res.requests) == len(trace) - long
    assert all(r.output_tokens == 128 and r.input_tokens <= 24_000 for r in res.requests)
    assert len(res.itl_ms) == 127 * len(res.requests)


def _burst(n: int, input_tokens: int = 600, output_tokens: int = 40) -> list[TraceRequest]:
    """n requests sent at one instant, each its own conversation."""
    return [
        TraceRequest(i, 0.0, input_tokens, output_tokens, (10_000 + i,), 512, f"s{i}")
        for i in range(n)
    ]


def test_the_door_takes_a_burst_in_turn_and_ttft_counts_the_wait() -> None:
    burst = _burst(6)
    spaced = SimSettings(policy="round_robin", regions=("ap-seoul",), door_spacing_ms=20.0)
    sim = Simulation(burst, spaced)
    dispatches = Dispatches()
    sim.router.subscribe(dispatches)
    engine = sim.engines["ap-seoul"]
    arrived: list[str] = []
    submit = engine.submit
    engine.submit = lambda rid, *a: (arrived.append(rid), submit(rid, *a))[1]  # type: ignore[method-assign]
    res = sim.run()
    # decided one at a time, in the order sent, 20 ms apart
    assert dispatches.times_s() == pytest.approx([i * 0.02 for i in range(6)])
    # ... so they reach the engine in that order (the WAN jitter: 4.5 ms one way)
    assert arrived == [r.id for r in burst]
    # the wait at the door is part of the TTFT
    ttft = [r.ttft_ms or 0 for r in res.requests]
    assert ttft[-1] > ttft[0] + 80
    # off (the default), all are decided at once
    plain = simulate(burst, SimSettings(policy="round_robin", regions=("ap-seoul",)))
    assert min(r.ttft_ms or 0 for r in res.requests) == pytest.approx(
        min(r.ttft_ms or 0 for r in plain.requests), abs=10
    )


def test_envoy_opens_a_connection_only_when_every_one_is_busy() -> None:
    # Six at once to one backend: six connections, each a handshake (one more RTT);
    # six more after those ended reuse them.
    first, later = _burst(6), _burst(6)
    later = [
        TraceRequest(
            r.index + 6,
            30.0,
            r.input_tokens,
            r.output_tokens,
            (20_000 + r.index,),
            512,
            f"t{r.index}",
        )
        for r in later
    ]
    one = ("ap-seoul",)
    res = simulate(
        [*first, *later], SimSettings(policy="round_robin", regions=one, envoy_workers=1)
    )
    off = simulate([*first, *later], SimSettings(policy="round_robin", regions=one))
    rtt_ms = 180.0

    def mean_ttft(rs: list[RequestResult]) -> float:
        return sum(r.ttft_ms or 0 for r in rs) / len(rs)

    assert mean_ttft(res.requests[:6]) - mean_ttft(off.requests[:6]) > 0.8 * rtt_ms
    assert abs(mean_ttft(res.requests[6:]) - mean_ttft(off.requests[6:])) < 0.1 * rtt_ms


FLEETS = SLICE.parent / "fleets"


def test_a_fleet_sets_the_engines_and_the_router_keeps_the_shipped_profile(trace) -> None:  # type: ignore[no-untyped-def]
    from emulator.stack.fleet import load_fleet

    regions = SimSettings().regions
    fleet = load_fleet(FLEETS / "mixed-gpus.yaml", regions)
    for knows in (False, True):
        sim = Simulation(trace[:5], SimSettings(fleet=fleet, router_knows_fleet=knows))
        engines = {r: e.profile.name for r, e in sim.engines.items()}
        told = {r: b.profile.name for r, b in sim.router.backends.items()}
        assert engines == {
            "us-ashburn": "h100-llama3.1-8b",
            "eu-frankfurt": "h200-llama3.1-70b-fp8",
            "ap-seoul": "a10g-llama3.1-8b",
        }
        assert told == (engines if knows else dict.fromkeys(regions, SimSettings().engine_profile))
        # each engine's load report counts against its own pool
        assert sim.kv_capacity_tokens["ap-seoul"] == 31_000


def test_faster_far_engines_draw_the_router_when_it_knows_or_learns_them(trace) -> None:  # type: ignore[no-untyped-def]
    from emulator.stack.fleet import load_fleet

    fleet = load_fleet(FLEETS / "fast-far.yaml", SimSettings().regions)
    far = {"eu-frankfurt", "ap-seoul"}
    # the profile's speed factors (the replay's step fit: tests/unit/estimate/test_replay.py)
    static = {"routing": {"learn_latency": False, "ttft_model": "profile"}}
    shares = {}
    for name, knows, router in (
        ("shipped", False, static),
        ("learned", False, {"routing": {"ttft_model": "profile"}}),
        ("true", True, static),
    ):
        settings = SimSettings(time_scale=3.0, fleet=fleet, router_knows_fleet=knows, router=router)
        res = simulate(trace, settings)
        assert all(r.status == "ok" for r in res.requests)
        shares[name] = sum(r.backend in far for r in res.requests) / len(res.requests)
    # told, or having learned, that the far engines prefill 3x as fast, it sends them more
    assert shares["true"] > shares["shipped"] + 0.05
    # learning it from the completions of a short run closes most of that gap
    assert shares["learned"] - shares["shipped"] >= 0.5 * (shares["true"] - shares["shipped"])


def test_precise_state_needs_one_engine_block_size(tmp_path: Path) -> None:
    from emulator.stack.fleet import fleet_from_dict

    coarse = tmp_path / "coarse.yaml"
    default = SLICE.parents[2] / "ext_proc/estimate/profiles/l40s-qwen3.5-35b-a3b-fp8.yaml"
    coarse.write_text(default.read_text().replace("block_tokens: 64", "block_tokens: 128"))
    fleet = fleet_from_dict(
        {"backends": [{"id": "ap-seoul", "engine_profile": str(coarse)}]}, SimSettings().regions
    )
    Simulation([], SimSettings(fleet=fleet))  # approximate state: any sizes
    with pytest.raises(ValueError, match="block_tokens must agree"):
        Simulation([], SimSettings(fleet=fleet, prefix_state="precise"))


def test_each_row_has_the_routers_prediction_and_the_summary_its_error() -> None:
    trace = synthetic(sessions=20, turns=4, rate_rps=1.0, system_tokens=512, turn_tokens=1500)
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0))
    for r in res.requests:
        assert r.predicted_ttft_ms is not None and r.predicted_e2e_ms is not None
        assert 0 < r.predicted_ttft_ms < r.predicted_e2e_ms
    s = summarize(res.requests)
    pred = s["ttft_prediction"]
    assert pred["requests"] == len(trace) - len(trace) // 5  # after the first 20 %
    # a light load on the engine model the router's profile describes: within a few %
    assert 0 < pred["mape"] < 0.1 and abs(pred["bias_ms"]) < 0.1 * s["ttft_ms"]["mean"]
    by_backend = s["ttft_prediction_by_backend"]
    assert sum(b["requests"] for b in by_backend.values()) == pred["requests"]
    assert 0 < s["e2e_prediction"]["mape"] < 0.5
    # the router's own per-backend figures agree on what it saw
    seen = {b: st.learned.latency.ttft.requests for b, st in res.router.backends.items()}
    assert sum(seen.values()) == len(trace)


def test_without_max_tokens_the_router_learns_the_output_lengths(trace) -> None:  # type: ignore[no-untyped-def]
    from loadgen.client.protocol import Protocol

    none = Protocol(request_max_tokens="none")
    res = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0, protocol=none))
    state = res.router.fleet.state
    learned = state.output_lengths.as_json()
    # every completion counted (no model named: the key of any model, "*"); the mean
    # forgets the oldest a little
    mean = sum(t.output_tokens for t in trace) / len(trace)
    assert learned["*"]["completions"] == len(trace)
    assert learned["*"]["mean_tokens"] == pytest.approx(mean, rel=0.05)
    assert learned["*"]["stopped_at_max_tokens"] == 1.0  # the prior: no request set a cap
    # the decode's calibration learned from every completion, as `learned` lengths
    samples = {
        b: cal["learned"]["samples"]
        for b in res.router.backends
        if (cal := state.decode_calibration.backend_json(b))
    }
    assert sum(samples.values()) == len(trace)
    # with max_tokens = the output length, the lengths are `known`, none learned apart
    known = simulate(trace, SimSettings(policy="gorgo", time_scale=3.0)).router.fleet.state
    assert all(
        set(known.decode_calibration.backend_json(b)) <= {"known"} for b in res.router.backends
    )
