"""What engines say about themselves (ext_proc/feeds/): the Prometheus /metrics page
(engine_metrics.parse_engine_metrics, vLLM's and SGLang's names) and the /v1/models
list (served_models.parse_models). The first byte picks the reader.

Invariant: a page is read into a report of finite, non-negative numbers (or None: not
said), or refused with MetricsError; a models list is read into at least one name, or
refused with ModelsError; nothing else is raised."""

from __future__ import annotations

import math

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    import json

    from ext_proc.feeds.engine_metrics import MetricsError, parse_engine_metrics
    from ext_proc.feeds.served_models import ModelsError, parse_models

from tests.fuzz.runner import fuzz

NAME = "engine_metrics"


def _metrics(text: str) -> None:
    try:
        report = parse_engine_metrics(text)
    except MetricsError:
        return
    for value in (report.waiting, report.running, report.kv_usage):
        assert value is None or (math.isfinite(value) and value >= 0), report
    for count in (report.max_lora, report.kv_capacity_tokens):
        assert count is None or count >= 0, report


def _models(data: bytes) -> None:
    try:
        doc = json.loads(data)
    except ValueError:  # aiohttp's resp.json() raises before parse_models sees it
        return
    try:
        served = parse_models(doc)
    except ModelsError as e:
        assert str(e)
        return
    assert served.base or served.adapters


def one_input(data: bytes) -> None:
    if data[:1] == b"{":
        _models(data)
    else:
        _metrics(data.decode("utf-8", "replace"))


def main() -> None:
    fuzz(NAME, one_input, max_len=8192)


if __name__ == "__main__":
    main()
