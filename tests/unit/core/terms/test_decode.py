"""The decode term: the request's own decode there, predicted (its decode steps replayed
in the batch it will decode in: estimate/decode_replay.py), at the backend's learned
decode speed and calibration. A prediction, no cost: the predicted E2E.
ROUND_PROFILE's step: 10 ms + 1 ms a running request + 2 ms per 1k tokens of context;
at most 4 running."""

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.decode import decode_ms, decoders
from ext_proc.estimate.cost import QueueItem
from ext_proc.estimate.latency_model import LatencyModel
from tests.builders import backend_state, term_inputs

# alone, a 1,000-token prompt, 101 output tokens: 100 steps of 11 ms, its context
# 1,001 + t: 1,100 + 2 x 105,050 / 1,000
ALONE_MS = 1310.1


def _item(prompt: int, output: int, first_byte_s: float | None) -> QueueItem:
    return QueueItem(0.0, prompt + output, output, 0.0, first_byte_s, None, prompt, 0)


def test_alone_its_steps_at_the_profiles_step() -> None:
    x = term_inputs(backend_state(), input_tokens=1000, output_tokens=101)
    assert decode_ms(x, {}) == pytest.approx(ALONE_MS)


def test_the_expected_output_stands_for_the_budget() -> None:
    x = term_inputs(
        backend_state(), input_tokens=1000, output_tokens=4096, expected_output_tokens=101.0
    )
    assert decode_ms(x, {}) == pytest.approx(ALONE_MS)


def test_the_learned_speed_and_the_calibration_multiply_it() -> None:
    x = term_inputs(
        backend_state(),
        input_tokens=1000,
        output_tokens=101,
        speed=LatencyModel(decode_factor=1.5),
        decode_calibration=0.8,
    )
    assert decode_ms(x, {}) == pytest.approx(ALONE_MS * 1.5 * 0.8)


def test_a_request_waiting_ahead_decodes_beside_it_until_its_output_is_done() -> None:
    # 2,000-token prompt, 50 output tokens, not yet begun: steps 0-49 beside it
    x = term_inputs(
        backend_state(), input_tokens=1000, output_tokens=101, items=[_item(2000, 50, None)]
    )
    assert decode_ms(x, {}) == pytest.approx(1562.55)


def test_a_decoding_request_has_done_a_token_a_step_since_its_first() -> None:
    # first token 1 s ago at a 20 ms step: 1 + 50 tokens done of its 100
    (d,) = decoders([_item(2000, 100, 9.0)], now_s=10.0, step_ms=20.0)
    assert (d.context_tokens, d.remaining_tokens) == (2051.0, 49.0)
    (waiting,) = decoders([_item(2000, 100, None)], now_s=10.0, step_ms=20.0)
    assert (waiting.context_tokens, waiting.remaining_tokens) == (2000, 100)


def test_no_output_no_decode() -> None:
    x = term_inputs(backend_state(), input_tokens=1000, output_tokens=1)
    assert decode_ms(x, {}) == 0.0


def test_the_decode_term_is_a_prediction_not_a_cost() -> None:
    info = TERMS["decode"]
    assert (info.cost, info.ttft, info.weight) == (False, False, 0.0)
