"""A backend's learned speed: from its completions the router learns how much faster or
slower than its profile the engine prefills and decodes, and its estimates follow."""

import random

import pytest

from ext_proc.estimate.latency_model import MAX_FACTOR, MIN_FACTOR, LatencyModel
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router

BACKEND = [{"id": "a", "address": "127.0.0.1:1", "rtt_prior_ms": 20}]


def serve(learn: bool, prefill_x: float, decode_x: float, n: int) -> tuple[object, list[float]]:
    """n requests one at a time on a backend that prefills prefill_x and decodes decode_x
    times as slowly as its profile says; the TTFT prediction's relative error per request."""
    r, clock = make_router("gorgo", backends=BACKEND, routing={"learn_latency": learn})
    rng = random.Random(0)
    errors = []
    for i in range(n):
        text = "word " * rng.randint(200, 4000)
        req = chat(text, rid=f"r{i}")
        d = r.decide(req)
        c = d.chosen
        ttft_ms = (
            c.rtt_ms
            + (c.queue_ms + c.prefill_ms) / r.backends["a"].learned.speed.prefill_factor * prefill_x
        )
        ttft_ms *= rng.lognormvariate(0, 0.05)
        errors.append(abs(c.predicted_ttft_ms - ttft_ms) / ttft_ms)
        clock.advance(ttft_ms / 1000)
        r.first_byte(d.request_id)
        decode_ms = c.decode_ms / r.backends["a"].learned.speed.decode_factor * decode_x
        clock.advance(decode_ms / 1000)
        r.close(d.request_id, Status.OK)
        clock.advance(30)  # idle between requests
    return r.backends["a"].learned.speed, errors


def test_a_slower_engine_is_learned_within_200_completions() -> None:
    speed, errors = serve(True, prefill_x=3.0, decode_x=2.0, n=200)
    assert speed.prefill_factor == pytest.approx(3.0, rel=0.05)  # type: ignore[attr-defined]
    assert speed.decode_factor == pytest.approx(2.0, rel=0.05)  # type: ignore[attr-defined]
    assert errors[0] > 0.5  # at first the profile's speed: far off
    assert sum(errors[-50:]) / 50 < 0.08  # then within noise


def test_without_learning_the_profile_stays() -> None:
    speed, errors = serve(False, prefill_x=3.0, decode_x=2.0, n=50)
    assert (speed.prefill_factor, speed.decode_factor) == (1.0, 1.0)  # type: ignore[attr-defined]
    assert sum(errors) / len(errors) > 0.5


def test_factors_stay_within_bounds() -> None:
    m = LatencyModel()
    for _ in range(500):
        m.observe_ttft(100.0, 100_000.0)  # a pathological engine: 1000x the profile
        m.observe_decode(100.0, 0.0)  # and a clock gone wrong: ignored
    assert m.prefill_factor == MAX_FACTOR and m.decode_factor == 1.0
    for _ in range(500):
        m.observe_decode(100.0, 0.001)
    assert m.decode_factor == MIN_FACTOR
    assert m.samples == (500, 500)


def test_one_stuck_request_does_not_make_its_backend_look_many_times_slower() -> None:
    m = LatencyModel()
    m.observe_ttft(10.0, 2000.0)  # 200x: stuck behind something the model did not see
    assert 1.0 < m.prefill_factor < 2.0
