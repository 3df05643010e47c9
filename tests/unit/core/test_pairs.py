"""The pair's price and a disaggregated fleet's decisions (core.pairs)."""

import dataclasses
import random

import pytest

from ext_proc.core.build import build_router
from ext_proc.core.pairs import KV_TRANSFER, paired_candidates, price
from ext_proc.core.router import Router
from ext_proc.estimate.transfer import PairKnobs, TransferFactors
from ext_proc.vocab.backend import BackendRole
from ext_proc.vocab.policy import PairPick
from ext_proc.vocab.types import Candidate, Status
from tests.builders import candidate, chat, load, make_router
from tests.fakes import FakeClock

NO_KNOBS = PairKnobs()
# Llama-3.1-8B in fp16: 128 KiB of KV a token.
KV = 131_072
# Two regions: a prefill and a decode engine in each, an aggregated engine in `a`.
FLEET = (
    {"id": "pa", "address": "127.0.0.1:1", "region": "a", "role": "prefill", "rtt_prior_ms": 5},
    {"id": "pb", "address": "127.0.0.1:2", "region": "b", "role": "prefill", "rtt_prior_ms": 40},
    {"id": "da", "address": "127.0.0.1:3", "region": "a", "role": "decode", "rtt_prior_ms": 5},
)


def pd_router(
    gbps: float = 10.0,
    fleet: tuple[dict[str, object], ...] = FLEET,
    tuner: str = "off",
    **gorgo: object,
) -> tuple[Router, FakeClock]:
    return make_router(
        "gorgo",
        backends=fleet,
        routing={
            "kv_bytes_per_token": KV,
            # within a region 100 Gbps (the default here); between a and b `gbps`
            "kv_link": {
                "gbps": 100,
                "links": [{"regions": ["a", "b"], "gbps": gbps, "rtt_ms": 35}],
            },
        },
        policies={"gorgo": gorgo},
        tuner={"mode": tuner},
    )


def cands(
    pa_wait: float = 0.0, uncached: int = 10_000, da_cached: int = 0
) -> tuple[Candidate, ...]:
    return (
        candidate("pa", rtt_ms=5, queue_ms=pa_wait, prefill_ms=1000, uncached_tokens=uncached),
        candidate("pb", rtt_ms=40, prefill_ms=1000, uncached_tokens=uncached),
        candidate("da", rtt_ms=5, queue_ms=2, prefill_ms=1000, cached_tokens=da_cached),
    )


def choose(
    router: Router,
    cs: tuple[Candidate, ...],
    knobs: PairKnobs = NO_KNOBS,
    input_tokens: int = 10_000,
) -> str:
    paired = paired_candidates(
        cs, router.backends, router.cfg.routing, knobs, TransferFactors(), input_tokens
    )
    assert [c.backend_id for c in paired.candidates] == ["da"]  # prefill engines: no candidates
    return paired.pairs["da"].prefill


def test_the_price_is_the_trips_queues_prefill_transfer_and_first_step() -> None:
    router, _ = pd_router(gbps=10.0)
    b = router.backends  # within a: 100 Gbps, no link RTT
    p, d = cands(pa_wait=7)[0], cands()[2]
    local = price(p, d, b["pa"], b["da"], router.cfg.routing, TransferFactors(), 10_000)
    first_step = b["da"].profile.decode_ms(1, 10_000)
    assert not local.remote and local.link_rtt_ms == 0.0  # within a region: the defaults
    assert local.kv_bytes == 10_000 * KV
    assert local.transfer_ms == pytest.approx(10_000 * KV * 8 / 100e9 * 1e3)
    assert local.total_ms == pytest.approx(5 + 7 + 1000 + local.transfer_ms + 2 + first_step + 5)
    q = cands()[1]
    remote = price(q, d, b["pb"], b["da"], router.cfg.routing, TransferFactors(), 10_000)
    assert remote.remote and remote.transfer_ms == pytest.approx(35 + 1048.576)  # 10 Gbps


def test_a_cached_prefix_on_the_decode_engine_is_not_sent() -> None:
    router, _ = pd_router()
    b = router.backends
    p, d = cands()[0], cands(da_cached=6_000)[2]
    pair = price(p, d, b["pa"], b["da"], router.cfg.routing, TransferFactors(), 10_000)
    assert pair.kv_bytes == 4_000 * KV


def test_a_remote_prefill_wins_a_long_prompt_over_a_fast_link() -> None:
    router, _ = pd_router(gbps=100.0)  # 10k tokens: 105 ms + 35 ms over the link
    assert choose(router, cands(pa_wait=3000)) == "pb"


def test_a_remote_prefill_loses_over_a_slow_link() -> None:
    router, _ = pd_router(gbps=1.0)  # 10k tokens: 10.5 s over the link
    assert choose(router, cands(pa_wait=3000)) == "pa"


def test_a_remote_prefill_loses_a_short_prompt_to_the_idle_local_one() -> None:
    router, _ = pd_router(gbps=100.0)
    short = tuple(
        dataclasses.replace(c, terms={**c.terms, "prefill": 20.0}) for c in cands(uncached=200)
    )
    assert (
        choose(router, short, input_tokens=200) == "pa"
    )  # the trip to b alone costs more than the wait


def test_the_threshold_and_the_margin_keep_the_prefill_local() -> None:
    router, _ = pd_router(gbps=100.0)
    assert choose(router, cands(pa_wait=3000), PairKnobs(local_threshold_tokens=10_001)) == "pa"
    assert choose(router, cands(pa_wait=3000), PairKnobs(local_threshold_tokens=10_000)) == "pb"
    # the remote pair wins by ~2.8 s
    assert choose(router, cands(pa_wait=3000), PairKnobs(remote_margin_ms=2000)) == "pb"
    assert choose(router, cands(pa_wait=3000), PairKnobs(remote_margin_ms=4000)) == "pa"


def test_the_pair_candidate_carries_the_pairs_ttft_and_the_decode_sides_terms() -> None:
    router, _ = pd_router(gbps=100.0)
    cs = cands(pa_wait=3000)
    paired = paired_candidates(
        cs, router.backends, router.cfg.routing, PairKnobs(), TransferFactors(), 10_000
    )
    c, pair = paired.candidates[0], paired.pairs["da"]
    assert c.predicted_ttft_ms == pytest.approx(pair.total_ms)
    assert c.terms[KV_TRANSFER] == pytest.approx(pair.transfer_ms)
    assert c.decode_ms == cs[2].decode_ms  # its decode is the decode engine's


# -- the decision, through the router ---------------------------------------------------

LONG = "lorem ipsum dolor " * 2000


def test_an_aggregated_fleet_has_no_prefill_leg() -> None:
    router, _ = make_router("gorgo")
    d = router.decide(chat(LONG, rid="r"))
    assert d.prefill is None and "prefill" not in d.as_json()


def test_a_mixed_fleet_pairs_a_decode_engine_and_shows_the_leg() -> None:
    fleet = (*FLEET, {"id": "both", "address": "127.0.0.1:4", "region": "b", "rtt_prior_ms": 400})
    router, _ = pd_router(fleet=fleet)
    d = router.decide(chat(LONG, rid="r"))
    assert {c.backend_id for c in d.candidates} == {"da", "both"}
    assert d.backend == "da" and d.prefill is not None and d.prefill.backend == "pa"
    assert d.prefill.kv_bytes == d.input_tokens * KV
    shown = router.snapshot()["recent_decisions"][0]
    assert shown["prefill"]["backend"] == "pa" and shown["prefill"]["transfer_ms"] > 0
    rec = router.in_flight["r"]
    assert (rec.prefill_backend, rec.transfer_ms) == ("pa", d.prefill.transfer_ms)


def test_a_busy_local_prefill_engine_sends_the_prompt_over_a_fast_link() -> None:
    router, _ = pd_router(gbps=100.0)
    for i in range(6):
        load(router, f"busy{i}", "pa", 8000, prefill_ms=3000)
    d = router.decide(chat(LONG, rid="r"))
    assert d.prefill is not None and d.prefill.backend == "pb"
    slow, _ = pd_router(gbps=0.5)
    for i in range(6):
        load(slow, f"busy{i}", "pa", 8000, prefill_ms=3000)
    d = slow.decide(chat(LONG, rid="r"))
    assert d.prefill is not None and d.prefill.backend == "pa"


def test_the_margin_holds_a_remote_pair_against_an_aggregated_engine() -> None:
    fleet = (*FLEET, {"id": "both", "address": "127.0.0.1:4", "region": "a", "rtt_prior_ms": 5})
    router, _ = pd_router(gbps=100.0, fleet=fleet, remote_margin_ms=1e6)
    for i in range(6):
        load(router, f"busy{i}", "pa", 8000, prefill_ms=3000)
    assert router.decide(chat(LONG, rid="r")).prefill is None  # on `both`, whole
    free, _ = pd_router(gbps=100.0, fleet=fleet)
    for i in range(6):
        load(free, f"busy{i}", "pa", 8000, prefill_ms=3000)
        load(free, f"both{i}", "both", 8000, prefill_ms=3000)
    d = free.decide(chat(LONG, rid="r"))
    assert d.prefill is not None and d.prefill.backend == "pb"


# -- the accounting: both sides close exactly once -------------------------------------


def counts(router: Router, backend: str) -> tuple[int, int, int]:
    load_ = router.backends[backend].load
    return load_.in_flight, load_.waiting_first_byte, load_.in_flight_tokens


def dispatched(router: Router, rid: str = "r", envoy: str = "") -> tuple[str, str, int]:
    d = router.decide(dataclasses.replace(chat(LONG, rid=rid), envoy=envoy))
    assert d.prefill is not None
    assert counts(router, d.prefill.backend) == (1, 1, d.input_tokens)
    assert counts(router, d.backend) == (1, 1, d.input_tokens)
    return d.prefill.backend, d.backend, d.input_tokens


def test_the_prefill_engine_is_released_at_the_decodes_first_byte() -> None:
    router, clock = pd_router()
    p, d, n = dispatched(router)
    clock.advance(2.0)
    router.first_byte("r")
    assert counts(router, p) == (0, 0, 0) and counts(router, d) == (1, 0, n)
    clock.advance(1.0)
    assert router.close("r", Status.OK) is not None
    assert counts(router, p) == (0, 0, 0) and counts(router, d) == (0, 0, 0)
    assert router.close("r", Status.OK) is None
    assert counts(router, p) == (0, 0, 0)
    assert router.backends[d].stats.completed == 1 and router.backends[p].stats.completed == 0


@pytest.mark.parametrize("status", [Status.ERROR, Status.CANCELLED, Status.CLIENT_ERROR])
def test_a_request_ended_before_its_first_byte_releases_both(status: Status) -> None:
    router, clock = pd_router()
    p, d, _ = dispatched(router)
    clock.advance(0.5)
    assert router.close("r", status) is not None
    assert router.close("r", status) is None
    assert counts(router, p) == (0, 0, 0) and counts(router, d) == (0, 0, 0)


def test_an_expired_request_releases_both() -> None:
    router, clock = pd_router()
    p, d, _ = dispatched(router)
    clock.advance(120.0)
    assert [c.request_id for c in router.expire()] == ["r"]
    assert counts(router, p) == (0, 0, 0) and counts(router, d) == (0, 0, 0)


def test_a_lost_request_releases_both() -> None:
    router, _ = pd_router()
    p, d, _ = dispatched(router, envoy="e1")
    assert [c.request_id for c in router.lose({"e1"})] == ["r"]
    assert counts(router, p) == (0, 0, 0) and counts(router, d) == (0, 0, 0)


def test_a_reused_request_id_releases_the_older_leg() -> None:
    router, _ = pd_router()
    dispatched(router)
    router.decide(chat(LONG, rid="r"))
    router.close("r", Status.OK)
    assert all(counts(router, b) == (0, 0, 0) for b in router.backends)


def test_the_decode_sides_record_holds_no_prefill_and_its_ttft_is_the_pairs() -> None:
    router, _ = pd_router()
    d = router.decide(chat(LONG, rid="r"))
    rec = router.in_flight["r"]
    assert rec.cached_tokens == rec.input_tokens  # nothing to prefill on the decode engine
    assert rec.predicted_ttft_ms == pytest.approx(d.chosen.predicted_ttft_ms)
    assert (rec.rtt_ms + rec.queue_ms + rec.prefill_ms) == pytest.approx(rec.predicted_ttft_ms)
    assert router.backends["da"].config.role is BackendRole.DECODE


def test_an_observed_slow_transfer_raises_the_links_factor() -> None:
    router, clock = pd_router()
    d = router.decide(chat(LONG, rid="r"))
    assert d.prefill is not None
    rec = router.in_flight["r"]
    assert rec.predicted_ttft_ms is not None
    clock.advance((rec.predicted_ttft_ms + 2 * rec.transfer_bandwidth_ms) / 1000)
    router.first_byte("r")
    assert router.snapshot()["kv_transfer_factors"]["a|a"] > 1.0
    router.close("r", Status.OK)
    observed = router.snapshot()["recent_decisions"][0]["observed"]
    assert observed["kv_transfer_ms"] == pytest.approx(3 * rec.transfer_ms, abs=1e-3)


def test_a_draining_prefill_engine_goes_once_its_last_leg_is_released() -> None:
    router, clock = pd_router()
    p, _, _ = dispatched(router)
    router.fleet.drain(p, keep_one=False)
    assert p in router.backends  # its leg is still prefilling
    clock.advance(1.0)
    router.first_byte("r")
    router.close("r", Status.OK)
    assert p not in router.backends


def test_both_engines_of_a_pair_hold_the_prompt_afterwards() -> None:
    router, _ = pd_router()
    _, d, n = dispatched(router)
    router.close("r", Status.OK)
    again = router.decide(chat(LONG, rid="r2"))
    assert again.prefill is not None
    # D holds it but the last partial block: only that is sent (100 Gbps within a)
    assert router.in_flight["r2"].transfer_ms < 256 * KV * 8 / 100e9 * 1e3
    assert {c.backend_id: c.cached_tokens for c in again.candidates}[d] > n // 2


@pytest.mark.parametrize("seed", range(5))
def test_any_order_of_ends_leaves_nothing_counted(seed: int) -> None:
    rng = random.Random(seed)
    fleet = (*FLEET, {"id": "both", "address": "127.0.0.1:4", "region": "b", "rtt_prior_ms": 60})
    router, clock = pd_router(gbps=100.0, fleet=fleet)
    live: list[str] = []
    for i in range(60):
        clock.advance(rng.random())
        op = rng.random()
        if op < 0.45 or not live:
            rid = f"r{rng.randrange(40)}"  # ids reused now and then
            text = LONG if rng.random() < 0.5 else "short question"
            router.decide(dataclasses.replace(chat(text, rid=rid), envoy=f"e{i % 3}"))
            live.append(rid)
        elif op < 0.65:
            router.first_byte(rng.choice(live))
        elif op < 0.9:
            router.close(rng.choice(live), rng.choice(list(Status)))
        elif op < 0.95:
            router.lose({"e1"})
        else:
            router.expire()
        state_legs = sum(1 for b in router.backends.values() for r in b.load.records)
        assert state_legs == sum(b.load.in_flight for b in router.backends.values())
    for rid in set(live):
        router.close(rid, Status.OK)
    assert all(counts(router, b) == (0, 0, 0) for b in router.backends)
    assert not router.snapshot().get("prefilling")


class LegByLeg:
    """A PairPolicy (the P/D routers' shape): each leg picked by its own rule, here the
    last prefill engine listed, or none."""

    name = "leg_by_leg"

    def __init__(self, prefill: bool = True) -> None:
        self.prefill = prefill
        self.asked: list[tuple[list[str], list[str]]] = []

    def choose(self, request: object, candidates: object, weights: object) -> object:
        raise AssertionError("a PairPolicy picks the pair: choose is not asked")

    def choose_pair(
        self, request: object, decodes: list[Candidate], prefills: list[Candidate]
    ) -> PairPick:
        self.asked.append(([c.backend_id for c in decodes], [c.backend_id for c in prefills]))
        return PairPick(decodes[0].backend_id, prefills[-1].backend_id if self.prefill else None)


@pytest.mark.parametrize("with_prefill", [True, False])
def test_a_pair_policy_picks_each_leg_and_the_router_prices_and_books_its_pick(
    with_prefill: bool,
) -> None:
    fleet = (*FLEET, {"id": "both", "address": "127.0.0.1:4", "region": "b", "rtt_prior_ms": 4})
    cfg = pd_router(fleet=fleet)[0].cfg
    policy = LegByLeg(with_prefill)
    router = build_router(cfg, FakeClock(), random.Random(0), policy=policy)  # type: ignore[arg-type]
    d = router.decide(chat(LONG, rid="r"))
    assert policy.asked == [(["da"], ["pa", "pb"])]  # the aggregated engine is neither leg
    assert d.backend == "da"
    if with_prefill:  # the remote prefill it picked, priced over the a-b link
        assert d.prefill is not None and d.prefill.backend == "pb"
        assert d.prefill.transfer_ms == pytest.approx(35 + d.input_tokens * KV * 8 / 10e9 * 1e3)
        assert counts(router, "pb")[0] == 1
    else:  # the decode engine prefills it itself
        assert d.prefill is None and counts(router, "pb")[0] == 0
    router.first_byte("r")
    router.close("r", Status.OK)
    assert not router.in_flight and not router.fleet.state.legs


def vllm(fleet: tuple[dict[str, object], ...]) -> tuple[dict[str, object], ...]:
    return tuple({**b, "engine": "vllm"} for b in fleet)


def test_a_vllm_decode_engine_prefills_itself_when_every_pair_would_wait_longer() -> None:
    """vLLM's decode engine serves a request without kv_transfer_params whole; SGLang's
    takes only requests with their KV. Both prefill engines busy: the vLLM one goes whole."""
    for engine, whole in (("vllm", True), ("sglang", False)):
        fleet = vllm(FLEET) if engine == "vllm" else FLEET
        router, _ = pd_router(gbps=100.0, fleet=fleet)
        for i in range(6):
            for p in ("pa", "pb"):
                load(router, f"busy-{p}{i}", p, 8000, prefill_ms=3000)
        d = router.decide(chat(LONG, rid="r"))
        assert d.backend == "da"
        assert (d.prefill is None) is whole, engine
        if whole:  # priced as itself: its own prefill, no transfer
            assert KV_TRANSFER not in d.chosen.terms and d.chosen.prefill_ms > 0


def test_an_idle_fleet_still_pairs_a_vllm_decode_engine_when_the_pair_is_sooner() -> None:
    router, _ = pd_router(gbps=100.0, fleet=vllm(FLEET))
    load(router, "decoding", "da", 8000, output_tokens=500, decoding=True)  # a busy decode
    d = router.decide(chat(LONG, rid="r"))
    assert d.backend == "da" and d.prefill is not None


def test_the_prefill_legs_answer_frees_its_engine_and_teaches_its_speed() -> None:
    """prefill_done: vLLM's one-token answer as the prefill ends, SGLang's once the KV
    went (its transfer, as predicted, taken off). The prefill engine's load drops there
    and then, and what the leg took against its profile teaches that engine's speed."""
    factors = {}
    for kv_sent in (False, True):
        router, clock = pd_router()
        d = router.decide(chat(LONG, rid="r"))
        assert d.prefill is not None and counts(router, "pa")[0] == 1
        leg = router.fleet.state.leg_of["r"]
        predicted_s = (leg.queue_ms + leg.prefill_ms + leg.rtt_ms + d.prefill.transfer_ms) / 1e3
        clock.advance(1.3 * predicted_s)  # the engine took longer than its profile says
        router.prefill_done("r", kv_sent=kv_sent)
        assert counts(router, "pa") == (0, 0, 0) and not router.fleet.state.leg_of
        speed = router.backends["pa"].learned.speed
        assert speed.samples[0] == 1 and speed.prefill_factor > 1.0
        factors[kv_sent] = speed.prefill_factor
        router.prefill_done("r")  # a second answer teaches nothing more
        assert speed.samples[0] == 1
        router.first_byte("r")  # the decode's first byte still tells the transfer
        assert router.in_flight["r"].observed_transfer_ms is not None
        router.close("r", Status.OK)
        assert not router.in_flight and not router.fleet.state.legs
    assert factors[True] < factors[False]  # the transfer is not the engine's time


# -- the tuner owns the two knobs (docs/tuner.md, "The P/D knobs") ----------------------


def test_the_pair_tuner_sets_a_requests_knobs_by_its_arm_and_learns_from_it() -> None:
    """With tuning on, each request's knobs are its arm's: here the parent's margin lets a
    remote prefill win, the child's keeps it on the aggregated engine."""
    fleet = (*FLEET, {"id": "both", "address": "127.0.0.1:4", "region": "a", "rtt_prior_ms": 5})

    def decided(rid: str) -> tuple[str, object]:
        assert pd_router()[0].pair_tuner is None  # tuning off: the policy's knobs
        router, clock = pd_router(gbps=100.0, fleet=fleet, tuner="paired")
        t = router.pair_tuner
        assert t is not None and t.snapshot()["knobs"] == {
            "local_threshold_tokens": 16.0,  # the policy's 0 and 0, at the knobs' bounds
            "remote_margin_ms": 1.0,
        }
        t.state.parent, t.state.child = (16.0, 1.0), (16.0, 1e4)
        for i in range(6):  # both busy, `both` for less than the child's margin
            load(router, f"busy{i}", "pa", 8000, prefill_ms=3000)
            load(router, f"both{i}", "both", 8000, prefill_ms=1000)
        d = router.decide(chat(LONG, rid=rid))
        clock.advance(1.0)
        router.first_byte(rid)
        router.close(rid, Status.OK)
        assert t.snapshot()["requests_in_flight"] == 0 and t.state.samples == 1
        return t.arm_for(rid), d.prefill

    arms = {rid: decided(rid) for rid in ("r1", "r2", "r3", "r4")}
    assert {arm for arm, _ in arms.values()} == {"parent", "child"}
    for arm, prefill in arms.values():
        assert (prefill is None) == (arm == "child"), arms


def test_an_aggregated_fleet_gives_the_pair_tuner_nothing() -> None:
    router, clock = make_router("gorgo", backends=("a", "b"), tuner={"mode": "paired"})
    t = router.pair_tuner
    assert t is not None
    router.decide(chat(LONG, rid="r"))
    clock.advance(1.0)
    router.first_byte("r")
    router.close("r", Status.OK)
    assert (t.state.samples, t.snapshot()["requests_in_flight"]) == (0, 0)
    assert router.snapshot()["pair_tuner"]["knobs"]["remote_margin_ms"] == 1.0
