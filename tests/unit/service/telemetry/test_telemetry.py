"""The dashboard and the alerts watch metrics that exist.

Every query of the Grafana dashboard (deploy/grafana/dashboards/) and every expression of
the alerting rules (deploy/prometheus/alerts.yml) is parsed as PromQL (promql-parser, read
by tests/monitoring.py) and each `gorgo_*` selector in it checked against what the router
renders after a few lifecycle events, with the labels and values the selector matches on;
the docs list every panel and every alert. What a real `gorgo serve` and a real Envoy's
/stats/prometheus export: tests/e2e/test_telemetry_live.py; promtool on the rules and the
scrape config: tests/component/test_prometheus_rules.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.service.telemetry.gauges import FlowGauges
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router
from tests.fakes import FakeClock
from tests.monitoring import (
    DASHBOARDS,
    PROMETHEUS_CONFIG,
    _panels,
    alert_expressions,
    alert_rules,
    all_selectors,
    check_selectors,
    dashboard_expressions,
    exported,
    selectors_of,
)

ROOT = Path(__file__).resolve().parents[4]
DATASOURCES = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
OPERATIONS = ROOT / "docs/operations.md"

# Series Prometheus makes itself for every target (not the router's nor Envoy's).
PROMETHEUS_OWN = {"up"}


# -- what the router exports -------------------------------------------------------------


def drive_router() -> tuple[Router, Telemetry]:
    """A tuned router through every lifecycle its metrics count: decisions with first
    bytes and completions, a failover, a backend ejected, a fallback, tuner steps."""
    router, clock = make_router(
        "gorgo", tuner={"mode": "paired", "arm_size": 4}, routing={"eject_after_errors": 2}
    )
    telemetry = Telemetry(TelemetryConfig(), router, InMemorySpanExporter())
    router.subscribe(telemetry)
    for i in range(24):
        d = router.decide(chat(rid=f"ok-{i}", text=f"session {i % 3} says hello"))
        assert not isinstance(d, tuple)
        clock.advance(0.05)
        router.first_byte(d.request_id)
        clock.advance(0.2)
        router.close(d.request_id, Status.OK)
    d = router.decide(chat(rid="over", text="hello"))
    other = next(b for b in router.backends if b != d.backend)
    router.close(d.request_id, Status.OK, served_by=other)
    for i in range(12):  # failures in a row on one backend eject it
        d = router.decide(chat(rid=f"err-{i}", text="hello"))
        router.close(d.request_id, Status.ERROR)
        if any(b.health.ejections for b in router.backends.values()):
            break
    assert sum(b.health.ejections for b in router.backends.values()) == 1
    telemetry.fallback(next(iter(router.backends)))
    t = router.tuner
    assert t is not None and t.steps_accepted + t.steps_rejected + t.steps_tied
    return router, telemetry


def drive_flow_control() -> Telemetry:
    """A router with flow control: one request released after a wait, one still waiting,
    one refused for waiting too long."""
    from tests.unit.director.test_flow_control import busy, flow_router

    director, clock = flow_router()
    telemetry = Telemetry(TelemetryConfig(), director.router, InMemorySpanExporter())
    director.router.subscribe(telemetry)
    telemetry.metrics.registry.register(FlowGauges(director))
    busy(director)
    for rid, objective in (("late", "batch"), ("first", "interactive")):
        director.handle(replace(chat(rid=rid), objective=objective))
    clock.advance(20.5)  # "late" waited past batch's 20 s; the prefill ahead is done
    director.admission.pump()
    assert (
        director.admission.counts["released"] == 1
        and director.admission.counts["rejected-ttl-expired"] == 1
    )
    busy(director)
    director.handle(replace(chat(rid="waits"), objective="interactive"))
    assert len(director.admission.snapshot()["bands"]) == 1
    return telemetry


@pytest.fixture(scope="module")
def router_metrics() -> dict[str, list[dict[str, str]]]:
    _, telemetry = drive_router()
    # the flow-control router's metrics, with the main one's where both export a name
    return {
        **exported(drive_flow_control().metrics.render().decode()),
        **exported(telemetry.metrics.render().decode()),
    }


def _sample(telemetry: Telemetry, name: str, **labels: str) -> float:
    """One sample's value from the router's rendered metrics."""
    text = telemetry.metrics.render().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{re.escape('{' + want + '}') if want else ''} (\S+)$", text, re.M)
    assert m, f"{name}{{{want}}} not rendered"
    return float(m.group(1))


# -- the tests -------------------------------------------------------------------------


def test_the_router_exports_ejections_and_the_tuners_progress() -> None:
    router, telemetry = drive_router()
    clock = router.clock
    assert isinstance(clock, FakeClock)
    (out,) = [b for b in router.backends.values() if b.health.ejected_until_s is not None]
    assert _sample(telemetry, "gorgo_ejected", backend=out.id) == 1
    assert _sample(telemetry, "gorgo_ejections_total", backend=out.id) == out.health.ejections >= 1
    for b in router.backends.values():
        if b is not out:
            assert _sample(telemetry, "gorgo_ejected", backend=b.id) == 0
    # the ejection ends by itself: the gauge says so before any decision clears it
    assert out.health.ejected_until_s is not None
    clock.advance(out.health.ejected_until_s - clock() + 0.001)
    assert _sample(telemetry, "gorgo_ejected", backend=out.id) == 0
    assert _sample(telemetry, "gorgo_ejections_total", backend=out.id) == out.health.ejections
    # the tuner: every step it recorded, by outcome, its samples, sigma, frozen
    tuner = router.tuner
    assert tuner is not None
    history = tuner.state.history
    accepted = sum(1 for h in history if h["accepted"])
    tied = sum(1 for h in history if h["tie"])
    assert _sample(telemetry, "gorgo_tuner_steps_total", outcome="accepted") == accepted
    assert _sample(telemetry, "gorgo_tuner_steps_total", outcome="tied") == tied
    assert _sample(telemetry, "gorgo_tuner_steps_total", outcome="rejected") == (
        len(history) - accepted - tied
    )
    assert len(history) >= 2
    assert _sample(telemetry, "gorgo_tuner_samples_total") == tuner.state.samples > 0
    assert _sample(telemetry, "gorgo_tuner_sigma") == tuner.state.sigma
    assert _sample(telemetry, "gorgo_tuner_frozen") == 0
    tuner.freeze()
    assert _sample(telemetry, "gorgo_tuner_frozen") == 1
    # no tuner, no tuner metrics
    untuned, _ = make_router("gorgo")
    text = Telemetry(TelemetryConfig(), untuned).metrics.render().decode()
    assert "gorgo_tuner_" not in text and "gorgo_ejections_total{" in text


def test_every_query_and_expression_parses_and_names_a_known_source() -> None:
    selectors = all_selectors()
    assert len(dashboard_expressions()) >= 20 and len(alert_expressions()) >= 7
    for s in selectors:
        assert s.name.startswith(("gorgo_", "envoy_")) or s.name in PROMETHEUS_OWN, (
            f"{s.where}: {s.name} is neither the router's, Envoy's nor Prometheus's"
        )
    # `up` by job: the jobs prometheus.yml scrapes
    jobs = {c["job_name"] for c in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    for s in selectors:
        for label, op, value in s.matchers:
            if label == "job":
                assert op == "=" and value in jobs, f"{s.where}: job {value!r} not in {jobs}"


def test_the_router_exports_every_gorgo_metric_they_name(
    router_metrics: dict[str, list[dict[str, str]]],
) -> None:
    gorgo = [s for s in all_selectors() if s.name.startswith("gorgo_")]
    check_selectors(gorgo, router_metrics, "the router (Telemetry after lifecycle events)")


def test_the_check_catches_a_wrong_name_label_or_value(
    router_metrics: dict[str, list[dict[str, str]]],
) -> None:
    for expr, problem in (
        ("sum(rate(gorgo_decision_total[5m]))", "is not exported"),
        ('gorgo_completions_total{state="ok"}', "has no label 'state'"),
        ('gorgo_completions_total{status="failedover"}', "only ["),
        ('{__name__="gorgo_ejected_total"}', "is not exported"),
    ):
        with pytest.raises(AssertionError, match=re.escape(problem)):
            check_selectors(selectors_of("q", expr), router_metrics, "the router")
    with pytest.raises(AssertionError, match="not PromQL"):
        selectors_of("q", "sum(rate(gorgo_decisions_total[5m])")
    # a regex matcher selects nothing in particular: only its label must exist
    check_selectors(
        selectors_of("q", 'gorgo_completions_total{status=~"fail.*"}'), router_metrics, "r"
    )


def test_the_dashboard_covers_what_the_issue_asks(
    router_metrics: dict[str, list[dict[str, str]]],
) -> None:
    named = {s.name for where, e in dashboard_expressions() for s in selectors_of(where, e)}
    for metric in (
        "gorgo_decisions_total",
        "gorgo_ttft_seconds_bucket",
        "gorgo_e2e_seconds_bucket",
        "gorgo_cost_term_seconds_sum",
        "gorgo_weight",
        "gorgo_tuner_steps_total",
        "gorgo_prefix_cached_tokens_total",
        "gorgo_prompt_tokens_total",
        "gorgo_fallback_total",
        "envoy_http_ext_proc_failure_mode_allowed",
        "gorgo_completions_total",  # failovers: status failed_over
        "gorgo_ejected",
        "gorgo_ejections_total",
        "gorgo_in_flight",
    ):
        assert metric in named, f"no panel shows {metric}"


def test_dashboard_structure() -> None:
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        panels = list(_panels(dashboard))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
        for p in panels:
            if p["type"] == "row":
                continue
            assert p["title"] and p["description"], p
            assert p["datasource"]["uid"] == uid, f"{p['title']}: not the provisioned datasource"
            assert all(t["datasource"]["uid"] == uid for t in p["targets"])
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        # no two panels overlap on the 24-column grid
        cells: set[tuple[int, int]] = set()
        for p in panels:
            g = p["gridPos"]
            mine = {
                (x, y)
                for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])
            }
            assert not cells & mine, f"{path.name}: {p['title']!r} overlaps another panel"
            cells |= mine


def test_alert_rules_carry_for_severity_and_a_runbook_section() -> None:
    ops = OPERATIONS.read_text()
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", ops, re.M)
    }
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    for r in alert_rules():
        name = r["alert"]
        assert r["for"], name
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, name
        a = r["annotations"]
        assert a["summary"] and name in a["description"], name
        assert a["runbook_url"] == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/operations.md has no section {name}"
    # the docs list every alert, and every panel by its title
    for path in DASHBOARDS:
        for p in _panels(json.loads(path.read_text())):
            if p["type"] != "row":
                assert p["title"] in ops, f"docs/operations.md does not describe {p['title']!r}"


def test_latency_prediction_error_is_exported_and_each_span_has_the_prediction() -> None:
    router, clock = make_router("gorgo", backends=["a", "b"])
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    decided = []
    for i, (ttft_s, e2e_ms) in enumerate(((0.2, 900.0), (0.1, 1200.0))):
        d = router.decide(chat(rid=f"r{i}", text=f"question {i}"))
        decided.append(d)
        clock.advance(ttft_s)
        router.first_byte(d.request_id)
        router.close(d.request_id, Status.OK, e2e_ms=e2e_ms)
    served = {d.backend for d in decided}
    for b in served:
        lat = router.backends[b].learned.latency
        assert lat.ttft.mape is not None and lat.e2e.bias_ms is not None
        assert lat.ttft.bias_ms is not None and lat.e2e.mape is not None
        assert _sample(telemetry, "gorgo_ttft_prediction_mape_ratio", backend=b) == lat.ttft.mape
        assert _sample(telemetry, "gorgo_ttft_prediction_bias_seconds", backend=b) == (
            pytest.approx(lat.ttft.bias_ms / 1000)
        )
        assert _sample(telemetry, "gorgo_e2e_prediction_mape_ratio", backend=b) == lat.e2e.mape
        assert _sample(telemetry, "gorgo_e2e_prediction_bias_seconds", backend=b) == (
            pytest.approx(lat.e2e.bias_ms / 1000)
        )
    text = telemetry.metrics.render().decode()
    for b in set(router.backends) - served:  # nothing measured there: no sample, not a 0
        assert f'gorgo_ttft_prediction_mape_ratio{{backend="{b}"}}' not in text
    telemetry.shutdown()
    spans = {s.attributes["gorgo.request_id"]: s.attributes for s in exporter.get_finished_spans()}
    for d in decided:
        a = spans[d.request_id]
        assert a["gorgo.predicted_ttft_ms"] == round(d.chosen.predicted_ttft_ms, 3)
        assert a["gorgo.predicted_e2e_ms"] == round(d.chosen.predicted_e2e_ms, 3)
        assert "gorgo.ttft_ms" in a and "gorgo.e2e_ms" in a  # the measures beside them
        listed = {c["backend"]: c for c in json.loads(a["gorgo.candidates"])}
        assert set(listed) == {c.backend_id for c in d.candidates}
        for c in d.candidates:
            assert listed[c.backend_id]["predicted_ttft_ms"] == round(c.predicted_ttft_ms, 3)
            assert listed[c.backend_id]["cost"] == round(d.scores[c.backend_id], 3)


def test_models_are_on_the_span_the_decision_counter_and_a_gauge_per_backend() -> None:
    from ext_proc.feeds.served_models import ServedModels

    router, _ = make_router("gorgo", backends=["a", "b"])
    router.inputs.record_models("a", ServedModels(frozenset({"alpha"}), {"alpha-sql": "alpha"}))
    router.inputs.record_models("b", ServedModels(frozenset({"beta"})))
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    d = router.decide(chat(rid="m1", model="beta"))
    assert d.backend == "b" and d.as_json()["model"] == "beta"
    text = telemetry.metrics.render().decode()
    assert 'gorgo_backend_model{backend="a",kind="adapter",model="alpha-sql"} 1.0' in text
    assert 'gorgo_backend_model{backend="b",kind="base",model="beta"} 1.0' in text
    assert 'gorgo_decisions_total{backend="b",model="beta",policy="gorgo"} 1.0' in text
    router.close(d.request_id, Status.OK)
    telemetry.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None and span.attributes["gen_ai.request.model"] == "beta"


def test_the_genai_attributes_say_what_the_router_knows_and_no_more() -> None:
    """A streamed chat with a model and max_tokens, a completion with neither, a failed
    request: the GenAI conventions' attributes (names as the installed
    opentelemetry-semantic-conventions has them) and the chosen backend's address."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
    from opentelemetry.semconv.attributes import error_attributes, server_attributes

    from ext_proc.prompt.parse import COMPLETIONS, parse_body
    from ext_proc.service.telemetry import spans
    from ext_proc.vocab.types import RouteRequest

    assert (spans.A_OPERATION, spans.A_PROVIDER, spans.A_MODEL) == (
        gen_ai.GEN_AI_OPERATION_NAME,
        gen_ai.GEN_AI_PROVIDER_NAME,
        gen_ai.GEN_AI_REQUEST_MODEL,
    )
    assert (spans.A_MAX_TOKENS, spans.A_STREAM, spans.A_INPUT_TOKENS, spans.A_ENGINE_CACHED) == (
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS,
        gen_ai.GEN_AI_REQUEST_STREAM,
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    )
    assert (spans.A_SERVER_ADDRESS, spans.A_SERVER_PORT, spans.A_ERROR_TYPE) == (
        server_attributes.SERVER_ADDRESS,
        server_attributes.SERVER_PORT,
        error_attributes.ERROR_TYPE,
    )
    backends = [
        {"id": "v4", "address": "10.0.0.7:8000", "engine": "vllm"},
        {"id": "v6", "address": "[fd00::7]:30000", "engine": "sglang"},
    ]
    router, _ = make_router("round_robin", backends=backends)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    body = {"model": "m", "max_tokens": 7, "stream": True, "messages": [{"content": "hi"}]}
    streamed = router.decide(
        replace(chat(rid="c1"), llm=parse_body("chat", json.dumps(body).encode()))
    )
    completion = router.decide(
        RouteRequest("c2", parse_body(COMPLETIONS, b'{"prompt": "hello"}'), None)
    )
    router.close("c1", Status.OK)
    router.close("c2", Status.ERROR)
    telemetry.shutdown()
    got = {
        s.attributes["gorgo.request_id"]: dict(s.attributes) for s in exporter.get_finished_spans()
    }
    server = {"v4": ("10.0.0.7", 8000, "vllm"), "v6": ("fd00::7", 30000, "sglang")}
    for d in (streamed, completion):
        a = got[d.request_id]
        assert (a["server.address"], a["server.port"], a["gen_ai.provider.name"]) == server[
            d.backend
        ]
        assert a["gen_ai.usage.input_tokens"] == d.input_tokens
    a = got["c1"]
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("chat", "m")
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.stream"]) == (7, True)
    assert "error.type" not in a
    # a completion naming no model, no budget, not streamed: none of those said; it failed
    a = got["c2"]
    assert a["gen_ai.operation.name"] == "text_completion"
    absent = {"gen_ai.request.model", "gen_ai.request.max_tokens", "gen_ai.request.stream"}
    assert not absent & set(a) and a["error.type"] == "error" == a["gorgo.status"]


def test_flow_series_exist_from_the_start_with_flow_control_on_and_not_with_it_off() -> None:
    from ext_proc.director.recipe import Director
    from tests.unit.director.test_flow_control import flow_router

    director, _ = flow_router()
    telemetry = Telemetry(TelemetryConfig(), director.router, InMemorySpanExporter())
    telemetry.metrics.registry.register(FlowGauges(director))
    assert _sample(telemetry, "gorgo_flow_waiting", priority="10") == 0  # a configured band
    assert _sample(telemetry, "gorgo_flow_outcomes_total", outcome="rejected-slo") == 0
    off, _ = make_router("gorgo")
    telemetry = Telemetry(TelemetryConfig(), off, InMemorySpanExporter())
    telemetry.metrics.registry.register(FlowGauges(Director(off)))
    assert "gorgo_flow_waiting" not in telemetry.metrics.render().decode()


def test_the_bus_series_say_whether_the_router_runs_alone() -> None:
    from ext_proc.service.telemetry.gauges import BusGauges

    router, _ = make_router("gorgo")
    state = {"connected": True, "sent": 3, "received": 5, "dropped": 0, "malformed": 1}
    telemetry = Telemetry(TelemetryConfig(), router, InMemorySpanExporter())
    telemetry.metrics.registry.register(BusGauges(lambda: state))
    assert _sample(telemetry, "gorgo_bus_connected") == 1
    assert _sample(telemetry, "gorgo_bus_events_total", direction="received") == 5
    state["connected"] = False
    assert _sample(telemetry, "gorgo_bus_connected") == 0
    alone = Telemetry(TelemetryConfig(), router, InMemorySpanExporter())
    alone.metrics.registry.register(BusGauges(lambda: None))  # no bus.nats_url
    assert "gorgo_bus" not in alone.metrics.render().decode()


TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize(
    ("ratio", "traceparent", "exported"),
    [
        (1.0, None, True),  # a new trace, kept
        (0.0, None, False),  # a new trace, sampled out
        (0.0, f"00-{TRACE}-b7ad6b7169203331-01", True),  # Envoy sampled it: so do we
        (1.0, f"00-{TRACE}-b7ad6b7169203331-00", False),  # Envoy did not: nor do we
    ],
)
def test_spans_follow_the_sample_ratio_and_envoys_sampling_flag(
    ratio: float, traceparent: str | None, exported: bool
) -> None:
    router, _ = make_router("gorgo", backends=["a", "b"])
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(sample_ratio=ratio), router, exporter)
    router.subscribe(telemetry)
    request = chat(rid="s1")
    if traceparent is not None:
        request = replace(request, trace_context=(("traceparent", traceparent),))
    d = router.decide(request)
    router.first_byte(d.request_id)
    router.close(d.request_id, Status.ERROR, e2e_ms=12.0)
    telemetry.shutdown()
    spans = exporter.get_finished_spans()
    assert len(spans) == (1 if exported else 0)
    entry = router.recent.find("s1")
    assert entry is not None
    trace_id = entry.trace_id
    if not exported:
        assert not trace_id  # the decision log links no trace that was never sent
        return
    (span,) = spans
    a = span.attributes or {}
    assert a["gorgo.status"] == "error" and a["gorgo.e2e_ms"] == 12.0 and "gorgo.ttft_ms" in a
    assert span.status.status_code.name == "ERROR"
    assert span.end_time is not None and span.start_time is not None
    assert span.end_time >= span.start_time
    assert trace_id == f"{span.context.trace_id:032x}"
    if traceparent is not None:  # a child of Envoy's request span, in its trace
        assert span.parent is not None and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
        assert trace_id == TRACE
    else:
        assert span.parent is None


async def test_a_dispatch_is_recorded_on_the_loops_next_turn_and_before_its_close() -> None:
    router, _ = make_router("gorgo", backends=["a", "b"])
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)

    def decided() -> float:
        return sum(
            s.value
            for metric in telemetry.metrics.decisions.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        )

    first = router.decide(chat(rid="p1"))
    assert decided() == 0  # not on the request's path
    router.close(first.request_id, Status.OK, e2e_ms=5.0)  # its close records it first
    assert decided() == 1
    router.decide(chat(rid="p2"))
    await asyncio.sleep(0)  # the next turn of the loop
    assert decided() == 2
    telemetry.shutdown()
    ended = {(s.attributes or {})["gorgo.request_id"]: s for s in exporter.get_finished_spans()}
    assert (ended["p1"].attributes or {})["gorgo.status"] == "ok"
    assert (ended["p2"].attributes or {})["gorgo.status"] == "shutdown"
    assert ended["p1"].start_time is not None and ended["p1"].end_time is not None
    assert ended["p1"].start_time <= ended["p1"].end_time


def test_the_step_model_in_use_is_exported_on_state_the_gauge_and_the_page() -> None:
    from ext_proc.estimate.profile import load_profile
    from ext_proc.estimate.replay import Prompt, profile_coefficients, replay_features
    from ext_proc.service.admin.operator_page import backend_rows

    router, clock = make_router(
        "gorgo", backends=["a", "b"], routing={"ttft_model": "replay"}, timeout_s=600
    )
    telemetry = Telemetry(TelemetryConfig(), router, InMemorySpanExporter())
    router.subscribe(telemetry)
    d = router.decide(chat(rid="r0", text="question"))
    clock.advance(0.2)
    router.first_byte(d.request_id)
    router.close(d.request_id, Status.OK, e2e_ms=900.0)
    for b in ("a", "b"):  # both replayed as candidates: both fits in use
        assert _sample(telemetry, "gorgo_step_model_fit_in_use", backend=b) == 1
        assert router.snapshot()["backends"][b]["step_model"]["using"] == "fit"
    # backend a: a long stall taken for the engine's speed, then the engine as its profile
    # again; its fit is far off, the profile right: it falls back by itself
    theta = profile_coefficients(load_profile())
    fit = router.backends["a"].step_fit
    _, f = replay_features("sglang", 4096, [Prompt(3000, 0)], Prompt(2000, 0), 4, 8000)
    for i in range(140):
        fit.observe(f, (10.0 if i < 100 else 1.0) * float(theta @ f))
    assert _sample(telemetry, "gorgo_step_model_fit_in_use", backend="a") == 0
    assert _sample(telemetry, "gorgo_step_model_fit_in_use", backend="b") == 1
    state = router.snapshot()
    shown = state["backends"]["a"]["step_model"]
    assert shown["using"] == "profile" and shown["fallbacks"] == 1
    assert shown["why"].startswith("fell back to the profile")
    assert shown["fit_mape"] > shown["profile_mape"]
    rows = {r["id"]: r for r in backend_rows(router, state)}
    assert rows["a"]["step_model"] == "profile" and rows["b"]["step_model"] == "fit"
    assert rows["a"]["step_model_why"] == shown["why"]


def test_without_the_replay_no_step_model_is_shown() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    telemetry = Telemetry(TelemetryConfig(), router, InMemorySpanExporter())
    router.decide(chat(rid="r0", text="question"))
    assert "gorgo_step_model_fit_in_use{" not in telemetry.metrics.render().decode()
    assert router.snapshot()["backends"]["a"]["step_model"] is None
