"""The decode term: the request's own decode there, predicted (its output budget x the
decode step it comes at, with every request in flight there and itself in the batch, at
most the engine's running limit). A prediction, no cost: the predicted E2E.
ROUND_PROFILE's step: 10 ms + 1 ms a running request + 2 ms per 1k tokens of context;
at most 4 running."""

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.decode import decode_ms, newcomer_step_ms
from ext_proc.estimate.latency_model import LatencyModel
from tests.builders import backend_state, load, make_router, term_inputs


@pytest.mark.parametrize(
    ("case", "in_flight", "in_flight_tokens", "decode_factor", "expected_ms"),
    [
        # alone: a batch of 1, its 1,000-token prompt as the context: 10 + 1 + 2 = 13 ms
        ("alone", 0, 0, 1.0, 100 * 13.0),
        # with 2 there (3,000 tokens): a batch of 3, 4,000 tokens: 10 + 3 + 8 = 21 ms
        ("with two in flight", 2, 3000, 1.0, 100 * 21.0),
        # 7 there: 8 in the batch, 4 of them running with their share (half) of the
        # 8,000 tokens: 10 + 4 + 8 = 22 ms
        ("past the running limit", 7, 7000, 1.0, 100 * 22.0),
        ("an engine learned 1.5 times slower", 7, 7000, 1.5, 100 * 33.0),
    ],
)
def test_the_decode_term_is_the_output_budget_times_the_newcomers_step(
    case: str, in_flight: int, in_flight_tokens: int, decode_factor: float, expected_ms: float
) -> None:
    b = backend_state()
    b.load.in_flight, b.load.in_flight_tokens = in_flight, in_flight_tokens
    x = term_inputs(
        b, input_tokens=1000, output_tokens=100, speed=LatencyModel(decode_factor=decode_factor)
    )
    assert decode_ms(x, {}) == pytest.approx(expected_ms), case


def test_no_output_budget_no_decode() -> None:
    b = backend_state()
    b.load.in_flight = 3
    assert decode_ms(term_inputs(b, input_tokens=1000, output_tokens=0), {}) == 0.0


def test_the_newcomers_step_counts_no_more_than_the_engine_runs() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    b = router.backends["a"]
    limit = b.profile.max_running_requests
    for i in range(limit + 9):
        load(router, f"p{i}", "a", 100)
    # limit + 10 requests, the limit of them running: their share of the context
    assert newcomer_step_ms(b, 100, 1.0) == b.profile.decode_ms(limit, 100 * limit)


def test_the_decode_term_is_a_prediction_not_a_cost() -> None:
    info = TERMS["decode"]
    assert (info.cost, info.ttft, info.weight) == (False, False, 0.0)
