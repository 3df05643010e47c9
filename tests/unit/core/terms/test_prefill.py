"""The prefill term: the request's uncached tokens after its cached ones, on the backend's
profile (PrefillModel), at the speed learned for its model. ROUND_PROFILE: 10 ms a chunk
of 1,000 tokens, 1 ms a token x (1 + (cached + uncached / 2) / 10,000)."""

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.prefill import prefill_ms
from ext_proc.estimate.latency_model import LatencyModel
from tests.builders import term_inputs


@pytest.mark.parametrize(
    ("case", "input_tokens", "cached_tokens", "prefill_factor", "expected_ms"),
    [
        # 1 chunk: 10 + 500 x (1 + 250 / 10,000)
        ("short prompt, nothing cached", 500, 0, 1.0, 10 + 500 * 1.025),
        # 3 chunks: 30 + 2,500 x (1 + (1,000 + 1,250) / 10,000)
        ("the cached prefix is skipped but lengthens the context", 3500, 1000, 1.0, 3092.5),
        ("an engine learned twice as slow", 3500, 1000, 2.0, 6185.0),
        ("everything cached: nothing to prefill", 2000, 2000, 1.0, 0.0),
    ],
)
def test_the_prefill_term_in_ms(
    case: str, input_tokens: int, cached_tokens: int, prefill_factor: float, expected_ms: float
) -> None:
    x = term_inputs(
        input_tokens=input_tokens,
        cached_tokens=cached_tokens,
        speed=LatencyModel(prefill_factor=prefill_factor),
    )
    assert prefill_ms(x, {}) == pytest.approx(expected_ms), case


def test_the_prefill_term_is_part_of_the_ttft() -> None:
    assert (TERMS["prefill"].ttft, TERMS["prefill"].cost) == (True, True)
