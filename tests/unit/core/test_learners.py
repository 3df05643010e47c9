"""What learns from each request's outcome (core/learners.py): the prefix index
(PrefixLearner), the engine's speed (SpeedLearner), passive health (Ejector), the
prediction figures (PredictionLearner) and the tuner's arms (TunerLearner)."""

import logging
import math
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from ext_proc.core.backend import BackendState
from ext_proc.core.learners import (
    SETTLED_S,
    Ejector,
    OutputLearner,
    PredictionLearner,
    PrefixLearner,
    SpeedLearner,
    TunerLearner,
)
from ext_proc.core.router import Router
from ext_proc.core.state import FleetState
from ext_proc.estimate.latency_model import LatencyModel
from ext_proc.estimate.profile import load_profile
from ext_proc.learn.settings import CHILD, EXCESS_TTFT, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.events import Closed, Dispatched
from ext_proc.vocab.types import Decision, InFlight, RouteRequest, Status, Weights
from tests.builders import REGIONS, backend_state, chat, make_config, make_router
from tests.unit.learn.arms import PAIRED_S, TIES, close_ok


def fleet(*ids: str) -> FleetState:
    """A fleet of records of their own (ROUND_PROFILE), no router around them."""
    state = FleetState()
    for bid in ids:
        state.add(backend_state(bid))
    return state


def closed(
    rec: InFlight,
    status: Status = Status.OK,
    ttft_ms: float | None = 1000.0,
    e2e_ms: float = 3000.0,
    now_s: float = 100.0,
    **kw: Any,
) -> Closed:
    return Closed(rec.request_id, rec.backend, status, ttft_ms, e2e_ms, rec, now_s, **kw)


# -- PrefixLearner: the prefix index ---------------------------------------------------------

BLOCKS = np.arange(1, 9, dtype=np.uint64)  # a prompt of 8 blocks (of 16 tokens)


def dispatched(state: FleetState, rec: InFlight) -> Dispatched:
    decision = Decision(rec.request_id, rec.backend, "least_request", 128, (), {})
    return Dispatched(RouteRequest(rec.request_id, None, None), decision, rec, rec.dispatched_s)


def test_a_dispatch_inserts_its_blocks_where_it_went() -> None:
    state = fleet("a", "b")
    learner = PrefixLearner(state, block_tokens=16)
    learner.on_dispatch(dispatched(state, InFlight("r", "a", 1.0, 128, blocks=BLOCKS)))
    assert state.backends["a"].prefix.match(BLOCKS) == 8
    assert state.backends["b"].prefix.match(BLOCKS) == 0
    learner.on_dispatch(dispatched(state, InFlight("blockless", "b", 1.0, 128)))  # nothing
    assert state.backends["b"].prefix.size_blocks == 0


def test_a_failover_moves_the_blocks_to_where_it_was_served() -> None:
    state = fleet("a", "b")
    learner = PrefixLearner(state, block_tokens=16)
    # 3 blocks (48 tokens) were there before; the dispatch inserted all 8
    state.backends["a"].prefix.insert(BLOCKS[:3], 0.5)
    rec = InFlight("r", "a", 1.0, 128, cached_tokens=48, blocks=BLOCKS)
    learner.on_dispatch(dispatched(state, rec))
    learner.on_close(closed(rec, Status.FAILED_OVER, None, 900.0, 1.5, served_by="b"))
    # a never computed the 5 it did not hold; b holds all 8 now
    assert state.backends["a"].prefix.match(BLOCKS) == 3
    assert state.backends["b"].prefix.match(BLOCKS) == 8


@pytest.mark.parametrize(
    ("case", "reported", "dispatched_s", "dropped"),
    [
        # the index held 4 blocks, last used at 10, 20, 30, 40 s; dispatched at 100 s
        ("the engine had all 4", 64, 100.0, 0),
        # it had 2: the 3rd (used at 30 s, 70 s before) was evicted, and with it every
        # block not used since: those used at 10, 20 and 30 s of this index
        ("the engine had 2 of 4", 32, 100.0, 3),
        # dispatched 25 s after the 3rd was used: maybe still being computed, no evidence
        ("too recent to be evidence", 32, 30.0 + SETTLED_S - 5, 0),
    ],
)
def test_a_cached_token_report_trims_what_the_engine_evicted(
    case: str, reported: int, dispatched_s: float, dropped: int
) -> None:
    state = fleet("a")
    index = state.backends["a"].prefix
    for i, used_s in enumerate((10.0, 20.0, 30.0, 40.0)):
        index.insert(BLOCKS[i : i + 1], used_s)
    learner = PrefixLearner(state, block_tokens=16)
    rec = InFlight(
        "r",
        "a",
        dispatched_s,
        128,
        blocks=BLOCKS[:4],
        matched_last_used_s=np.array([10.0, 20.0, 30.0, 40.0]),
    )
    assert learner.learn_cached(closed(rec, cached_tokens=reported)) == dropped, case
    assert index.size_blocks == 4 - dropped


def test_learn_cached_trims_only_settled_evidence() -> None:
    r, clock = make_router(
        "gorgo", backends=REGIONS, policies={"gorgo": {"tie_fraction": 0.0}}
    )  # the nearest, always
    doc, other = "document " * 2000, "other text " * 2000
    d_other = r.decide(chat(other))
    r.close(d_other.request_id, Status.OK)
    clock.advance(1)
    d1 = r.decide(chat(doc))
    r.close(d1.request_id, Status.OK)
    assert d1.backend == d_other.backend == "near"
    other_blocks = r.features.prompt_blocks(chat(other))[0]
    clock.advance(SETTLED_S + 1)
    d2 = r.decide(chat(doc))
    assert d2.backend == "near"
    rec = r.in_flight[d2.request_id]
    assert rec.cached_tokens > 4000
    # The engine reports nothing cached: it evicted doc's blocks, so `other`, used even
    # earlier, is gone too (LRU). Doc's blocks stay: this very dispatch re-touched them
    # and its prefill computes them.
    near = r.backends["near"].prefix
    assert near.match(other_blocks) == len(other_blocks) > 0
    r.close(d2.request_id, Status.OK, cached_tokens=0)
    assert near.match(other_blocks) == 0
    doc_blocks = r.features.prompt_blocks(chat(doc))[0]
    assert near.match(doc_blocks) == len(rec.blocks)
    # a report right after a dispatch (prefill may still be running) is not evidence
    r.decide(RouteRequest("fresh-other", chat(other).llm, None))
    d3 = r.decide(chat(doc + " more"))
    r.close(d3.request_id, Status.OK, cached_tokens=0)
    assert near.match(other_blocks) == len(other_blocks)


def test_a_prompt_the_engine_refused_is_not_counted_as_cached_there() -> None:
    """The engine answered 4xx (a prompt over its context): it computed nothing, so what
    the dispatch inserted into the backend's index goes; a prefix another request had
    put there stays."""
    router, clock = make_router("gorgo", backends=["a"], routing={"block_tokens": 16})
    shared = "a shared system prompt " * 40
    first = chat(shared + "first", rid="r1")
    router.decide(first)
    router.first_byte("r1")
    router.close("r1", Status.OK)
    b = router.backends["a"]
    held = b.prefix.size_blocks
    clock.advance(1.0)
    refused = chat(shared + "then a long new tail " * 40, rid="r2")
    router.decide(refused)
    assert b.prefix.size_blocks > held
    router.close("r2", Status.CLIENT_ERROR, reason="400 via_upstream")
    assert b.prefix.size_blocks == held
    assert b.prefix.match(router.features.prompt_blocks(first)[0]) >= held - 1


# -- SpeedLearner: the engine's speed against its profile -----------------------------------


class Recorded(LatencyModel):
    """A latency model that keeps what it is taught."""

    def __init__(self) -> None:
        super().__init__()
        self.ttft: list[tuple[float, float]] = []
        self.decode: list[tuple[float, float]] = []

    def observe_ttft(self, profile_engine_ms: float, observed_engine_ms: float) -> None:
        self.ttft.append((profile_engine_ms, observed_engine_ms))

    def observe_decode(self, profile_step_ms: float, observed_step_ms: float) -> None:
        self.decode.append((profile_step_ms, observed_step_ms))


def taught(status: Status = Status.OK, **kw: Any) -> Recorded:
    """What a completion of `status` teaches backend a's latency model; the record's
    fields `kw` instead of these."""
    state = fleet("a")
    speed = Recorded()
    state.backends["a"].learned.speed = speed
    fields: dict[str, Any] = {
        "output_tokens": 20,
        "queue_ms": 300.0,
        "prefill_ms": 600.0,
        "rtt_ms": 100.0,
        "pace_ms": 50.0,
        "prefill_factor": 1.5,
        "decode_factor": 2.0,
        "predicted_ttft_ms": 1000.0,
        "predicted_e2e_ms": 3000.0,
    }
    rec = InFlight("r", "a", 0.0, 1000, **(fields | kw))
    SpeedLearner(state).on_close(closed(rec, status, ttft_ms=1000.0, e2e_ms=2900.0))
    return speed


def test_the_speed_learns_the_engines_part_against_the_profiles() -> None:
    speed = taught()
    # the profile's queue + prefill without the learned factor: (300 + 600) / 1.5; the
    # engine's part of the TTFT: 1,000 less the 100 ms RTT and the 50 ms hold
    (ttft,) = speed.ttft
    assert ttft == pytest.approx((600.0, 850.0))
    # the mean step predicted: (3,000 - 1,000) / 19 steps after the first token / 2.0;
    # seen: (2,900 - 1,000) / 19
    (step,) = speed.decode
    assert step == pytest.approx((2000 / 19 / 2.0, 100.0))


def test_the_decode_step_is_judged_over_the_output_expected_and_the_output_generated() -> None:
    speed = taught(expected_output_tokens=41.0, decode_calibration=0.5, output_tokens=4096)
    # predicted: 2,000 ms over 40 steps, less the calibration and the factor; seen: over
    # the 40 steps expected when the count is not known (not its budget's 4,095)
    assert speed.decode[0] == pytest.approx((2000 / 40 / 0.5 / 2.0, 1900 / 40))
    state = fleet("a")
    speed = Recorded()
    state.backends["a"].learned.speed = speed
    rec = InFlight(
        "r",
        "a",
        0.0,
        1000,
        output_tokens=4096,
        expected_output_tokens=41.0,
        decode_factor=2.0,
        decode_calibration=0.5,
        predicted_ttft_ms=1000.0,
        predicted_e2e_ms=3000.0,
        generated_tokens=31,
    )
    SpeedLearner(state).on_close(closed(rec, ttft_ms=1000.0, e2e_ms=2900.0))
    # known: 1,900 ms over the 30 steps it had (not its budget's)
    (step,) = speed.decode
    assert step == pytest.approx((2000 / 40 / 0.5 / 2.0, 1900 / 30))


def test_the_output_learner_learns_lengths_and_the_calibration() -> None:
    state = fleet("a")
    learner = OutputLearner(state)
    for i in range(20):
        rec = InFlight(
            f"r{i}",
            "a",
            0.0,
            1000,
            output_tokens=256,
            expected_output_tokens=256.0,
            tenant="t",
            session="s",
            predicted_ttft_ms=1000.0,
            predicted_e2e_ms=3000.0,
            generated_tokens=100,
        )
        learner.on_close(closed(rec, e2e_ms=2000.0))
    keys = [("", "tenant=t"), ("",)]
    assert state.output_lengths.expected(keys, None) == pytest.approx(100)
    # 20 E2Es over-predicted (3,000 against 2,000): the decode's multiplier stepped down
    # 20 times by 0.03 x min(1, 2,000 / 2,000)
    assert state.decode_calibration.multiplier(("a", "learned")) == pytest.approx(
        math.exp(-20 * 0.03)
    )
    # a failure teaches nothing
    learner.on_close(closed(replace(rec, generated_tokens=5), Status.ERROR))
    assert state.decode_calibration.samples[("a", "learned")] == 20


@pytest.mark.parametrize(
    ("case", "status", "kw", "ttft", "decode"),
    [
        ("fewer than 8 tokens: no decode step", Status.OK, {"output_tokens": 7}, 1, 0),
        ("not streamed: the first byte is the last", Status.OK, {"streaming": False}, 0, 0),
        ("failed", Status.ERROR, {}, 0, 0),
        ("served elsewhere", Status.FAILED_OVER, {}, 0, 0),
        ("no prediction (a peer's)", Status.OK, {"predicted_ttft_ms": None}, 0, 0),
    ],
)
def test_the_speed_learns_only_from_what_measures_it(
    case: str, status: Status, kw: dict[str, Any], ttft: int, decode: int
) -> None:
    speed = taught(status, **kw)
    assert (len(speed.ttft), len(speed.decode)) == (ttft, decode), case


def test_speed_learns_at_completion_and_only_from_the_chosen_backend() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    speed = r.backends["near"].learned.speed

    def unqueued(served_by: str | None) -> None:
        d = r.decide(chat(f"sample {random.random()} " * 20))
        assert d.backend == "near"
        clock.advance(0.2)
        r.first_byte(d.request_id)
        before = speed.samples[0]
        status = Status.OK if served_by is None else Status.FAILED_OVER
        r.close(d.request_id, status, served_by=served_by)
        assert speed.samples[0] == before + (served_by is None)  # learned at completion only
        clock.advance(60)  # let the queue drain

    unqueued("mid")  # Envoy retried elsewhere: that TTFT is not near's
    unqueued(None)
    assert speed.samples[0] == 1


# -- Ejector: passive health ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "after", "failures", "ejected_until_s"),
    [
        ("1 failure of 2: not yet", 2, 1, None),
        ("2 in a row: out for eject_s (5 s)", 2, 2, 105.0),
        ("ejection off (0)", 0, 9, None),
    ],
)
def test_the_ejector_ejects_after_eject_after_errors_failures_in_a_row(
    case: str, after: int, failures: int, ejected_until_s: float | None
) -> None:
    state = fleet("a")
    routing = make_config(routing={"eject_after_errors": after, "eject_s": 5.0}).routing
    b: BackendState = state.backends["a"]
    b.health.request_failures = failures  # what the fleet's close counted
    Ejector(state, routing).on_close(closed(InFlight("r", "a", 99.0, 10), Status.ERROR))
    assert b.health.ejected_until_s == ejected_until_s, case


def test_an_ejection_is_logged_with_what_failed(caplog: pytest.LogCaptureFixture) -> None:
    state = fleet("a")
    b = state.backends["a"]
    b.health.request_failures = 2
    b.health.recent_failures.extend(["503 UF", "504 UT"])
    routing = make_config(routing={"eject_after_errors": 2}).routing
    with caplog.at_level(logging.WARNING, logger="gorgo.router"):
        Ejector(state, routing).on_close(closed(InFlight("r", "a", 99.0, 10), Status.ERROR))
    assert "backend a ejected: 2 failed or unreachable requests in a row (503 UF; 504 UT)" in (
        caplog.text
    )


def test_two_failures_in_a_row_eject_a_backend_until_it_cools_down() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    assert fail(r, Status.ERROR) == "near"
    assert fail(r, Status.ERROR) == "near"  # second failure in a row: ejected
    assert r.backends["near"].health.ejected_until_s == clock() + 5.0
    assert all(fail(r, Status.OK) != "near" for _ in range(5))
    clock.advance(5.1)  # cooled down: back in rotation (half-open)
    assert fail(r, Status.ERROR) == "near"
    assert fail(r, Status.ERROR) == "near"
    # failing again right away: twice as long this time
    assert r.backends["near"].health.ejected_until_s == pytest.approx(clock() + 10.0)


def test_client_errors_and_cancellations_do_not_eject() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    for status in (
        Status.CLIENT_ERROR,
        Status.CANCELLED,
        Status.CLIENT_ERROR,
        Status.CANCELLED,
        Status.ERROR,
        Status.OK,
        Status.ERROR,
    ):
        assert fail(r, status) == "near"
    assert r.backends["near"].health.ejected_until_s is None


def fail(r: Router, status: Status) -> str:
    d = r.decide(chat(f"p{random.random()}"))
    r.close(d.request_id, status)
    return d.backend


# -- PredictionLearner: how right the predictions were ---------------------------------------


def test_the_prediction_error_is_kept_under_the_state_it_came_from() -> None:
    state = fleet("a")
    learner = PredictionLearner(state)
    # predicted 600 cached of a 1,000-token prompt, the engine reported 400: 20 % off
    rec = InFlight("r", "a", 0.0, 1000, cached_tokens=600, predicted_ttft_ms=900.0)
    learner.on_close(closed(rec, cached_tokens=400))
    learner.on_close(closed(replace(rec, request_id="s"), Status.ERROR, cached_tokens=0))
    learned = state.backends["a"].learned
    assert learned.prediction.as_json() == {
        "approximate": {"requests": 1, "mean_error_ratio": 0.2}  # not the failed one
    }
    assert learned.latency.as_json()["ttft"]["requests"] == 1  # 900 predicted, 1,000 seen


# -- TunerLearner: the tuner's arms ----------------------------------------------------------


class Arms:
    """What a TunerLearner tells the tuner."""

    def __init__(self) -> None:
        self.s = TunerSettings()
        self.calls: list[tuple[Any, ...]] = []

    def observe(self, rid: str, ttft: float | None, e2e: float | None, floor: float = 0.0) -> None:
        self.calls.append(("observe", rid, ttft, e2e, floor))

    def forget(self, rid: str) -> None:
        self.calls.append(("forget", rid))


@pytest.mark.parametrize(
    ("status", "told"),
    [
        (Status.OK, ("observe", "r", 1000.0, 3000.0, 0.0)),
        # the backend's doing: as if it had waited the failure time (60 s)
        (Status.ERROR, ("observe", "r", 60_000.0, 60_000.0, 0.0)),
        (Status.EXPIRED, ("observe", "r", 60_000.0, 60_000.0, 0.0)),
        (Status.FAILED_OVER, ("observe", "r", 60_000.0, 60_000.0, 0.0)),
        # nothing about the weights: forgotten
        (Status.CANCELLED, ("forget", "r")),
        (Status.CLIENT_ERROR, ("forget", "r")),
        (Status.GATEWAY_ERROR, ("forget", "r")),
        (Status.LOST, ("forget", "r")),
    ],
)
def test_each_end_counts_for_or_against_the_arm_or_is_forgotten(
    status: Status, told: tuple[Any, ...]
) -> None:
    assert set(Status) == {
        Status.OK,
        Status.ERROR,
        Status.EXPIRED,
        Status.FAILED_OVER,
        Status.CANCELLED,
        Status.CLIENT_ERROR,
        Status.GATEWAY_ERROR,
        Status.LOST,
    }  # every end is in this table
    arms = Arms()
    TunerLearner(arms, 60_000.0).on_close(closed(InFlight("r", "a", 0.0, 10), status))  # type: ignore[arg-type]
    assert arms.calls == [told]


def test_excess_floor_is_the_fastest_profiles_idle_prefill_and_e2e_is_untouched() -> None:
    fast = load_profile()
    slow = replace(fast, prefill_tokens_per_s=fast.prefill_tokens_per_s / 2)
    t = Tuner(replace(PAIRED_S, objective=EXCESS_TTFT), Weights(1.0, 1.0), random.Random(0))
    learner = TunerLearner(t, 60_000.0, {"slow": slow, "fast": fast})
    assert learner.floor_ms(50_000) == fast.lone_ttft_ms(50_000)  # not the chosen backend's
    assert learner.floor_ms(0) == 0.0 and TunerLearner(t, 1.0).floor_ms(50_000) == 0.0
    t.weights_for("x")
    arm = t.arm_for("x")
    close_ok(learner, "x", 50_000, fast.lone_ttft_ms(50_000) + 120.0, 9_000.0)
    ttft, e2e = t._strategy.round[arm][0]  # type: ignore[attr-defined]
    assert ttft == pytest.approx(120.0) and e2e == 9_000.0  # the E2E guard sees raw E2E


def test_the_router_reports_whether_the_other_arm_would_have_decided_alike() -> None:
    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    seen: list[Weights] = []

    def would_pick(candidates: Any, w: Weights, backend: str) -> bool:
        seen.append(w)
        return True

    learner = TunerLearner(t, 60_000.0, would_pick=would_pick)

    class Event:  # what TunerLearner reads of a Dispatched event
        def __init__(self, rid: str) -> None:
            self.decision = type("D", (), {"request_id": rid, "candidates": (), "backend": "a"})

    for i in range(TIES.tie_decisions):
        rid = f"r{i}"
        arm = t.arm_for(rid)
        t.weights_for(rid)
        learner.on_dispatch(Event(rid))  # type: ignore[arg-type]
        other = t.state.parent if arm == CHILD else t.state.child
        assert seen[-1] == Weights(*other) or t.state.history
    assert t.state.history[-1]["tie"]
    t.freeze()
    t.weights_for("frozen")
    learner.on_dispatch(Event("frozen"))  # type: ignore[arg-type]
    assert len(seen) == TIES.tie_decisions  # frozen: nothing to compare


def test_ties_are_off_by_default_and_the_router_then_reports_nothing() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    asked: list[Weights] = []
    learner = TunerLearner(t, 60_000.0, would_pick=lambda c, w, b: bool(asked.append(w)) or True)
    decision = type("D", (), {"request_id": "r0", "candidates": (), "backend": "a"})
    t.weights_for("r0")
    learner.on_dispatch(type("E", (), {"decision": decision})())  # type: ignore[arg-type]
    assert not asked and t.other_weights("r0") is None and not t.state.history
