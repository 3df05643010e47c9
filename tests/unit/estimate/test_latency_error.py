"""How right the latency predictions were: per request the predicted TTFT and E2E against
the measured ones, per backend the MAPE and bias over a window; what counts and what says
nothing (a failure, a non-streamed TTFT, a record without a prediction)."""

from __future__ import annotations

import pytest

from ext_proc.estimate.latency_error import (
    LatencyError,
    LatencyStats,
    e2e_error,
    error_summary,
    ttft_error,
)
from ext_proc.vocab.events import Closed
from ext_proc.vocab.types import InFlight, Status
from tests.builders import chat, make_router


def closed(
    predicted_ttft_ms: float | None,
    ttft_ms: float | None,
    predicted_e2e_ms: float | None,
    e2e_ms: float,
    status: Status = Status.OK,
    streaming: bool = True,
) -> Closed:
    rec = InFlight(
        "r",
        "a",
        0.0,
        100,
        predicted_ttft_ms=predicted_ttft_ms,
        predicted_e2e_ms=predicted_e2e_ms,
        streaming=streaming,
    )
    return Closed("r", "a", status, ttft_ms, e2e_ms, rec, 1.0)


def test_the_error_is_predicted_minus_measured_and_its_share_of_the_measure() -> None:
    err = LatencyError(predicted_ms=100.0, measured_ms=80.0)
    assert (err.error_ms, err.abs_pct_error) == (20.0, 0.25)
    assert LatencyError(100.0, 125.0).abs_pct_error == 0.2
    assert error_summary([]) == {"mape": None, "bias_ms": None, "requests": 0}


def test_mape_and_bias_on_a_hand_built_sequence_of_closes() -> None:
    stats = LatencyStats(window=3)
    stats.observe(closed(100.0, 80.0, 1000.0, 800.0))  # +20 ms (25 %), +200 ms (25 %)
    stats.observe(closed(100.0, 125.0, 1000.0, 1250.0))  # -25 ms (20 %), -250 ms (20 %)
    # say nothing of TTFT: not a stream (the first byte is the last); none of either: failed
    stats.observe(closed(100.0, 400.0, 500.0, 400.0, streaming=False))  # E2E +100 (25 %)
    stats.observe(closed(100.0, 50.0, 1000.0, 50.0, status=Status.ERROR))
    stats.observe(closed(None, 50.0, None, 50.0))  # no prediction (a peer's record)
    assert stats.as_json() == {
        "ttft": {"mape": 0.225, "bias_ms": -2.5, "requests": 2, "window": 2},
        "e2e": {"mape": round(0.7 / 3, 6), "bias_ms": round(50 / 3, 3), "requests": 3, "window": 3},
    }
    assert stats.ttft.mape == pytest.approx(0.225) and stats.ttft.bias_ms == -2.5
    # the window forgets the oldest: the first E2E error leaves it
    stats.observe(closed(90.0, 100.0, 900.0, 1000.0))  # TTFT and E2E -10 %
    assert stats.e2e.as_json() == {"mape": 0.183333, "bias_ms": -83.333, "requests": 4, "window": 3}
    assert stats.ttft.as_json()["window"] == 3


def test_a_close_without_a_measure_says_nothing() -> None:
    assert ttft_error(closed(100.0, None, 1000.0, 500.0)) is None  # no first byte
    assert ttft_error(closed(100.0, 0.0, 1000.0, 500.0)) is None
    assert e2e_error(closed(100.0, 80.0, 1000.0, 0.0)) is None
    for status in (Status.FAILED_OVER, Status.EXPIRED, Status.CANCELLED):
        c = closed(100.0, 80.0, 1000.0, 900.0, status=status)
        assert ttft_error(c) is None and e2e_error(c) is None


def test_the_router_learns_each_backends_error_and_shows_it_on_state() -> None:
    router, clock = make_router("gorgo", backends=["a"])
    d1 = router.decide(chat("first question", rid="r1"))
    rec = router.in_flight["r1"]
    p_ttft, p_e2e = d1.chosen.predicted_ttft_ms, d1.chosen.predicted_e2e_ms
    assert (rec.predicted_ttft_ms, rec.predicted_e2e_ms) == (p_ttft, p_e2e)
    clock.advance(0.5)
    router.first_byte("r1")
    router.close("r1", Status.OK, e2e_ms=2000.0)
    d2 = router.decide(chat("second question", rid="r2"))
    q_ttft, q_e2e = d2.chosen.predicted_ttft_ms, d2.chosen.predicted_e2e_ms
    clock.advance(0.25)
    router.first_byte("r2")
    router.close("r2", Status.OK, e2e_ms=1000.0)
    router.close(router.decide(chat("failed", rid="r3")).request_id, Status.ERROR)

    ttft = [LatencyError(p_ttft, 500.0), LatencyError(q_ttft, 250.0)]
    e2e = [LatencyError(p_e2e, 2000.0), LatencyError(q_e2e, 1000.0)]
    shown = router.snapshot()["backends"]["a"]["latency_prediction"]
    assert shown == {
        "ttft": {**error_summary(ttft), "window": 2},
        "e2e": {**error_summary(e2e), "window": 2},
    }
    assert shown["ttft"]["bias_ms"] == pytest.approx((p_ttft - 500 + q_ttft - 250) / 2, abs=1e-3)
