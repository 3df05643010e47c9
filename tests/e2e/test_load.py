"""Load and soak through real Envoy and one router process (slow tier: `make test-all`)."""

from __future__ import annotations

import pytest

from loadgen.bench.live.load import run_load

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_200_concurrent_streams_for_60_s_without_timeouts() -> None:
    report = run_load(streams=200, duration_s=60)
    print("\n".join(report.lines()))
    assert report.requests > 1000
    assert report.errors == 0 and report.timeouts == 0


def test_memory_stays_flat_over_a_10_minute_soak() -> None:
    report = run_load(streams=100, duration_s=600)
    print("\n".join(report.lines()))
    assert report.errors == 0
    # bounded state: the prefix index within the fleet's KV capacity, nothing left over
    assert 0 < report.index_tokens <= report.index_capacity_tokens
    assert report.in_flight_end == 0
    # after warm-up (the first tenth), memory grows by less than 20 %
    warm = report.rss_samples_mb[1]
    assert max(report.rss_samples_mb[1:]) < warm * 1.2
