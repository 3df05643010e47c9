"""Progress of the long runs: a tqdm bar on stderr when it is a terminal, nothing at all
otherwise (no carriage return or escape code reaches a CI log), lines `say` prints always;
through the real runs too: a bench target matrix and a `gorgo simulate` in a subprocess."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadgen.bench.sim.target import Cell, Window, run_cells
from loadgen.progress import bar, counter, say, timed, tracked
from loadgen.traces.readers import read_trace
from loadgen.traces.windows import window

ROOT = Path(__file__).resolve().parents[3]
SLICE = ROOT / "loadgen/data/mooncake-conversation-head400.jsonl"
CONTROL = ("\r", "\x1b")


class Terminal(io.StringIO):
    """Output that says it is a terminal, as a user's stderr does."""

    def isatty(self) -> bool:
        return True


def test_a_bar_draws_on_a_terminal_only() -> None:
    for out, drawn in ((Terminal(), True), (io.StringIO(), False)):
        with bar(3, "cells", file=out) as b:
            for _ in range(3):
                b.update()
        say("a line of its own", file=out)
        text = out.getvalue()
        assert text.endswith("a line of its own\n")
        assert ("3/3" in text and "\r" in text) is drawn
        if not drawn:
            assert text == "a line of its own\n"


def test_tracked_passes_every_item_and_counter_follows_a_total() -> None:
    assert list(tracked(iter("abc"), 3, "letters")) == ["a", "b", "c"]
    out = Terminal()
    with bar(None, "requests", file=out) as b:
        to = counter(b)
        to(2, 10)
        to(10, 10)
        assert (b.n, b.total) == (10, 10)
    assert "10/10" in out.getvalue()


def test_a_timed_phase_counts_its_seconds_on_a_terminal() -> None:
    out = Terminal()
    with timed(1.0, "phase", file=out):
        time.sleep(1.05)
    assert "phase: 100%" in out.getvalue() and "1/1" in out.getvalue()
    quiet = io.StringIO()
    with timed(1.0, "phase", file=quiet):
        time.sleep(0.1)
    assert quiet.getvalue() == ""


def _cells() -> list[Cell]:
    reqs = tuple(window(read_trace(SLICE), limit=40))
    return [Cell(Window("conversation", "head", reqs), "paper", "open", 1.0)]


def test_a_bench_matrix_on_a_pipe_writes_lines_and_no_control_character(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cells(_cells(), ["round_robin", "gorgo"], tmp_path, jobs=1)
    err = capsys.readouterr().err
    assert "[1/2]" in err and "[2/2]" in err
    assert not any(c in err for c in CONTROL)


def test_the_same_matrix_on_a_terminal_draws_its_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = Terminal()
    monkeypatch.setattr(sys, "stderr", out)
    run_cells(_cells(), ["round_robin", "gorgo"], tmp_path, jobs=1)
    assert "bench target: 100%" in out.getvalue() and "2/2" in out.getvalue()


def test_gorgo_simulate_into_a_pipe_has_no_control_character(tmp_path: Path) -> None:
    flags = ["--limit", "60", "--policy", "gorgo", "--policy", "round_robin", "--out"]
    out = subprocess.run(
        [sys.executable, "-m", "ext_proc.cli", "simulate", str(SLICE), *flags, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert "round_robin      time_scale 1" in out.stderr  # the runs' lines are there
    assert not any(c in out.stderr for c in CONTROL)
