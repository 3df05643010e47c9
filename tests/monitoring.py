"""What the Grafana dashboard and the alerting rules name, and what a metrics endpoint
exports: every PromQL expression of deploy/grafana/dashboards/ and
deploy/prometheus/alerts.yml parsed (promql-parser) into its metric selectors, a Prometheus
text exposition read into sample names and label sets, and the check that each selector
names a sample with the labels and values it matches on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"

# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
# Grafana's variables, replaced as Grafana would before the query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "10s",
    "$__range": "1h",
    "$backend": ".*",
}


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
