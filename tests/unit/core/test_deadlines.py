"""A request the router can no longer hear of ends anyway: at a deadline from its predicted
E2E, when its Envoy goes away, when the engine's own report denies it, or when its backend
lets its first-byte deadline pass (and the backend is then suspect)."""

import pytest

from ext_proc.core.features import credible_records
from ext_proc.core.state import LOST_AFTER_E2E_FACTOR, LOST_AFTER_FLOOR_S
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.vocab.types import RouteRequest, Status
from tests.builders import chat, make_router


def test_a_lost_completion_ends_at_a_deadline_from_its_predicted_e2e() -> None:
    router, clock = make_router("gorgo", timeout_s=900.0, backends=["a"])
    d = router.decide(chat(rid="r1"))
    predicted_s = d.chosen.predicted_e2e_ms / 1000
    due_s = LOST_AFTER_E2E_FACTOR * predicted_s + LOST_AFTER_FLOOR_S
    assert due_s < 900.0
    clock.advance(due_s - 0.1)
    assert router.expire() == []
    clock.advance(0.2)
    (closed,) = router.expire()
    assert (closed.request_id, closed.status) == ("r1", Status.EXPIRED)
    b = router.backends["a"]
    assert (b.load.in_flight, b.stats.errors, b.stats.lost) == (
        0,
        0,
        1,
    )  # not the backend's failure


def test_requests_of_a_gone_envoy_are_lost_and_others_stay() -> None:
    router, _ = make_router(backends=["a", "b"])
    for rid, envoy in (("x1", "edge-1"), ("x2", "edge-1"), ("y1", "edge-2"), ("z1", "")):
        router.decide(RouteRequest(rid, chat().llm, None, envoy=envoy))
    lost = router.lose({"edge-1"})
    assert sorted(c.request_id for c in lost) == ["x1", "x2"]
    assert {c.status for c in lost} == {Status.LOST}
    assert set(router.in_flight) == {"y1", "z1"}
    assert sum(b.stats.errors for b in router.backends.values()) == 0


def test_an_engine_that_reports_nothing_running_denies_the_routers_old_records() -> None:
    """Envoy went away without a word while 8 streams decoded: the engine's own report
    (0 waiting, 0 running) bounds the load the router believes in. A request still
    waiting for its first token is kept whatever the report (a stall looks like that)."""
    router, clock = make_router("gorgo", backends=["a"])
    for i in range(8):
        router.decide(chat("long prompt " * 400, rid=f"p{i}"))
        router.first_byte(f"p{i}")
    a = router.backends["a"]
    clock.advance(5.0)
    router.inputs.record_engine_report("a", EngineReport(waiting=0, running=0, kv_usage=0.0))
    assert credible_records(a, a.engine.report) == []
    router.decide(chat("long prompt " * 400, rid="waiting"))
    clock.advance(1.0)
    router.inputs.record_engine_report("a", EngineReport(waiting=0, running=3, kv_usage=0.1))
    kept = credible_records(a, a.engine.report)
    assert [r.request_id for r in kept] == ["p5", "p6", "p7", "waiting"]


def test_a_missed_first_byte_deadline_makes_the_backend_suspect_once() -> None:
    router, clock = make_router("gorgo", backends=["a", "b"])
    d = router.decide(chat(rid="r1"))
    deadline_ms = d.first_byte_deadline_ms
    assert deadline_ms == pytest.approx(4.0 * d.chosen.predicted_ttft_ms + 5000.0)
    b = router.backends[d.backend]
    clock.advance(deadline_ms / 1000 - 0.01)
    router.expire()
    assert not b.health.suspect
    clock.advance(0.02)
    router.expire()
    assert b.health.suspect
    router.inputs.record_probe(d.backend, 5.0)  # its probe answers: the link is there
    router.expire()
    assert not b.health.suspect  # the missed deadline counted once


def test_a_non_streamed_request_gets_its_predicted_e2e_as_deadline() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    d = router.decide(chat(rid="r1", stream=False))
    assert d.first_byte_deadline_ms == pytest.approx(4.0 * d.chosen.predicted_e2e_ms + 5000.0)


def test_deadlines_off_and_under_the_route_timeout() -> None:
    off, _ = make_router(
        "gorgo", backends=["a"], routing={"first_byte_factor": 0, "first_byte_slack_ms": 0}
    )
    assert off.decide(chat(rid="r1")).first_byte_deadline_ms is None
    capped, _ = make_router(
        "gorgo", backends=["a"], routing={"first_byte_slack_ms": 10_000_000}, envoy={}
    )
    assert capped.decide(chat(rid="r1")).first_byte_deadline_ms == 600_000 - 1


def test_one_failed_probe_is_enough_when_a_first_byte_is_late_there() -> None:
    router, clock = make_router("gorgo", backends=["a", "b"])
    router.inputs.record_probe("a", None)
    assert not router.backends["a"].health.suspect  # probes alone need suspect_after (2)
    router.inputs.record_probe("a", 1.0)
    d = router.decide(chat(rid="r1"))
    clock.advance((d.chosen.predicted_ttft_ms + 500.0) / 1000 + 0.01)  # past due + grace
    assert router.inputs.late_backends() == {d.backend}
    router.inputs.record_probe(d.backend, None)
    assert router.backends[d.backend].health.suspect


def test_ejected_reads_false_once_the_ejection_is_over() -> None:
    router, clock = make_router("gorgo", backends=["a"], routing={"eject_s": 5.0})
    for i in range(2):
        d = router.decide(chat(rid=f"e{i}"))
        router.close(d.request_id, Status.ERROR, reason="503 UF")
    b = router.backends[d.backend]
    now = router.snapshot()["backends"][d.backend]
    assert now["ejected"] and now["ejected_for"] == ["503 UF", "503 UF"]
    clock.advance(5.1)  # no decision since: the state says it is back all the same
    later = router.snapshot()["backends"][d.backend]
    assert not later["ejected"] and later["ejected_for"] == []
    assert b.stats.errors == 2
