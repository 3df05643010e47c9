"""Trace readers, windows, the synthetic generator and prompt synthesis."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from ext_proc.prompt.tokens import count_tokens
from loadgen.traces.prompts import PromptSynth, block_text
from loadgen.traces.readers import read_mooncake, read_trace, write_mooncake
from loadgen.traces.request import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRequest
from loadgen.traces.synthetic import synthetic
from loadgen.traces.windows import scaled, window


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts: int, n_in: int, n_out: int, ids: list[int]) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_mooncake_rows_are_sorted_by_arrival_with_sessions_after_the_shared_prefix(
    tmp_path: Path,
) -> None:
    path = write_rows(
        tmp_path / "t.jsonl",
        [
            row(3000, 1500, 10, [0, 7, 8]),
            row(0, 1024, 5, [0, 1]),
            row(0, 600, 0, [0, 2]),  # same timestamp: file order kept
            row(1500, 2000, 7, [0, 1, 3, 4]),  # the session of [0, 1] continues
        ],
    )
    trace = read_trace(path)
    assert [r.arrival_s for r in trace] == [0.0, 0.0, 1.5, 3.0]
    assert [r.input_tokens for r in trace] == [1024, 600, 2000, 1500]
    assert [r.index for r in trace] == [0, 1, 2, 3] and trace[0].id == "t0"
    # every row shares block 0 (the system prompt): the session is the next id
    assert [r.session for r in trace] == ["s1", "s2", "s1", "s7"]
    assert trace[1].output_tokens == 1  # zero outputs become one token
    assert all(r.block_tokens == MOONCAKE_BLOCK_TOKENS and r.body is None for r in trace)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps(row(0, 600, 5, [0, 1, 2])), "3 hash_ids for 600 input tokens"),
        (json.dumps(row(0, 600, 5, [0])), "1 hash_ids for 600 input tokens"),
        (json.dumps({**row(0, 10, 5, [0]), "hash_ids": ["a"]}), "'hash_ids' must be a list"),
        (json.dumps(row(-1, 10, 5, [0])), "'timestamp' must be a non-negative integer"),
        (json.dumps({**row(0, 10, 5, [0]), "output_length": 2.5}), "'output_length'"),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_rows(tmp_path / "bad.jsonl", [row(0, 512, 5, [0]), "", line])
    with pytest.raises(TraceError) as e:
        read_mooncake(path)
    assert f"{path}:3" in str(e.value) and message in str(e.value)


def test_missing_and_empty_files_are_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def make(arrivals: list[float]) -> list[TraceRequest]:
    return [TraceRequest(i, t, 512, 4, (i,), 512, f"s{i}") for i, t in enumerate(arrivals)]


def test_window_selects_shifts_and_limits() -> None:
    trace = make([0.0, 1.0, 2.0, 3.0, 4.0])
    got = window(trace, start_s=1.0, duration_s=2.0)
    assert [r.index for r in got] == [1, 2] and [r.arrival_s for r in got] == [0.0, 1.0]
    assert [r.index for r in window(trace, start_s=2.0)] == [2, 3, 4]
    assert [r.index for r in window(trace, limit=2)] == [0, 1]
    assert window(trace, start_s=10.0) == []


def test_scaled_stretches_arrivals() -> None:
    assert [r.arrival_s for r in scaled(make([0.0, 1.0, 2.5]), 2.0)] == [0.0, 2.0, 5.0]


def test_synthetic_is_reproducible_with_a_seed_and_carries_its_conversation() -> None:
    a = synthetic(sessions=5, turns=3, seed=11)
    assert a == synthetic(sessions=5, turns=3, seed=11)
    assert a != synthetic(sessions=5, turns=3, seed=12)
    assert len(a) == 15
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(a))
    by_session: dict[str, list[TraceRequest]] = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert len(turns) == 3
        for prev, cur in itertools.pairwise(turns):  # reuse=1: history grows
            assert cur.block_ids[: len(prev.block_ids)] == prev.block_ids
    assert all(r.input_tokens == len(r.block_ids) * r.block_tokens for r in a)


def test_write_mooncake_round_trips(tmp_path: Path) -> None:
    trace = synthetic(sessions=4, turns=2, seed=5)
    back = read_trace(write_mooncake(tmp_path / "syn.jsonl", trace))
    assert [(r.input_tokens, r.output_tokens, r.block_ids) for r in back] == [
        (r.input_tokens, r.output_tokens, r.block_ids) for r in trace
    ]
    assert all(abs(a.arrival_s - b.arrival_s) <= 0.0005 for a, b in zip(back, trace, strict=True))
    # one session key per conversation (the first block after the system prompt)
    assert len({r.session for r in back}) == 4
    with pytest.raises(ValueError, match="512"):
        write_mooncake(tmp_path / "x.jsonl", [TraceRequest(0, 0.0, 256, 1, (0,), 256, "u")])


def test_prompts_have_exactly_the_trace_token_count() -> None:
    synth = PromptSynth()
    for n_in in (1, 511, 512, 513, 2000, 4096):
        ids = tuple(range(100, 100 + -(-n_in // 512)))
        r = TraceRequest(0, 0.0, n_in, 1, ids, 512, "s")
        text = synth.prompt(r)
        assert count_tokens(text) == n_in and len(text) == 4 * n_in and text.isascii()


def test_shared_leading_ids_give_byte_identical_prefixes() -> None:
    synth = PromptSynth()
    a = synth.prompt(TraceRequest(0, 0.0, 1536, 1, (0, 1, 2), 512, "s"))
    b = synth.prompt(TraceRequest(1, 0.0, 1536, 1, (0, 1, 9), 512, "s"))
    c = synth.prompt(TraceRequest(2, 0.0, 1536, 1, (5, 1, 2), 512, "s"))
    bytes_per_block = 4 * 512
    assert a[: 2 * bytes_per_block] == b[: 2 * bytes_per_block]
    assert a[2 * bytes_per_block :] != b[2 * bytes_per_block :]
    assert a[:bytes_per_block] != c[:bytes_per_block]
    # the cache changes nothing: a fresh synthesizer writes the same text
    assert (
        PromptSynth(cache_blocks=1).prompt(TraceRequest(0, 0.0, 1536, 1, (0, 1, 2), 512, "s")) == a
    )


def test_a_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    full = block_text(42, 512)
    for n in (1, 100, 511):
        assert full.startswith(block_text(42, n))
    r = TraceRequest(0, 0.0, 512 + 100, 1, (7, 42), 512, "s")
    assert PromptSynth().prompt(r) == block_text(7, 512) + full[: 4 * 100]
