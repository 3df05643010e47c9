"""The client protocol (loadgen.client.protocol), alike in `gorgo replay` and `gorgo simulate`:
presets and overrides, truncation, and the command line's flags. The live replay's cap
against a fake streaming server: tests/component/loadgen/replay/test_replay.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ext_proc.cli import main
from loadgen.client.protocol import OPEN, PAPER, Protocol, protocol_for
from loadgen.traces.readers import write_mooncake
from tests.trace_rows import rows


def test_presets_and_overrides() -> None:
    assert (PAPER.max_concurrency, PAPER.max_tokens, PAPER.max_input_tokens) == (64, 128, 24_000)
    assert (OPEN.name, PAPER.name) == ("open", "paper")
    assert protocol_for("paper") == PAPER and protocol_for() == OPEN
    mine = protocol_for("paper", max_concurrency=32)
    assert (mine.max_concurrency, mine.max_tokens, mine.name) == (32, 128, "custom")
    assert "64 requests in flight" in PAPER.describe() and "24,000" in PAPER.describe()
    assert "no concurrency cap" in OPEN.describe()
    assert PAPER.meta() == {
        "name": "paper",
        "max_concurrency": 64,
        "max_tokens": 128,
        "max_input_tokens": 24_000,
        "request_max_tokens": "output",
    }


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_concurrency": 0}, "--max-concurrency"),
        ({"max_tokens": -1}, "--max-tokens"),
        ({"max_input_tokens": 0}, "--max-input-tokens"),
    ],
)
def test_bad_values_name_their_flag(kwargs: dict[str, int], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        Protocol(**kwargs)
    with pytest.raises(ValueError, match="--protocol"):
        protocol_for("closed")


def test_apply_forces_output_lengths_and_drops_long_prompts_keeping_ids() -> None:
    trace = rows(3, long=2)
    kept, dropped = PAPER.apply(trace)
    assert dropped == 2 and [r.id for r in kept] == ["t0", "t1", "t2"]
    assert all(r.output_tokens == 128 for r in kept)
    assert Protocol(max_tokens=7).apply(trace) == ([replace(r, output_tokens=7) for r in trace], 0)
    assert Protocol(max_input_tokens=600).apply(trace)[1] == 2  # "over N" drops, N stays
    assert OPEN.apply(trace) == (trace, 0)


# ---------------------------------------------------------------------------------------
# The command line.


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-concurrency", "0"), ("--max-tokens", "0"), ("--max-input-tokens", "-5")],
)
def test_simulate_rejects_bad_protocol_values_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", rows(2))
    assert main(["simulate", str(path), "--out", str(tmp_path / "o"), flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_simulate_under_the_paper_protocol_records_it(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", rows(4, long=1))
    out = tmp_path / "o"
    args = ["simulate", str(path), "--out", str(out), "--protocol", "paper"]
    assert main([*args, "--max-concurrency", "2", "--policy", "round_robin"]) == 0
    doc = json.loads((out / "round_robin-ts1.json").read_text())
    assert doc["meta"]["protocol"] == {**PAPER.meta(), "name": "custom", "max_concurrency": 2}
    assert doc["meta"]["dropped"] == 1 and len(doc["requests"]) == 4
    assert all(r["output_tokens"] == 128 for r in doc["requests"])
    assert doc["summary"]["slip_ms"]["waited"] == 2  # four at once, two slots
    md = (out / "summary.md").read_text()
    assert "protocol `custom`" in md and "slip p95" in md and "1 dropped" in md


@pytest.mark.parametrize(
    ("sent", "output", "max_tokens", "kept_output"),
    [("output", 700, 700, 700), ("none", 700, None, 700), ("512", 700, 512, 512)],
)
def test_what_the_requests_say_as_max_tokens(
    sent: str, output: int, max_tokens: int | None, kept_output: int
) -> None:
    p = Protocol(request_max_tokens=sent)
    assert p.sent_max_tokens(output) == max_tokens
    (r,), _ = p.apply([replace(rows(1)[0], output_tokens=output)])
    assert r.output_tokens == kept_output  # a cap ends a longer output at the cap


@pytest.mark.parametrize("bad", ["0", "-5", "many", ""])
def test_request_max_tokens_must_be_output_none_or_a_count(bad: str) -> None:
    with pytest.raises(ValueError, match="--request-max-tokens"):
        Protocol(request_max_tokens=bad)
