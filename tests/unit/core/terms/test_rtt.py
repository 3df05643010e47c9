"""The RTT term: the probes' smoothed round trip to the backend, as it stands."""

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.rtt import rtt_ms
from tests.builders import backend_state, term_inputs


def test_the_rtt_term_is_the_backends_smoothed_round_trip_whole() -> None:
    b = backend_state(rtt_ms=90.0)
    assert rtt_ms(term_inputs(b), {}) == 90.0  # the prior, until a probe answers
    b.health.rtt_ms = 42.5  # what the probes' smoothing made of it
    # the whole round trip (the request's way there, its first token's way back), and
    # nothing of the request: its size, what is cached, what is in flight
    assert rtt_ms(term_inputs(b, input_tokens=50_000, cached_tokens=10_000), {}) == 42.5


def test_the_rtt_term_is_part_of_the_ttft_and_a_cost() -> None:
    info = TERMS["rtt"]
    assert (info.key, info.ttft, info.cost, info.label) == ("rtt_ms", True, True, "RTT")
    assert info.compute(term_inputs(backend_state(rtt_ms=7.0)), {}) == pytest.approx(7.0)
