"""The tuner bench's `gorgo bench tuner` parser. It imports the bench only when it runs:
every `gorgo` command, `gorgo serve` and its warm spares too, builds all parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from loadgen.traces.readers import CONVERSATION_TRACE


def _tuner(args: argparse.Namespace) -> int:
    if args.pd_knobs:
        return _knobs(args)
    from loadgen.bench.tuner.report import run_tuner_bench

    return run_tuner_bench(
        args.trace,
        args.time_scale,
        args.change_at_s,
        args.seeds,
        args.convergence,
        args.paper_regime,
    )


def _knobs(args: argparse.Namespace) -> int:
    from loadgen.bench.tuner.knobs import run_knob_bench
    from loadgen.sim.settings import SimSettings
    from loadgen.traces.load import load_trace
    from loadgen.traces.windows import window

    trace = window(load_trace(args.trace), 0.0, args.duration_s)
    base = SimSettings(
        time_scale=args.time_scale,
        pd=True,
        pd_protocol=args.pd_protocol,
        kv_link_gbps=args.kv_link_gbps,
    )
    label = (
        f"{args.pd_protocol}, {args.kv_link_gbps:g} Gbps, time_scale {args.time_scale:g}, "
        f"the trace's first {args.duration_s:g} s ({len(trace)} requests)"
    )
    return run_knob_bench(trace, base, label)


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
    b.add_argument(
        "--pd-knobs",
        action="store_true",
        help="instead: the P/D knobs' tuner (threshold, margin) on `gorgo simulate --pd`, "
        "from two bad starts, against the best fixed pair of a sweep (~20 min)",
    )
    b.add_argument("--pd-protocol", choices=("sglang", "vllm"), default="sglang")
    b.add_argument("--kv-link-gbps", type=float, default=10.0, help="with --pd-knobs")
    b.add_argument(
        "--duration-s", type=float, default=1200.0, help="with --pd-knobs: the trace's window"
    )
    b.set_defaults(func=_tuner)


PARSERS = (add_tuner,)
