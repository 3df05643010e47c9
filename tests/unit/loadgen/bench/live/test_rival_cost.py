"""The router-cost table of `gorgo bench overhead --peers` (loadgen/bench/live/rival_cost.py)."""

from __future__ import annotations

from loadgen.bench.live.rival_cost import Front, Row, table


def test_front_takes_its_urls_in_turn() -> None:
    f = Front("engines direct", ["a", "b", "c"])
    assert [f.url() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_table_adds_against_the_first_row() -> None:
    rows = [
        Row("engines direct", 0.50, 1.00, None, None, 2000.0),
        Row("envoy+gorgo", 1.75, 3.25, 2.10, 161.0, 500.0),
    ]
    header, direct, gorgo = table(rows)
    assert header.split()[:3] == ["front", "TTFT", "p50"]
    assert direct.split() == [
        "engines",
        "direct",
        "0.50",
        "+0.00",
        "1.00",
        "+0.00",
        "-",
        "-",
        "2000.0",
        "x1.000",
    ]
    assert gorgo.split() == [
        "envoy+gorgo",
        "1.75",
        "+1.25",
        "3.25",
        "+2.25",
        "2.10",
        "161",
        "500.0",
        "x0.250",
    ]
