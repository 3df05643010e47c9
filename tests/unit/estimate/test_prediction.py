"""How right the prefix state was: each request's prediction error, by where the prediction
came from (the engine's KV events or the router's own index), on spans, metrics and /state."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.estimate.prediction import PredictionStats, prediction_error
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.kv_events import EventBatch
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.service.telemetry.spans import (
    A_ENGINE_CACHED,
    A_ENGINE_REPORT_AGE_S,
    A_KV_EVENT_AGE_S,
    A_KV_EVENT_GAPS,
    A_PREDICTED_CACHED,
    A_PREDICTION_ERROR_RATIO,
    A_PREDICTION_ERROR_TOKENS,
    A_PREFIX_STATE,
)
from ext_proc.vocab.events import Closed, Listener
from ext_proc.vocab.types import PrefixState, Status
from tests.builders import chat, make_router
from tests.fakes import FakeClock

PROMPT = "a long shared document " * 200


def one_backend() -> tuple[Router, FakeClock, Telemetry, InMemorySpanExporter]:
    """One backend whose engine publishes KV events (its stream starts down)."""
    backends = [{"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}]
    router, clock = make_router("gorgo", backends=backends)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    return router, clock, telemetry, exporter


def ratio_samples(t: Telemetry, state: str) -> tuple[float | None, float | None]:
    labels = {"backend": "a", "prefix_state": state}
    reg = t.metrics.registry
    return (
        reg.get_sample_value("gorgo_prefix_prediction_error_ratio_count", labels),
        reg.get_sample_value("gorgo_prefix_prediction_error_ratio_sum", labels),
    )


def test_each_requests_error_is_recorded_under_the_state_it_came_from() -> None:
    router, clock, telemetry, exporter = one_backend()
    # approximate: the first request dispatched puts the prompt in the router's own index,
    # so the second predicts it cached; the engine says it had none of it
    first = router.decide(chat(PROMPT))
    router.close(first.request_id, Status.OK, cached_tokens=0)
    second = router.decide(chat(PROMPT))
    predicted = second.chosen.cached_tokens
    assert predicted > 0 and router.in_flight[second.request_id].prefix_state == "approximate"
    router.close(second.request_id, Status.OK, cached_tokens=0)
    # precise: the engine's events (none: it holds nothing) once the optimistic window is
    # over; the engine reports 64 tokens cached
    router.inputs.set_event_stream("a", True)
    clock.advance(router.cfg.routing.optimistic_ttl_s + 1)
    third = router.decide(chat(PROMPT))
    assert third.chosen.cached_tokens == 0
    assert router.in_flight[third.request_id].prefix_state == PrefixState.PRECISE
    router.close(third.request_id, Status.OK, cached_tokens=64)
    # says nothing: no report, or not served
    for status, cached in ((Status.OK, None), (Status.ERROR, 0)):
        router.close(router.decide(chat(PROMPT)).request_id, status, cached_tokens=cached)

    n = second.input_tokens
    assert ratio_samples(telemetry, "approximate") == (2, pytest.approx(predicted / n))
    assert ratio_samples(telemetry, "precise") == (1, pytest.approx(64 / n))
    assert router.snapshot()["backends"]["a"]["prefix_prediction"] == {
        "precise": {"requests": 1, "mean_error_ratio": round(64 / n, 6)},
        "approximate": {"requests": 2, "mean_error_ratio": round(predicted / n / 2, 6)},
    }

    telemetry.shutdown()
    spans = {s.attributes["gorgo.request_id"]: s.attributes for s in exporter.get_finished_spans()}
    s2, s3 = spans[second.request_id], spans[third.request_id]
    assert (s2[A_PREFIX_STATE], s2[A_PREDICTED_CACHED]) == ("approximate", predicted)
    assert (s2[A_ENGINE_CACHED], s2[A_PREDICTION_ERROR_TOKENS]) == (0, predicted)
    assert s2[A_PREDICTION_ERROR_RATIO] == pytest.approx(predicted / n, abs=1e-6)
    assert (s3[A_PREFIX_STATE], s3[A_PREDICTED_CACHED], s3[A_ENGINE_CACHED]) == ("precise", 0, 64)
    assert s3[A_PREDICTION_ERROR_TOKENS] == -64  # the router believed less than there was
    unknown = [a for a in spans.values() if A_ENGINE_CACHED not in a]
    assert len(unknown) == 2 and all(A_PREDICTION_ERROR_RATIO not in a for a in unknown)


def test_event_lag_and_load_report_age_on_state_spans_and_metrics() -> None:
    router, clock, telemetry, exporter = one_backend()
    router.inputs.apply_kv_events("a", EventBatch("", 0, time.time() - 5.0, (), 0))
    router.inputs.record_engine_report("a", EngineReport(0, 1, 0.1))
    clock.advance(2.0)
    kv = router.snapshot()["backends"]["a"]["kv_events"]
    assert kv["age_s"] == pytest.approx(5.0, abs=1.0) and kv["gaps"] == 0
    reg = telemetry.metrics.registry
    assert reg.get_sample_value("gorgo_engine_report_age_seconds", {"backend": "a"}) == 2.0
    age = reg.get_sample_value("gorgo_kv_event_age_seconds", {"backend": "a"})
    assert age == pytest.approx(5.0, abs=1.0)
    d = router.decide(chat(PROMPT))
    router.close(d.request_id, Status.OK)
    telemetry.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes[A_KV_EVENT_AGE_S] == pytest.approx(5.0, abs=1.0)
    assert span.attributes[A_KV_EVENT_GAPS] == 0
    assert span.attributes[A_ENGINE_REPORT_AGE_S] == 2.0


class Closes(Listener):
    def __init__(self) -> None:
        self.events: list[Closed] = []

    def on_close(self, e: Closed) -> None:
        self.events.append(e)


def test_state_keeps_a_window_of_recent_errors() -> None:
    router, _, telemetry, _ = one_backend()
    closes = Closes()
    router.subscribe(closes)
    for cached in (0, 0, 0):  # the index predicts more each time; the engine has nothing
        router.close(router.decide(chat(PROMPT)).request_id, Status.OK, cached_tokens=cached)
    count, total = ratio_samples(telemetry, "approximate")
    telemetry.shutdown()
    assert count == 3 and total is not None
    # The backend's own figures: all three are within its window.
    assert router.backends["a"].learned.prediction.as_json() == {
        "approximate": {"requests": 3, "mean_error_ratio": round(total / 3, 6)}
    }
    # A window of two keeps the two latest, the largest errors.
    stats = PredictionStats(window=2)
    for e in closes.events:
        err = prediction_error(e)
        assert err is not None
        stats.add(e.record.prefix_state, err)
    got = stats.as_json()["approximate"]
    assert got["requests"] == 3 and got["mean_error_ratio"] > total / 3
