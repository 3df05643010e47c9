"""promtool (Debian's `prometheus` package) checks the alerting rules and the scrape config,
and runs the rules' unit tests (deploy/prometheus/alerts-test.yml); without it they skip."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.monitoring import ALERTS, PROMETHEUS_CONFIG, ROOT, alert_rules

ALERTS_TEST = ROOT / "deploy/prometheus/alerts-test.yml"

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
