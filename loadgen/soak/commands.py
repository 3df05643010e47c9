"""`gorgo soak`'s parser. Light: the soak's modules are imported only when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _soak(args: argparse.Namespace) -> int:
    from loadgen.soak.run import SoakOptions, run_soak

    if args.minutes < 8:
        print("gorgo soak: --minutes must be 8 or more (room for ten faults)")
        return 2
    if args.time_scale <= 0:
        print("gorgo soak: --time-scale must be positive")
        return 2
    return run_soak(
        SoakOptions(minutes=args.minutes, time_scale=args.time_scale, seed=args.seed, out=args.out)
    )


def add_soak(sub: Any, policies: Sequence[str]) -> None:
    s = sub.add_parser(
        "soak",
        help="the local stack under load for N minutes, with a fault every few minutes",
        description="Starts the local stack (two routers over NATS, flow control and "
        "classes on), sends the paper-shaped workload open loop near capacity, and every few "
        "minutes injects one fault: router, engine, Envoy and NATS kill -9, an engine "
        "stall, a frozen WAN link, a good and a bad config reload, a backend added and "
        "removed. Prints per fault the requests failed (and whether only on the faulted "
        "part), the time to recover, and the routers' memory and open files over the run. "
        "Exit 1 if a failure fell outside its fault's part, a part did not recover or the "
        "memory grew. Loopback only; it stops by itself.",
    )
    s.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    s.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="arrivals stretched by this (0.75 is the last load before saturation here)",
    )
    s.add_argument("--seed", type=int, default=0, help="the workload's seed")
    s.add_argument("--out", default=None, help="write the result (JSON) here")
    s.set_defaults(func=_soak)


PARSERS = (add_soak,)
