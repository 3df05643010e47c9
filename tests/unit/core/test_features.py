"""Dispatch pacing: a request routed right after another to the same backend is paced for
the WAN's jitter, so the two reach the engine in the order the queue estimate assumed;
never longer than the queue it would meet there on arrival, nor than routing.pace_max_ms.
And each candidate's predicted TTFT (the sum of its terms) and E2E (plus its decode)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.core.router import Router
from ext_proc.estimate.decode_replay import replay_decode_ms
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.types import RouteRequest
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import _AT_ENGINE, Simulation
from loadgen.traces.request import TraceRequest
from tests.builders import Dispatches, load, make_router
from tests.fakes import FakeClock


def chat(rid: str, words: int = 3000) -> RouteRequest:
    text = " ".join(f"w{rid}{i}" for i in range(words))  # no prefix shared between requests
    body = {"messages": [{"role": "user", "content": text}], "stream": True}
    return RouteRequest(rid, parse_body(CHAT, json.dumps(body).encode()), None)


def one_backend(routing: dict[str, Any] | None = None) -> tuple[Router, FakeClock]:
    return make_router(
        "gorgo",
        900.0,
        backends=[{"id": "a", "address": "127.0.0.1:1", "rtt_prior_ms": 100}],
        routing=routing or {},
    )


def jitter(router: Router, samples: tuple[float, ...] = (100, 140, 60, 140, 60, 100)) -> float:
    """Feed probe samples; the router's estimate of their standard deviation (ms)."""
    for s in samples:
        router.inputs.record_probe("a", s)
    return math.sqrt(router.backends["a"].health.rtt_var_ms2)


def test_probe_samples_give_the_jitter_estimate() -> None:
    router, _ = one_backend()
    assert jitter(router, (100.0,) * 6) == 0.0
    sigma = jitter(router)
    assert 20 < sigma < 60  # samples 40 ms either side of 100
    assert router.backends["a"].as_json(0.0)["rtt_std_ms"] == pytest.approx(sigma, abs=1e-3)


def test_a_second_dispatch_at_once_is_held_for_the_jitter() -> None:
    router, clock = one_backend()
    sigma = jitter(router)
    first = router.decide(chat("r1"))
    second = router.decide(chat("r2"))
    assert first.pace_ms == 0.0
    # 2 sigma (the default), below the queue r1 puts ahead of r2 and below the cap
    assert second.chosen.queue_ms > 2 * sigma
    assert second.pace_ms == pytest.approx(2 * sigma)
    assert second.as_json()["hold_ms"] == pytest.approx(2 * sigma, abs=1e-3)
    # a third is paced until 2 sigma after the second is sent
    third = router.decide(chat("r3"))
    assert third.pace_ms == pytest.approx(4 * sigma)
    # once the gap has passed, nothing is held
    clock.advance(1.0)
    assert router.decide(chat("r4")).pace_ms == 0.0


def test_the_pace_is_capped_by_the_queue_and_by_pace_max_ms() -> None:
    router, _ = one_backend({"pace_max_ms": 10})
    jitter(router)
    router.decide(chat("r1"))
    assert router.decide(chat("r2")).pace_ms == 10.0
    # a jitter of hundreds of ms: the queue the newcomer meets on arrival (what is owed
    # there now, less the half-trip it travels) bounds its pace
    for words, paced_at_all in ((1000, False), (2000, True)):
        router, _ = one_backend()
        jitter(router, (100, 1000, 100, 1000, 100))
        router.decide(chat("s1", words=words))
        paced = router.decide(chat("s2", words=2))
        on_arrival_ms = paced.chosen.queue_ms - router.backends["a"].health.rtt_ms / 2
        assert (on_arrival_ms > 0) is paced_at_all
        assert paced.pace_ms == pytest.approx(max(0.0, on_arrival_ms))
        assert paced.pace_ms < 250


def test_pacing_off_paces_nothing() -> None:
    router, _ = one_backend({"pace_sigmas": 0})
    jitter(router)
    router.decide(chat("r1"))
    assert router.decide(chat("r2")).pace_ms == 0.0


def test_a_pace_past_half_the_envoy_deadline_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"routing.pace_max_ms: at most half of envoy"):
        config_from_dict(
            {
                "routing": {"pace_max_ms": 600},
                "backends": [{"id": "a", "address": "127.0.0.1:1"}],
            }
        )


def _overtaken_pairs(pace_sigmas: float) -> int:
    """A burst of 12 long prompts at each of 20 instants over 3 backends with the paper's
    jitter (80-138 ms): pairs that reached an engine in the reverse of their dispatch
    order."""
    trace = [
        TraceRequest(12 * b + i, b * 8.0, 6000 + 500 * i, 16, (), 512, f"s{b}-{i}")
        for b in range(20)
        for i in range(12)
    ]
    s = SimSettings(rtt_profile="paper", router={"routing": {"pace_sigmas": pace_sigmas}})
    sim = Simulation(trace, s)
    dispatches = Dispatches()
    sim.router.subscribe(dispatches)
    arrived: dict[str, float] = {}
    push = sim._push

    def push_spy(t: float, kind: int, data: Any) -> None:
        if kind == _AT_ENGINE:
            arrived[data[1].id] = t
        push(t, kind, data)

    sim._push = push_spy  # type: ignore[method-assign]
    sim.run()
    return sum(
        1
        for ids in dispatches.by_backend().values()
        for i, a in enumerate(ids)
        for b in ids[i + 1 :]
        if arrived[b] < arrived[a]
    )


def test_pacing_keeps_the_order_the_queue_estimate_assumed() -> None:
    # What is left paced: the first burst (before any probe sample measured the jitter)
    # and paces cut by pace_max_ms (2 sigma of ap-seoul's 138 ms is 276 ms). What pacing
    # does to the tail is measured in `gorgo bench target` (docs/cost-model.md).
    unpaced = _overtaken_pairs(0.0)
    assert unpaced > 100
    assert _overtaken_pairs(2.0) <= unpaced / 4


# -- the predicted TTFT and E2E -----------------------------------------------------------


def test_the_predicted_ttft_is_the_sum_of_the_terms_and_e2e_adds_the_decode() -> None:
    router, _ = make_router("gorgo", backends=["a", "b"])
    load(router, "p1", "a", 4000, 100, prefill_ms=300.0)  # queued ahead on a
    load(router, "p2", "a", 2000, 100, decoding=True)
    body = {"messages": [{"role": "user", "content": "w " * 500}], "max_tokens": 64}
    request = RouteRequest("r", parse_body(CHAT, json.dumps(body).encode()), None)
    blocks = router.features.prompt_blocks(request)
    a, b = sorted(router.features.candidates(request, blocks), key=lambda c: c.backend_id)
    assert a.queue_ms > 0 and a.prefill_ms > 0 and b.queue_ms == 0
    for c in (a, b):
        assert c.predicted_ttft_ms == c.rtt_ms + c.queue_ms + c.prefill_ms
        assert c.predicted_e2e_ms == c.predicted_ttft_ms + c.decode_ms
        assert c.as_json()["predicted_ttft_ms"] == round(c.predicted_ttft_ms, 3)
    n = a.cached_tokens + a.uncached_tokens
    profile = router.backends["a"].profile
    # its 64 tokens (max_tokens, believed before any completion says otherwise): 63
    # decode steps after its first; alone on b, beside the two in flight on a
    assert a.expected_output_tokens == b.expected_output_tokens == 64
    assert b.decode_ms == pytest.approx(replay_decode_ms(profile, n + 1, 63, []))
    assert a.decode_ms > b.decode_ms
    d = router.decide(request)
    rec = router.in_flight["r"]
    assert (rec.predicted_ttft_ms, rec.predicted_e2e_ms) == (
        d.chosen.predicted_ttft_ms,
        d.chosen.predicted_e2e_ms,
    )
