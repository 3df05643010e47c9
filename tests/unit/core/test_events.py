"""One request lifecycle: every way a request ends goes through one closing path, and
every listener (learners, telemetry) hears it exactly once."""

import random

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.build import build_router
from ext_proc.core.router import Router
from ext_proc.learn.settings import TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.policy.catalog import make_policy
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.events import Closed, Dispatched, FirstByte, Listener
from ext_proc.vocab.types import Status, Weights
from tests.builders import chat, make_config, make_router
from tests.fakes import FakeClock


class Recorder(Listener):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    def on_dispatch(self, e: Dispatched) -> None:
        self.events.append(("dispatch", e.request.request_id, e.decision.backend))

    def on_first_byte(self, e: FirstByte) -> None:
        self.events.append(("first_byte", e.request_id, e.ttft_ms))

    def on_close(self, e: Closed) -> None:
        self.events.append(("close", e.request_id, e.status))


EXPORTER = InMemorySpanExporter()


def tuned_router(timeout_s: float = 60.0) -> tuple[Router, FakeClock, Telemetry]:
    router, clock = make_router("gorgo", timeout_s, tuner={"mode": "paired", "arm_size": 8})
    EXPORTER.clear()
    telemetry = Telemetry(TelemetryConfig(), router, EXPORTER)
    router.subscribe(telemetry)
    return router, clock, telemetry


@pytest.mark.parametrize(
    "waves",
    [10, pytest.param(50, marks=pytest.mark.long)],  # 2,000 in `make test`, 10,000 long
)
def test_thousands_of_expired_requests_leave_every_table_empty(waves: int) -> None:
    """In waves of 200 (each decision prices every request in flight, so one wave of
    thousands would only make the test slow): nothing accumulates across waves."""
    n = waves * 200
    router, clock, telemetry = tuned_router(timeout_s=10.0)
    assert router.tuner is not None
    assert telemetry.provider is not None
    expired = []

    def ended_spans() -> int:
        telemetry.provider.force_flush()  # type: ignore[union-attr]
        return len(EXPORTER.get_finished_spans())

    for wave in range(waves):
        for i in range(200):
            router.decide(chat(f"prompt {i % 50}"))
        assert router.tuner.snapshot()["requests_in_flight"] == 200
        assert ended_spans() == wave * 200  # this wave's 200 spans are open
        clock.advance(10.0)
        expired += router.expire()
    assert len(expired) == n and {c.status for c in expired} == {Status.EXPIRED}
    assert not router.in_flight
    for b in router.backends.values():
        assert (
            b.load.records,
            b.load.in_flight,
            b.load.waiting_first_byte,
            b.load.in_flight_tokens,
        ) == ({}, 0, 0, 0)
        assert router.features.queue_estimate_ms(b.id, clock()) == 0
    assert router.tuner.snapshot()["requests_in_flight"] == 0  # the arm table does not grow forever
    assert ended_spans() == n  # every span ended
    # ...and the expired requests counted against the arms that routed them
    # (or, decided by weights a finished round had replaced, were left out of the next)
    t = router.tuner
    assert t.state.samples + t.stale_samples == n and t.stale_samples < t.state.samples
    counts = telemetry.metrics.completions.labels
    assert sum(counts(b, "expired")._value.get() for b in router.backends) == n


@pytest.mark.parametrize(
    ("how", "status"),
    [
        ("ok", Status.OK),
        ("error", Status.ERROR),
        ("client_error", Status.CLIENT_ERROR),
        ("cancelled", Status.CANCELLED),
        ("expired", Status.EXPIRED),
        ("failed_over", Status.FAILED_OVER),
    ],
)
def test_every_ending_reaches_every_listener_once(how: str, status: Status) -> None:
    router, clock, _ = tuned_router(timeout_s=5.0)
    rec = Recorder()
    router.subscribe(rec)
    d = router.decide(chat("hello"))
    clock.advance(0.2)
    first = router.first_byte(d.request_id)
    assert isinstance(first, FirstByte) and first.backend == d.backend
    assert first.ttft_ms == pytest.approx(200.0)
    clock.advance(6.0)
    if how == "expired":
        router.expire()
    elif how == "failed_over":
        other = next(b for b in router.backends if b != d.backend)
        router.close(d.request_id, Status.OK, served_by=other)
    else:
        router.close(d.request_id, Status(how))
    router.close(d.request_id, Status.OK)  # a second close is a no-op
    router.expire()
    assert rec.events == [
        ("dispatch", d.request_id, d.backend),
        ("first_byte", d.request_id, pytest.approx(200.0)),
        ("close", d.request_id, status),
    ]
    assert router.tuner is not None and router.tuner.snapshot()["requests_in_flight"] == 0
    # what a failure says about the weights: errors count against the arm, the client's
    # own doing (cancelled, 4xx) does not
    counted = status not in (Status.CANCELLED, Status.CLIENT_ERROR)
    assert router.tuner.state.samples == (1 if counted else 0)


def test_a_tuner_needs_a_weighted_policy() -> None:
    cfg = make_config("least_request")
    tuner = Tuner(TunerSettings(), Weights(1, 1), random.Random(0))
    with pytest.raises(ValueError, match="has no weights to tune"):
        Router(cfg, FakeClock(), make_policy("least_request", random.Random(0)), None, tuner)
    # the factory builds no tuner for it, whatever the tuner mode
    paired = make_config("least_request", tuner={"mode": "paired"})
    assert build_router(paired, FakeClock(), random.Random(0)).tuner is None
