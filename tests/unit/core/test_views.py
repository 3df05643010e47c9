"""What /state shows of the recent decisions: each candidate's predicted TTFT and E2E,
the chosen one's, and once its request closed what came; bounded to the decisions shown."""

from __future__ import annotations

from ext_proc.core.views import STATE_DECISIONS as RECENT_DECISIONS
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router


def test_a_recent_decision_shows_its_prediction_and_once_closed_what_came() -> None:
    router, clock = make_router("gorgo", backends=["a", "b"])
    d = router.decide(chat("a question", rid="r1"))
    router.decide(chat("not streamed", rid="r2", stream=False))
    (shown, other) = router.snapshot()["recent_decisions"]
    for c in shown["candidates"]:
        assert {"predicted_ttft_ms", "predicted_e2e_ms", "decode_ms"} <= set(c)
    assert shown["predicted_ttft_ms"] == round(d.chosen.predicted_ttft_ms, 3)
    assert shown["predicted_e2e_ms"] == round(d.chosen.predicted_e2e_ms, 3)
    assert shown["observed"] is None and other["observed"] is None  # still in flight
    clock.advance(0.2)
    router.first_byte("r1")
    router.first_byte("r2")
    clock.advance(0.3)
    router.close("r1", Status.OK)
    router.close("r2", Status.OK)
    (shown, other) = router.snapshot()["recent_decisions"]
    assert shown["observed"] == {"status": "ok", "ttft_ms": 200.0, "e2e_ms": 500.0}
    # without a stream the first byte is the whole answer: no TTFT was measured
    assert other["observed"] == {"status": "ok", "ttft_ms": None, "e2e_ms": 500.0}


def test_outcomes_are_kept_only_for_the_decisions_shown() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    for i in range(RECENT_DECISIONS + 3):
        router.close(router.decide(chat(rid=f"r{i}")).request_id, Status.ERROR)
    shown = router.snapshot()["recent_decisions"]
    assert [d["request_id"] for d in shown] == [f"r{i}" for i in range(3, RECENT_DECISIONS + 3)]
    assert all(d["observed"]["status"] == "error" for d in shown)
    # a close of a decision no longer shown leaves nothing behind
    router.decide(chat(rid="late"))
    router.close("r0", Status.OK)
    assert [d["observed"] for d in router.snapshot()["recent_decisions"]][-1] is None
