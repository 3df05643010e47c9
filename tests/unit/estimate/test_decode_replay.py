"""The decode's replay (estimate/decode_replay.py) on known batches, and its calibration to
the E2E's relative error. ROUND_PROFILE's step: 10 ms + 1 ms a running request + 2 ms per
1k tokens of context, at most 4 running."""

import math

import pytest

from ext_proc.estimate.decode_replay import (
    CALIBRATION_STEP,
    DecodeCalibration,
    Decoder,
    length_kind,
    replay_decode_ms,
)
from tests.builders import ROUND_PROFILE


def test_alone_its_context_grows_a_token_a_step() -> None:
    # 100 steps, context 1,001 + t: 100 x (10 + 1) + 2 x (100 x 1,001 + 4,950) / 1,000
    assert replay_decode_ms(ROUND_PROFILE, 1001, 100, []) == pytest.approx(1310.1)


def test_a_request_beside_it_leaves_the_batch_when_its_output_is_done() -> None:
    other = Decoder(context_tokens=2000, remaining_tokens=50)
    # steps 0-49: two decode, contexts 3,001 + 2t: 50 x 12 + 2 x 152,500 / 1,000 = 905;
    # steps 50-99: alone, 1,001 + t: 50 x 11 + 2 x 53,775 / 1,000 = 657.55
    assert replay_decode_ms(ROUND_PROFILE, 1001, 100, [other]) == pytest.approx(1562.55)
    # one that stays throughout costs more; one already done costs nothing
    stays = replay_decode_ms(ROUND_PROFILE, 1001, 100, [Decoder(2000, 500)])
    assert stays > 1562.55
    assert replay_decode_ms(ROUND_PROFILE, 1001, 100, [Decoder(2000, 0)]) == pytest.approx(1310.1)


def test_past_the_running_limit_only_the_running_share_counts() -> None:
    others = [Decoder(1000, 1000)] * 7
    # 8 in the batch, 4 running (half of the context): 10 x 14 + 2 x 80,370 x 0.5 / 1,000
    assert replay_decode_ms(ROUND_PROFILE, 1001, 10, others) == pytest.approx(220.37)


def test_a_joiner_counts_from_its_start_step_with_its_weight() -> None:
    # half a request joining at step 50 with a 1,000-token context, staying to the end:
    # steps 50-99 carry 1.5 decodes (2 running slots' step: ceil) and its context
    joined = replay_decode_ms(ROUND_PROFILE, 1001, 100, [Decoder(1000, 100, 50, 0.5)])
    alone = 1310.1
    extra_context = 0.5 * sum(1000 + (t - 50) for t in range(50, 100))
    assert joined == pytest.approx(alone + 50 * 1.0 + 2 * extra_context / 1000)


def test_no_steps_no_decode() -> None:
    assert replay_decode_ms(ROUND_PROFILE, 1001, 0, [Decoder(1000, 10)]) == 0.0


def test_the_calibration_settles_on_the_decode_of_least_relative_error() -> None:
    cal = DecodeCalibration()
    key = ("a", "known")
    # an uncalibrated decode of 1,000 ms; E2Es of 500, 500, 500, 5,000 (mean 1,625): the
    # least mean relative error is at 500 (3 x (x - 500) / 500 grows faster than
    # (5,000 - x) / 5,000 falls), a multiplier of 0.5
    measured = [500.0, 500.0, 500.0, 5000.0]
    for i in range(400):
        m = cal.multiplier(key)
        cal.observe(key, 1000 * m, 1000 * m, measured[i % 4])
    assert (
        0.5 * math.exp(-3 * CALIBRATION_STEP)
        <= cal.multiplier(key)
        <= 0.5 * math.exp(3 * CALIBRATION_STEP)
    )
    assert cal.samples[key] == 400
    assert cal.multiplier(("a", "learned")) == 1.0  # the other kind untouched


def test_the_calibration_is_bounded() -> None:
    cal = DecodeCalibration()
    for _ in range(1000):
        cal.observe(("a", "known"), 10.0, 10.0, 20.0)  # always under: up, to the bound
    assert cal.multiplier(("a", "known")) == pytest.approx(5.0)
    assert cal.backend_json("a") == {"known": {"multiplier": 5.0, "samples": 1000}}
    assert cal.backend_json("b") == {}


@pytest.mark.parametrize(
    ("expected", "max_tokens", "kind"),
    [(64.0, 64, "known"), (350.0, 4096, "learned"), (350.0, None, "learned")],
)
def test_the_length_is_known_when_its_cap_is_the_expected_length(
    expected: float, max_tokens: int | None, kind: str
) -> None:
    assert length_kind(expected, max_tokens) == kind
