"""`gorgo replay` through the CLI against a real local stack (Envoy, router, engines)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.stack import Stack
from ext_proc.cli import main
from loadgen.results import RequestResult
from loadgen.traces.readers import read_trace, write_mooncake
from loadgen.traces.request import TraceRequest
from loadgen.traces.synthetic import synthetic
from tests.e2e.conftest import FAST_REGIONS, start_stack

pytestmark = pytest.mark.e2e

# The first 400 rows of the Mooncake conversation trace, bundled (Apache-2.0).
MOONCAKE_SLICE = (
    Path(__file__).resolve().parents[2] / "loadgen/data/mooncake-conversation-head400.jsonl"
)
ROW_KEYS = set(RequestResult("x").row())
STAT_KEYS = {"p50", "p90", "p95", "p99", "mean"}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack("least_request")
    yield s
    s.stop()


def replay(trace: Path, url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    rc = main(["replay", str(trace), "--url", url, "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


def check_against_trace(doc: dict[str, Any], trace: list[TraceRequest]) -> list[dict[str, Any]]:
    """Schema, one ok row per request in trace order, token counts exactly the trace's."""
    assert set(doc) == {"meta", "summary", "requests"}
    rows = doc["requests"]
    assert [r["id"] for r in rows] == [t.id for t in trace]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert all(r["status"] == "ok" and r["error"] == "" for r in rows), rows
    assert [r["input_tokens"] for r in rows] == [t.input_tokens for t in trace]
    assert [r["output_tokens"] for r in rows] == [t.output_tokens for t in trace]
    assert {r["backend"] for r in rows} <= {r.id for r in FAST_REGIONS}
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in rows)
    s = doc["summary"]
    assert (s["requests"], s["ok"], s["errors"]) == (len(trace), len(trace), 0)
    assert set(s["ttft_ms"]) == set(s["e2e_ms"]) == set(s["itl_ms"]) == STAT_KEYS
    assert s["ttft_ms"]["p50"] > 0 and 0 < s["cache_hit_rate"] < 1
    return rows


def earlier_on_same_backend(
    rows: list[dict[str, Any]], trace: list[TraceRequest], i: int, gap_s: float
) -> bool:
    """Row i's backend served a request that arrived at least gap_s before it."""
    return any(
        rows[j]["backend"] == rows[i]["backend"]
        and trace[j].arrival_s <= trace[i].arrival_s - gap_s
        for j in range(i)
    )


def test_synthetic_trace_replays_exactly(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_mooncake(
        tmp_path / "syn.jsonl",
        synthetic(sessions=6, turns=4, rate_rps=12, output_tokens=12, seed=7),
    )
    trace = read_trace(path)
    out, table_csv, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    rc, doc = replay(path, stack.front_door_url, out, "--csv", str(table_csv), "--plot", str(png))
    assert rc == 0
    rows = check_against_trace(doc, trace)
    assert all(r["output_tokens"] == 12 for r in rows)

    # Later turns hit the prefix cache: every request shares a 1024-token system prompt
    # with all before it, and a turn that lands where its previous turn ran reuses that
    # whole conversation.
    last_turn: dict[str, int] = {}
    later = warm = 0
    for i, t in enumerate(trace):
        prev = last_turn.get(t.session)
        last_turn[t.session] = i
        if prev is None:
            continue
        later += 1
        if earlier_on_same_backend(rows, trace, i, gap_s=0.3):
            warm += 1
            assert rows[i]["cached_tokens"] >= 1024, (i, rows[i])
        if rows[prev]["backend"] == rows[i]["backend"]:
            assert rows[i]["cached_tokens"] >= trace[prev].input_tokens, (i, rows[i])
    assert later == 18 and warm >= 12

    meta = doc["meta"]
    assert meta["trace"] == str(path) and meta["url"] == stack.front_door_url
    assert (meta["time_scale"], meta["max_concurrency"], meta["api"]) == (1.0, 256, "completions")
    assert meta["window"] == {"start_s": 0.0, "duration_s": None, "limit": None}
    assert datetime.fromisoformat(meta["started_at"]).tzinfo is not None
    slip = meta["slip_ms"]
    assert 0 <= slip["p50"] <= slip["p95"] <= slip["max"] and slip["throttled"] == 0
    # open loop: the run lasts about as long as the trace, not the sum of requests
    assert trace[-1].arrival_s <= meta["wall_s"] < trace[-1].arrival_s + 5
    assert (meta["requests_planned"], meta["requests_sent"], meta["interrupted"]) == (
        24,
        24,
        False,
    )

    with table_csv.open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["id"] for r in csv_rows] == [t.id for t in trace] and set(csv_rows[0]) == ROW_KEYS
    assert png.read_bytes().startswith(b"\x89PNG")
    captured = capsys.readouterr()
    assert "| run | requests |" in captured.out and "| syn.jsonl x1 | 24 | 0 |" in captured.out
    # stderr is no terminal here: no bar, no control character, the outcome in one line
    assert "\r" not in captured.err and "\x1b" not in captured.err
    assert "replay 24/24 done | 0 in flight | 0 errors" in captured.err


def test_mooncake_rows_replay_exactly(stack: Stack, tmp_path: Path) -> None:
    trace = read_trace(MOONCAKE_SLICE)[:40]
    # the first 40 rows: 12 s of trace in 1.2 s, inputs up to 87k tokens
    rc, doc = replay(
        MOONCAKE_SLICE,
        stack.front_door_url,
        tmp_path / "r.json",
        "--limit",
        "40",
        "--time-scale",
        "0.1",
        "--quiet",
    )
    assert rc == 0
    rows = check_against_trace(doc, trace)
    # every conversation starts with the same system-prompt block
    warm = [i for i in range(len(trace)) if earlier_on_same_backend(rows, trace, i, gap_s=0.5)]
    assert len(warm) >= 20
    assert all(rows[i]["cached_tokens"] >= 512 for i in warm), [rows[i] for i in warm]
    meta = doc["meta"]
    assert (meta["time_scale"], meta["window"]["limit"], meta["requests_planned"]) == (0.1, 40, 40)


def test_chat_api_streams_the_same_prompts(stack: Stack, tmp_path: Path) -> None:
    path = write_mooncake(
        tmp_path / "syn.jsonl", synthetic(sessions=3, turns=2, rate_rps=30, seed=2)
    )
    trace = read_trace(path)
    rc, doc = replay(path, stack.front_door_url, tmp_path / "r.json", "--api", "chat", "--quiet")
    assert rc == 0 and doc["meta"]["api"] == "chat"
    rows = doc["requests"]
    assert all(r["status"] == "ok" and r["ttft_ms"] > 0 for r in rows)
    # the chat template adds a few tokens around the synthesized text
    assert all(
        t.input_tokens < r["input_tokens"] < t.input_tokens + 16
        for t, r in zip(trace, rows, strict=True)
    )
    assert [r["output_tokens"] for r in rows] == [t.output_tokens for t in trace]


def test_max_concurrency_one_records_slip_when_arrivals_bunch(stack: Stack, tmp_path: Path) -> None:
    # six requests within a few milliseconds, each taking tens of milliseconds
    path = write_mooncake(
        tmp_path / "burst.jsonl",
        synthetic(sessions=6, turns=1, rate_rps=2000, output_tokens=20, seed=1),
    )
    rc, doc = replay(
        path, stack.front_door_url, tmp_path / "r.json", "--max-concurrency", "1", "--quiet"
    )
    assert rc == 0 and doc["summary"]["errors"] == 0
    slip = doc["meta"]["slip_ms"]
    assert doc["meta"]["max_concurrency"] == 1
    assert slip["throttled"] == 5  # all but the first waited for the one slot
    assert slip["max"] > 5 * 10  # the last waited for five requests of >= 10 ms each
    assert slip["p95"] > 0


def test_unreachable_url_records_errors_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_mooncake(
        tmp_path / "syn.jsonl", synthetic(sessions=3, turns=1, rate_rps=100, seed=4)
    )
    (port,) = free_ports(1)
    rc, doc = replay(path, f"http://127.0.0.1:{port}", tmp_path / "r.json", "--quiet")
    assert rc == 1
    rows = doc["requests"]
    assert len(rows) == 3 and all(r["status"] == "error" for r in rows)
    assert all("Cannot connect" in r["error"] and r["ttft_ms"] is None for r in rows)
    assert doc["summary"]["errors"] == 3 and doc["summary"]["ttft_ms"]["p50"] is None
    assert "every request failed" in capsys.readouterr().err


def test_bad_trace_line_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": [0]}) + "\n")
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--url", "http://127.0.0.1:1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2" in err and "hash_ids" in err and not out.exists()

    assert main(["replay", str(tmp_path / "missing.jsonl"), "--url", "http://127.0.0.1:1"]) == 2
    assert "missing.jsonl: cannot read trace" in capsys.readouterr().err
    assert main(["replay", str(path), "--url", "127.0.0.1:1"]) == 2
    assert "--url must start with http://" in capsys.readouterr().err
    path.write_text(json.dumps(good) + "\n")
    assert main(["replay", str(path), "--url", "http://127.0.0.1:1", "--start-s", "60"]) == 2
    assert "no requests in the window" in capsys.readouterr().err


def test_window_flags_pick_trace_time_before_scaling(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    rc, doc = replay(
        MOONCAKE_SLICE,
        f"http://127.0.0.1:{port}",
        tmp_path / "r.json",
        *("--start-s", "3", "--duration-s", "3", "--time-scale", "0.01", "--quiet"),
    )
    assert rc == 1  # nothing listens there
    expected = [t.id for t in read_trace(MOONCAKE_SLICE) if 3.0 <= t.arrival_s < 6.0]
    assert [r["id"] for r in doc["requests"]] == expected and len(expected) == 19
    assert doc["meta"]["window"] == {"start_s": 3.0, "duration_s": 3.0, "limit": None}
