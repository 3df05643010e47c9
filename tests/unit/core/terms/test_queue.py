"""The queue term: the wait before the request's own prefill starts there. The prefill
still owed to the requests ahead (the oldest credited with the time since it arrived, less
the way there), half a decode step when some are decoding, lateness past the stall grace,
and at least the engine's own count of requests waiting, priced at the mean prefill sent
there plus what was sent since that count."""

from dataclasses import dataclass, field

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.queue import queue_term_ms
from ext_proc.estimate.cost import QueueItem
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.vocab.types import InFlight
from tests.builders import backend_state, term_inputs

# Two requests waiting for their first token, dispatched 50 ms apart, owing 400 and 300 ms
# of prefill; a decoding one; the decode step is 20 ms and the backend 10 ms away (5 ms
# each way).
HEAD = QueueItem(400.0, 1000, 100, dispatched_s=10.0, first_byte_s=None)
NEXT = QueueItem(300.0, 1000, 100, dispatched_s=10.05, first_byte_s=None)
DECODING = QueueItem(0.0, 1000, 100, dispatched_s=9.0, first_byte_s=9.5)
# Due 100 ms after its dispatch at 10.0, still no first token.
LATE = QueueItem(100.0, 1000, 100, dispatched_s=10.0, first_byte_s=None, due_s=10.1)


@dataclass(frozen=True)
class Case:
    name: str
    now_s: float
    items: tuple[QueueItem, ...]
    expected_ms: float
    grace_ms: float = 0.0
    # The engine's report: requests waiting, read at report_at_s.
    waiting: float | None = None
    report_at_s: float | None = None
    # This router's own records there: (dispatched_s, prefill_ms, first_byte_s).
    records: tuple[tuple[float, float, float | None], ...] = field(default=())


CASES = [
    Case("idle", 10.0, (), 0.0),
    Case("one just arrived: its whole prefill", 10.005, (HEAD,), 400.0),
    # 105 ms since the head's dispatch, 5 of them on the way: 100 ms of it done
    Case("the head is credited with the time it ran", 10.105, (HEAD, NEXT), 300.0 + 300.0),
    Case("half a decode step when some decode", 10.105, (HEAD, NEXT, DECODING), 610.0),
    Case("a head long past its prefill owes nothing", 30.0, (HEAD, NEXT), 300.0),
    # 2.5 s past due, 500 ms of it within the grace (its own 100 ms estimate is less)
    Case("lateness past the grace", 12.6, (LATE,), 2000.0, grace_ms=500.0),
    Case("no grace: lateness ignored", 12.6, (LATE,), 0.0),
    # 3 waiting x the 100 ms mean prefill, + 150 ms sent since the report (not the 999 ms
    # sent before it, nor the 70 ms of a request already past its first token)
    Case(
        "the engine's own count of requests waiting",
        10.0,
        (),
        450.0,
        waiting=3,
        report_at_s=9.0,
        records=((8.0, 999.0, None), (9.5, 150.0, None), (9.6, 70.0, 9.8)),
    ),
    Case(
        "the engine's count when less than the router's own",
        10.105,
        (HEAD, NEXT),
        600.0,
        waiting=1,
        report_at_s=9.0,
    ),
    Case("a report without a waiting count", 10.0, (), 0.0, waiting=None, report_at_s=9.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_queue_term_in_ms(case: Case) -> None:
    b = backend_state(rtt_ms=10.0)
    report = None
    if case.report_at_s is not None:
        report = EngineReport(case.waiting, 1, 0.1)
        b.engine.report, b.engine.report_at_s = report, case.report_at_s
    for i, (dispatched_s, prefill_ms, first_byte_s) in enumerate(case.records):
        b.load.records[f"r{i}"] = InFlight(
            f"r{i}", "a", dispatched_s, 1000, prefill_ms=prefill_ms, first_byte_s=first_byte_s
        )
    x = term_inputs(
        b,
        input_tokens=1000,
        now_s=case.now_s,
        items=list(case.items),
        step_ms=20.0,
        report=report,
        stall_grace_ms=case.grace_ms,
    )
    assert queue_term_ms(x, {}) == pytest.approx(case.expected_ms)


def test_a_full_kv_pool_makes_the_queue_at_least_the_wait_for_the_first_finisher() -> None:
    # two decoding requests hold 4,000 tokens each of the 10,000-token pool; 3,000 more
    # wait for the first to finish: 10 tokens of 20 ms left
    soon = QueueItem(0.0, 4000, 500, dispatched_s=0.0, first_byte_s=100.0 - 490 * 0.02)
    later = QueueItem(0.0, 4000, 500, dispatched_s=0.0, first_byte_s=100.0 - 100 * 0.02)
    x = term_inputs(input_tokens=3000, now_s=100.0, items=[soon, later], step_ms=20.0)
    assert queue_term_ms(x, {}) == pytest.approx(200.0)
    fits = term_inputs(input_tokens=1000, now_s=100.0, items=[soon, later], step_ms=20.0)
    assert queue_term_ms(fits, {}) == pytest.approx(10.0)  # half a step: no KV wait


def test_the_queue_term_is_part_of_the_ttft() -> None:
    assert (TERMS["queue"].ttft, TERMS["queue"].cost) == (True, True)
