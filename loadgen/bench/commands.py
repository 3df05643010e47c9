"""`gorgo bench results`' parser (the paper's experiment, which draws on every kind of
bench). It imports the bench only when it runs: every `gorgo` command, `gorgo serve` too,
builds all parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.traces.readers import CONVERSATION_TRACE


def _results(args: argparse.Namespace) -> int:
    from loadgen.bench.results import run_results_bench

    return run_results_bench(args.trace, Path(args.out), Path(args.img), Path(args.work))


def add_results(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "results",
        help="the paper's experiment in the simulator",
        description="`make bench`: the paper's experiment on the Mooncake conversation trace "
        "in the simulator, every policy side by side on its tuning and held-out windows, "
        "written as docs/results.md with its figures.",
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument("--out", default="docs/results.md", help="the report")
    b.add_argument("--img", default="docs/img", help="directory for its figures")
    b.add_argument("--work", default="out/bench", help="result files of every run")
    b.set_defaults(func=_results)


PARSERS = (add_results,)
