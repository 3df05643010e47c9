"""The decision log behind /state and the operator's page: bounded, each entry's outcome
and trace attached by request id, and a change sequence a poller reads increments by."""

from __future__ import annotations

import pytest

from ext_proc.core.decision_log import DecisionLog
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router


def test_the_log_keeps_the_newest_decisions_and_their_outcomes_only() -> None:
    router, clock = make_router("gorgo", backends=["a", "b"])
    log = DecisionLog(3)
    router.subscribe(log)
    for i in range(5):
        d = router.decide(chat(rid=f"r{i}"))
        log.add(d, clock())
    assert [d.request_id for d in log.decisions] == ["r2", "r3", "r4"]
    router.close("r0", Status.OK)  # evicted: nothing kept for it
    assert log.find("r0") is None and len(log) == 3
    router.close("r3", Status.ERROR)
    entry = log.find("r3")
    assert entry is not None and entry.observed is not None
    assert entry.observed["status"] == "error"


def test_changed_since_returns_new_decisions_and_new_outcomes() -> None:
    router, clock = make_router("gorgo", backends=["a"])
    log = router.recent
    router.decide(chat(rid="x"))
    router.decide(chat(rid="y"))
    seen = log.seq
    assert log.changed_since(seen) == []
    clock.advance(0.25)
    router.first_byte("x")
    router.close("x", Status.OK)
    router.decide(chat(rid="z"))
    changed = log.changed_since(seen)
    assert [e.decision.request_id for e in changed] == ["x", "z"]
    assert changed[0].observed == {"status": "ok", "ttft_ms": 250.0, "e2e_ms": 250.0}
    assert changed[1].observed is None and changed[1].at_s == clock()
    assert [e.decision.request_id for e in log.changed_since(0)] == ["x", "y", "z"]


def test_a_reused_request_id_shows_its_newest_decision_and_a_trace_attaches() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    log = router.recent
    router.decide(chat(rid="same"))
    router.close("same", Status.OK)
    router.decide(chat(rid="same"))
    log.set_trace("same", "ab" * 16)
    log.set_trace("gone", "cd" * 16)  # unknown: ignored
    first, second = log.changed_since(0)
    assert first.observed is not None and first.trace_id is None
    assert second.observed is None and second.trace_id == "ab" * 16


def test_the_router_log_holds_the_configured_number() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    assert router.recent.size == router.cfg.telemetry.recent_decisions == 1000
    with pytest.raises(ValueError, match="at least 1"):
        DecisionLog(0)
