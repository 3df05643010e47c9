"""On a backend whose engine schedules by priority, the wait the router predicts for a
request (the queue term, so its TTFT; flow control's room, `unstarted_ms`) counts only the
work the engine serves before it: its class and above, and the prefill already under way;
the KV of lower classes is not waited for (the engine preempts them), and the engine's
own waiting count loses the router's lower-class requests. A backend without priority
scheduling counts everything, as before. Two backends alike but for that setting, side
by side in each decision's candidates, on a clock that does not move."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ext_proc.core.router import Router
from ext_proc.director.outcomes import Queued, Routed
from ext_proc.director.recipe import Director
from ext_proc.estimate.cost import QueueItem, ahead_of
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.vocab.types import Candidate, RouteRequest
from tests.builders import chat, load, make_router
from tests.fakes import FakeClock

INTERACTIVE, BATCH = 10, 0


def fleet(**backend: object) -> tuple[Router, FakeClock]:
    """`on` (vLLM, priority scheduling on) and `off` (the same, off), 1 ms away."""
    specs = [
        {"id": "on", "address": "127.0.0.1:1", "engine": "vllm", "priority_scheduling": "on"},
        {"id": "off", "address": "127.0.0.1:2", "engine": "vllm", "priority_scheduling": "off"},
    ]
    return make_router(
        "round_robin",
        900.0,
        backends=[{**s, "rtt_prior_ms": 1, **backend} for s in specs],
        flow_control={"enabled": True},
        routing={"pace_sigmas": 0},
    )


def request(rid: str, priority: int, words: int = 2000, max_tokens: int = 64) -> RouteRequest:
    text = " ".join(f"w{rid}{i}" for i in range(words))  # no prefix shared
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return RouteRequest(rid, parse_body(CHAT, json.dumps(body).encode()), None, priority=priority)


def by_backend(candidates: tuple[Candidate, ...]) -> dict[str, Candidate]:
    return {c.backend_id: c for c in candidates}


def batch_on_both(router: Router, n: int) -> list[str]:
    """n batch requests, round robin: n/2 waiting for their first token on each backend."""
    rids = [f"batch{i}" for i in range(n)]
    for rid in rids:
        router.decide(request(rid, BATCH))
    return rids


def test_an_interactive_request_waits_only_for_the_prefill_under_way() -> None:
    router, _ = fleet()
    batch_on_both(router, 6)  # three each, all sent now, none started
    prefill_ms = router.in_flight["batch0"].prefill_ms
    assert all(router.in_flight[f"batch{i}"].prefill_ms == prefill_ms for i in range(6))
    c = by_backend(router.decide(request("i", INTERACTIVE)).candidates)
    # off: behind all three batch prefills; on: behind the one the engine is at work on
    assert c["off"].queue_ms == pytest.approx(3 * prefill_ms)
    assert c["on"].queue_ms == pytest.approx(prefill_ms)
    assert c["on"].predicted_ttft_ms == pytest.approx(c["off"].predicted_ttft_ms - 2 * prefill_ms)
    # flow control's room: the work not yet started ahead of it, the same way
    assert c["off"].unstarted_ms == pytest.approx(3 * prefill_ms)
    assert c["on"].unstarted_ms == pytest.approx(prefill_ms)
    assert (c["on"].by_priority, c["off"].by_priority) == (True, False)


def test_a_batch_request_waits_behind_everything_and_an_interactive_one_ahead() -> None:
    router, _ = fleet()
    batch_on_both(router, 4)
    router.decide(request("i", INTERACTIVE))  # round robin: to `on`
    assert router.in_flight["i"].backend == "on" and router.in_flight["i"].priority == 10
    ms = {rid: rec.prefill_ms for rid, rec in router.in_flight.items()}
    c = by_backend(router.decide(request("b", BATCH)).candidates)
    # on: its two batch requests and the interactive one are ahead; off: its two
    assert c["on"].queue_ms == pytest.approx(ms["batch0"] + ms["batch2"] + ms["i"])
    assert c["off"].queue_ms == pytest.approx(ms["batch1"] + ms["batch3"])
    assert router.in_flight["b"].backend == "off"
    # a second interactive request: the first one (its class) and the head are ahead
    c = by_backend(router.decide(request("i2", INTERACTIVE)).candidates)
    assert c["on"].queue_ms == pytest.approx(ms["batch0"] + ms["i"])


def test_the_head_is_credited_with_the_time_the_engine_worked_on_it() -> None:
    router, clock = fleet()
    batch_on_both(router, 4)
    prefill_ms = router.in_flight["batch0"].prefill_ms
    clock.advance(prefill_ms / 2 / 1000 + 0.0005)  # half the head's prefill, past the trip
    c = by_backend(router.decide(request("i", INTERACTIVE)).candidates)
    assert c["on"].queue_ms == pytest.approx(prefill_ms / 2, rel=1e-3)
    assert c["off"].queue_ms == pytest.approx(prefill_ms * 1.5, rel=1e-3)


def test_lower_classes_kv_is_not_waited_for_the_engine_preempts_them() -> None:
    """A pool that the batch requests running there fill: a batch newcomer waits for one
    to finish; an interactive one is admitted (vLLM preempts the running request of the
    lowest priority when its blocks run out)."""
    router, _ = fleet(kv_capacity_tokens=7000)
    rids = batch_on_both(router, 4)
    for rid in rids:  # all decoding now: ~2,000-token prompts + 64 out, two per backend
        router.first_byte(rid)
    c = by_backend(router.decide(request("i", INTERACTIVE, max_tokens=3000)).candidates)
    # off: it waits until a batch request finishes and frees its KV (~64 decode steps)
    assert c["off"].queue_ms > 100
    assert c["on"].queue_ms == pytest.approx(0.0, abs=1e-6)
    assert c["on"].term("kv") == pytest.approx(0.0, abs=1e-6)  # nor within its margin


def test_the_engines_own_waiting_count_loses_our_lower_class_requests() -> None:
    router, _ = fleet()
    batch_on_both(router, 4)  # two waiting on each backend, as the engines will say
    for b in ("on", "off"):
        router.inputs.record_engine_report(b, EngineReport(waiting=2, running=0, kv_usage=0.1))
    mean_ms = router.backends["on"].load.mean_prefill_ms
    c = by_backend(router.decide(request("i", INTERACTIVE, words=20)).candidates)
    # off: both counted at the mean prefill (more than the router's own estimate here);
    # on: the engine's two are the router's batch requests, behind the interactive one,
    # and its own estimate (the head) stands
    assert c["off"].queue_ms == pytest.approx(max(2 * mean_ms, c["off"].queue_ms))
    assert c["off"].queue_ms >= 2 * mean_ms
    assert c["on"].queue_ms == pytest.approx(router.in_flight["batch0"].prefill_ms)


def test_ahead_of_keeps_the_class_and_above_and_the_lower_head() -> None:
    def item(at_s: float, priority: int, started: bool = False) -> QueueItem:
        return QueueItem(100.0, 1000, 10, at_s, at_s + 1 if started else None, priority=priority)

    running_low = item(0.0, 0, started=True)
    head_low = item(1.0, 0)
    later_low = item(2.0, 0)
    same = item(3.0, 5)
    higher = item(4.0, 9)
    items = [running_low, head_low, later_low, same, higher]
    assert ahead_of(items, 5) == [head_low, same, higher]
    assert ahead_of(items, 10) == [head_low]
    assert ahead_of(items, 0) is items  # nothing below it: all of it, as it was
    assert ahead_of([running_low, higher], 5) == [higher]  # no lower one waiting: no head


def test_a_lower_band_may_go_where_only_its_own_prefill_can_delay_a_higher_one() -> None:
    """Room for the bands above (director.flow_control): a batch request's prefill (~400 ms) behind
    250 ms of batch work would hold an interactive request (SLO 1 s) past half its SLO on
    an engine serving in arrival order; one that schedules by priority puts that request
    first, so only the batch prefill under way can delay it (400 ms <= 500 ms)."""
    flow = {
        "enabled": True,
        "objectives": [
            {"name": "interactive", "priority": 10, "ttft_slo_ms": 1000},
            {"name": "batch", "priority": 0},
        ],
    }
    outcomes = {}
    for setting in ("on", "off"):
        router, _ = make_router(
            "gorgo",
            backends=[
                {
                    "id": "a",
                    "address": "127.0.0.1:1",
                    "engine": "vllm",
                    "priority_scheduling": setting,
                }
            ],
            flow_control=flow,
        )
        director = Director(router)
        # an interactive request arrived a moment ago: holding can gain (flow.room.Mix)
        director.admission.mix.seen((10, "", "interactive", 0.0), router.clock())
        load(router, "peer", "a", 3000, 10, prefill_ms=250)  # batch work not yet started
        outcomes[setting] = director.handle(
            replace(chat("many words " * 1500, rid="m"), objective="batch")
        )
    on, off = outcomes["on"], outcomes["off"]
    assert isinstance(off, Queued)
    assert isinstance(on, Routed)
    assert 250 < on.decision.chosen.prefill_ms <= 500 < 250 + on.decision.chosen.prefill_ms
