"""The dashboard and the alerts watch metrics that exist.

Every query of the Grafana dashboard (deploy/grafana/dashboards/) and every expression of
the alerting rules (deploy/prometheus/alerts.yml) is parsed as PromQL (promql-parser) and
each metric selector in it checked: a `gorgo_*` name against what the router renders after
a few lifecycle events (and what a real `gorgo serve` exports), an `envoy_*` name against
a real Envoy's /stats/prometheus, run from `gorgo envoy-config`'s bootstrap, with the
labels and values the selector matches on. With promtool installed (Debian's `prometheus`
package), the rules and the scrape config are checked by it and the rules' unit tests
(deploy/prometheus/alerts-test.yml) run; the docs list every panel and every alert.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from emulator.engine import EngineServer
from emulator.engine_config import EngineConfig
from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config, TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.core.types import Status
from ext_proc.envoy.bootstrap import render_envoy_config
from ext_proc.service.app import running_service
from ext_proc.service.telemetry import Telemetry
from tests.builders import chat, make_router
from tests.fakes import FakeClock

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
ALERTS_TEST = ROOT / "deploy/prometheus/alerts-test.yml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
DATASOURCES = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
OPERATIONS = ROOT / "docs/operations.md"

# Series Prometheus makes itself for every target (not the router's nor Envoy's).
PROMETHEUS_OWN = {"up"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
# Grafana's variables, replaced as Grafana would before the query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "10s",
    "$__range": "1h",
    "$backend": ".*",
}


# -- the expressions ----------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    where: str
    name: str
    # (label, "=", value) for equality matchers; other ops keep their value for the record.
    matchers: tuple[tuple[str, str, str], ...]


def _expand(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def selectors_of(where: str, expr: str) -> list[Selector]:
    """Every metric selector of a PromQL expression (it must parse)."""
    try:
        ast = promql_parser.parse(_expand(expr))
    except ValueError as e:
        raise AssertionError(f"{where}: not PromQL: {e}\n{expr}") from e
    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = []
            name = node.name
            for m in node.matchers.matchers:
                op = {"MatchOp.Equal": "="}.get(str(m.op), str(m.op))
                if m.name == "__name__":
                    name = name or m.value
                else:
                    matchers.append((m.name, op, m.value))
            assert name, f"{where}: a selector without a metric name: {expr}"
            found.append(Selector(where, name, tuple(matchers)))

    promql_parser.walk(ast, visit)
    assert found, f"{where}: names no metric: {expr}"
    return found


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def dashboard_expressions() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for p in _panels(dashboard):
            for t in p.get("targets", []):
                out.append((f"{path.name}: panel {p['title']!r} {t['refId']}", t["expr"]))
        for v in dashboard.get("templating", {}).get("list", []):
            if v["type"] == "query":  # Grafana's label_values(metric, label): the metric
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["definition"])
                assert m, f"{path.name}: variable {v['name']}: {v['definition']}"
                out.append((f"{path.name}: variable {v['name']}", m.group(1)))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alert_expressions() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def all_selectors() -> list[Selector]:
    return [
        s for where, expr in dashboard_expressions() + alert_expressions()
        for s in selectors_of(where, expr)
    ]  # fmt: skip


# -- what the metrics endpoints export -----------------------------------------------------


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def exported(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets of its samples, from a Prometheus text exposition,
    named as Prometheus stores them (prometheus_client's parser would add `_total` to
    Envoy's counters, which Prometheus does not)."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        out.setdefault(m.group(1), []).append(dict(_LABEL.findall(m.group(2) or "")))
    return out


def check_selectors(
    selectors: list[Selector], names: dict[str, list[dict[str, str]]], source: str
) -> None:
    """Each selector names a sample the source exports, and each label it matches on with
    `=` is on such a sample with that value (job and instance come from Prometheus)."""
    problems = []
    for s in selectors:
        samples = names.get(s.name)
        if samples is None:
            problems.append(f"{s.where}: {s.name} is not exported by {source}")
            continue
        for label, op, value in s.matchers:
            if label in TARGET_LABELS:
                continue
            if not any(label in labels for labels in samples):
                problems.append(f"{s.where}: {s.name} has no label {label!r} ({source})")
            elif op == "=" and not any(labels.get(label) == value for labels in samples):
                seen = sorted({labels.get(label, "") for labels in samples})
                problems.append(f"{s.where}: {s.name}{{{label}={value!r}}}: only {seen}")
    assert not problems, "\n".join(problems)


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
        if any(b.ejections for b in router.backends.values()):
            break
    assert sum(b.ejections for b in router.backends.values()) == 1
    telemetry.fallback(next(iter(router.backends)))
    assert router.tuner is not None and router.tuner.steps_accepted + router.tuner.steps_rejected
    return router, telemetry


@pytest.fixture(scope="module")
def router_metrics() -> dict[str, list[dict[str, str]]]:
    _, telemetry = drive_router()
    return exported(telemetry.metrics.render().decode())


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
    (out,) = [b for b in router.backends.values() if b.ejected_until_s is not None]
    assert _sample(telemetry, "gorgo_ejected", backend=out.id) == 1
    assert _sample(telemetry, "gorgo_ejections_total", backend=out.id) == out.ejections >= 1
    for b in router.backends.values():
        if b is not out:
            assert _sample(telemetry, "gorgo_ejected", backend=b.id) == 0
    # the ejection ends by itself: the gauge says so before any decision clears it
    assert out.ejected_until_s is not None
    clock.advance(out.ejected_until_s - clock() + 0.001)
    assert _sample(telemetry, "gorgo_ejected", backend=out.id) == 0
    assert _sample(telemetry, "gorgo_ejections_total", backend=out.id) == out.ejections
    # the tuner: every step it recorded, by outcome, its samples, sigma, frozen
    tuner = router.tuner
    assert tuner is not None
    history = tuner.state.history
    accepted = sum(1 for h in history if h["accepted"])
    assert _sample(telemetry, "gorgo_tuner_steps_total", outcome="accepted") == accepted
    assert _sample(telemetry, "gorgo_tuner_steps_total", outcome="rejected") == (
        len(history) - accepted
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
        "gorgo_cost_term_ms_sum",
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


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)


@needs_promtool
def test_promtool_checks_the_rules_and_the_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    rules = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr
    # the config as mounted in compose: the rule file beside it
    config = PROMETHEUS_CONFIG.read_text().replace("/etc/prometheus/alerts.yml", str(ALERTS))
    (tmp_path / "prometheus.yml").write_text(config)
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_the_alerts_fire_on_their_unit_tests() -> None:
    """alerts-test.yml: each alert fires on a synthetic outage and stays quiet on the
    normal case next to it."""
    assert PROMTOOL is not None
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}
    out = subprocess.run(
        [PROMTOOL, "test", "rules", ALERTS_TEST.name],
        capture_output=True,
        text=True,
        cwd=ALERTS_TEST.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- a real Envoy and a real gorgo serve ---------------------------------------------------


async def _wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer in {timeout_s} s")
            await asyncio.sleep(0.05)


async def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, url
        return exported(await r.text())


def _value(text: str, name: str) -> float:
    """A front-door counter's value from the raw exposition."""
    m = re.search(rf'^{name}\{{envoy_http_conn_manager_prefix="front_door"\}} (\S+)$', text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


async def _chat(session: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"hello {i}"}]}  # fmt: skip
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


@dataclass
class LiveFleet:
    cfg: Config
    front_door: str
    envoy_admin: str


@pytest.fixture
async def live_fleet(tmp_path: Path) -> AsyncIterator[LiveFleet]:
    """One emulated engine behind two backend ids, and a real Envoy in front, with
    nothing yet on the router's gRPC port."""
    engine = EngineServer(EngineConfig.zero_delay("us-ashburn"), "127.0.0.1", 0)
    await engine.start()
    front, admin, grpc_port, gorgo_admin = free_ports(4)
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "tuner": {"mode": "paired", "arm_size": 4},
            "listen": {"grpc": f"127.0.0.1:{grpc_port}", "admin": f"127.0.0.1:{gorgo_admin}"},
            "envoy": {"listen": f"127.0.0.1:{front}", "admin": f"127.0.0.1:{admin}"},
            "backends": [
                {"id": b, "address": f"127.0.0.1:{engine.port}", "rtt_prior_ms": 1}
                for b in ("us-ashburn", "eu-frankfurt")
            ],
        }
    )
    bootstrap = tmp_path / "envoy.yaml"
    bootstrap.write_text(render_envoy_config(cfg))
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "envoy.log").open("w"),
    )
    try:
        await _wait_http(f"http://127.0.0.1:{admin}/ready")
        yield LiveFleet(cfg, f"http://127.0.0.1:{front}", f"http://127.0.0.1:{admin}")
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
        await engine.stop()


@pytest.mark.e2e
async def test_a_real_envoy_and_gorgo_serve_export_what_they_name(live_fleet: LiveFleet) -> None:
    """Router down, then up: Envoy counts each request let through without the router
    once (the fail-open share's numerator), and both export every name the dashboard and
    the alerts use, with the labels they match on."""
    stats = f"{live_fleet.envoy_admin}/stats/prometheus"
    n = 3
    async with aiohttp.ClientSession() as session:
        # the router is down: Envoy fails open, the fallback route serves
        statuses = [await _chat(session, live_fleet.front_door, i) for i in range(n)]
        assert statuses == [200] * n
        async with session.get(stats) as r:
            down = await r.text()
        assert _value(down, "envoy_http_ext_proc_failure_mode_allowed") == n
        assert _value(down, "envoy_http_downstream_rq_total") == n

        async with running_service(live_fleet.cfg) as svc:
            metrics = f"http://127.0.0.1:{svc.admin_port}/metrics"
            await _wait_http(metrics)
            statuses = [await _chat(session, live_fleet.front_door, i) for i in range(n)]
            async with session.get(f"{live_fleet.front_door}/v1/models") as r:
                assert r.status == 200  # not an LLM call: the fallback route
            assert statuses == [200] * n
            deadline = time.monotonic() + 10
            while sum(b.completed for b in svc.router.backends.values()) < n or not any(
                b.fallback_completed for b in svc.router.backends.values()
            ):
                assert time.monotonic() < deadline, "completions did not arrive"
                await asyncio.sleep(0.05)
            assert svc.router.decisions == n
            router_names = await _scrape(metrics)
            async with session.get(stats) as r:
                up = await r.text()
    # with the router up, nothing more failed open
    assert _value(up, "envoy_http_ext_proc_failure_mode_allowed") == n
    assert _value(up, "envoy_http_downstream_rq_total") == 2 * n + 1

    selectors = all_selectors()
    envoy = [s for s in selectors if s.name.startswith("envoy_")]
    assert envoy
    check_selectors(envoy, exported(up), "a real Envoy's /stats/prometheus")
    # a real gorgo serve exports them too (the failover and ejection series exist at 0)
    gorgo = [
        s
        for s in selectors
        if s.name.startswith("gorgo_") and ("status", "=", "failed_over") not in s.matchers
    ]
    check_selectors(gorgo, router_names, "gorgo serve's /metrics")
