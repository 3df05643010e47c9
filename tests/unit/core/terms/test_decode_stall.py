"""The decode-stall term: what the request's prefill does to the others on the backend.
Every request there stalls for the whole of it (prefill runs before decode): the prefill
term x the requests in flight, in ms of their E2E summed."""

import pytest

from ext_proc.core.terms.catalog import BUILT_IN, TERMS
from ext_proc.core.terms.decode_stall import decode_stall_term_ms
from tests.builders import backend_state, term_inputs


@pytest.mark.parametrize(
    ("case", "in_flight", "prefill_ms", "expected_ms"),
    [
        ("nobody there: no one stalls", 0, 250.0, 0.0),
        ("one there stalls for the whole prefill", 1, 250.0, 250.0),
        ("twelve there: twelve times", 12, 2300.0, 27_600.0),
        ("nothing to prefill: no stall", 12, 0.0, 0.0),
    ],
)
def test_the_decode_stall_term_in_ms(
    case: str, in_flight: int, prefill_ms: float, expected_ms: float
) -> None:
    b = backend_state()
    b.load.in_flight = in_flight
    # it reads the prefill term computed before it, not its own estimate of the prefill
    assert decode_stall_term_ms(term_inputs(b, input_tokens=5000), {"prefill": prefill_ms}) == (
        pytest.approx(expected_ms)
    ), case


def test_the_decode_stall_term_comes_after_the_prefill_and_is_no_part_of_the_ttft() -> None:
    assert BUILT_IN.index("decode_stall") > BUILT_IN.index("prefill")
    info = TERMS["decode_stall"]
    assert (info.ttft, info.cost, info.label) == (False, True, "decode stall")
