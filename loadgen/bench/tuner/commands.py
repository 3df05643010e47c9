"""The tuner bench's `gorgo bench tuner` parser. It imports the bench only when it runs:
every `gorgo` command, `gorgo serve` and its warm spares too, builds all parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from loadgen.traces.readers import CONVERSATION_TRACE


def _tuner(args: argparse.Namespace) -> int:
    from loadgen.bench.tuner.report import run_tuner_bench

    return run_tuner_bench(
        args.trace,
        args.time_scale,
        args.change_at_s,
        args.seeds,
        args.convergence,
        args.paper_regime,
    )


def add_tuner(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "tuner",
        help="the tuner through a regime change; false accepts",
        description="The weight tuner in the simulator through a regime change of the "
        "fleet: how fast it follows, tuned against frozen weights, and its false accepts, "
        "each target PASS or FAIL per seed (docs/tuner.md).",
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument("--time-scale", type=float, default=6.0, help="2 = half the trace's rate")
    b.add_argument("--change-at-s", type=float, default=600.0, help="trace time of the change")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="a run each")
    b.add_argument(
        "--convergence",
        action="store_true",
        help="first the grid and the convergence runs on the paper-shaped tuning window "
        "and on the trace's (~35 min more)",
    )
    b.add_argument(
        "--paper-regime",
        action="store_true",
        help="then the same regime change on the paper-shaped window under the paper's "
        "protocol and RTTs, for gorgo and gorgo_tokens (~2 min more)",
    )
    b.set_defaults(func=_tuner)


PARSERS = (add_tuner,)
