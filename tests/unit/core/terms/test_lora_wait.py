"""The LoRA-wait term: a request for an adapter that is neither running nor waiting on an
engine whose `max_lora` slots are all taken waits at least until the soonest request in
flight there finishes; 0 otherwise."""

from dataclasses import dataclass

import pytest

from ext_proc.core.terms.catalog import TERMS
from ext_proc.core.terms.lora_wait import lora_wait_ms
from ext_proc.estimate.cost import QueueItem
from ext_proc.feeds.engine_metrics import EngineReport
from tests.builders import term_inputs

NOW_S, STEP_MS = 100.0, 20.0
# Waiting for its first token: its 300 ms prefill and 10 tokens of 20 ms = 500 ms.
QUEUED = QueueItem(300.0, 1000, 10, dispatched_s=NOW_S, first_byte_s=None)
# Decoding: 100 of its 105 tokens done, 5 of 20 ms left = 100 ms.
DECODING = QueueItem(0.0, 1000, 105, dispatched_s=0.0, first_byte_s=NOW_S - 100 * 0.02)
# Two slots, both taken by other adapters.
FULL = EngineReport(1, 2, 0.5, adapters=frozenset({"sql", "chat"}), max_lora=2)


@dataclass(frozen=True)
class Case:
    name: str
    expected_ms: float
    model: str | None = "summarize"
    adapter: bool = True
    report: EngineReport | None = FULL
    items: tuple[QueueItem, ...] = (QUEUED, DECODING)


CASES = [
    Case("every slot taken by another adapter: the soonest to finish", 100.0),
    Case("only the queued one there: its prefill and decode", 500.0, items=(QUEUED,)),
    Case("its adapter already there", 0.0, model="sql"),
    Case(
        "a slot free",
        0.0,
        report=EngineReport(1, 2, 0.5, adapters=frozenset({"sql"}), max_lora=2),
    ),
    Case("a base model, not an adapter", 0.0, adapter=False),
    Case("no model named", 0.0, model=None),
    Case("no engine report", 0.0, report=None),
    Case("an engine without LoRA gauges", 0.0, report=EngineReport(1, 2, 0.5)),
    Case("nothing in flight to wait for", 0.0, items=()),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_lora_wait_term_in_ms(case: Case) -> None:
    x = term_inputs(
        model=case.model,
        adapter=case.adapter,
        report=case.report,
        items=list(case.items),
        now_s=NOW_S,
        step_ms=STEP_MS,
    )
    assert lora_wait_ms(x, {}) == pytest.approx(case.expected_ms)


def test_the_lora_wait_term_is_part_of_the_ttft() -> None:
    info = TERMS["lora_wait"]
    assert (info.ttft, info.cost, info.label) == (True, True, "LoRA slot")
