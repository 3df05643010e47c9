"""The KV term: when the backend's KV pool is nearly full, the wait until the requests
finishing first free enough of it within a 10 % margin of the pool, beyond what the
request already waits (its queue and LoRA wait)."""

import pytest

from ext_proc.core.terms.catalog import BUILT_IN, TERMS
from ext_proc.core.terms.kv import kv_ms
from ext_proc.estimate.cost import QueueItem
from tests.builders import term_inputs

NOW_S, STEP_MS = 100.0, 20.0
# A 10,000-token pool (9,000 within the margin); two decoding requests hold 4,000 each:
# the first to finish has 10 tokens of 20 ms left (200 ms), the other 100 (2,000 ms).
SOON = QueueItem(0.0, 4000, 500, dispatched_s=0.0, first_byte_s=NOW_S - 490 * 0.02)
LATER = QueueItem(0.0, 4000, 500, dispatched_s=0.0, first_byte_s=NOW_S - 400 * 0.02)


@pytest.mark.parametrize(
    ("case", "need_kv_tokens", "waited", "expected_ms"),
    [
        ("within the margin: room", 1000, (0.0, 0.0), 0.0),
        ("into the margin: the first finisher", 1500, (0.0, 0.0), 200.0),
        ("less what the queue and the LoRA slot already wait", 1500, (50.0, 30.0), 120.0),
        ("a queue longer than the wait: nothing beyond it", 1500, (250.0, 0.0), 0.0),
        ("more than the first frees: the second too", 6000, (0.0, 0.0), 2000.0),
    ],
)
def test_the_kv_term_in_ms(
    case: str, need_kv_tokens: int, waited: tuple[float, float], expected_ms: float
) -> None:
    x = term_inputs(
        need_kv_tokens=need_kv_tokens,
        capacity_tokens=10_000,
        items=[SOON, LATER],
        now_s=NOW_S,
        step_ms=STEP_MS,
    )
    queue, lora_wait = waited
    assert kv_ms(x, {"queue": queue, "lora_wait": lora_wait}) == pytest.approx(expected_ms), case


def test_the_kv_term_comes_after_the_waits_it_overlaps() -> None:
    assert BUILT_IN.index("kv") > max(BUILT_IN.index("queue"), BUILT_IN.index("lora_wait"))
    assert (TERMS["kv"].ttft, TERMS["kv"].cost, TERMS["kv"].label) == (False, True, "KV wait")
