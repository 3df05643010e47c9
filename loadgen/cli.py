"""The load generator's `gorgo` subcommands (`demo`, `replay`, `simulate`, `bench ...`),
contributed to the router's command line through the `gorgo.commands` entry-point group:
the router never imports the load generator.

Each room registers its own parsers: its `commands.py` holds one `add_<name>(sub,
policies)` a command and lists them in `PARSERS`; here they are only collected. Those
modules import nothing heavy (each command imports its module when it runs): every `gorgo`
command, `gorgo serve` and its warm spares too, builds all parsers at start.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from ext_proc.cli import Commands
from loadgen.bench import commands as bench_results
from loadgen.bench.live import commands as bench_live
from loadgen.bench.router import commands as bench_router
from loadgen.bench.sim import commands as bench_sim
from loadgen.bench.tuner import commands as bench_tuner
from loadgen.replay import commands as replay
from loadgen.sim import commands as sim
from loadgen.soak import commands as soak


def _demo(args: argparse.Namespace) -> int:
    from loadgen.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, policy=args.policy)


def add_demo(sub: Any, policies: Sequence[str]) -> None:
    s = sub.add_parser(
        "demo",
        help="start the local stack, send requests, print a table",
        description="`make demo`: starts the local stack (as gorgo up), sends chat requests "
        "through its front door, prints where they went and their TTFT and E2E per backend, "
        "and stops the stack.",
    )
    s.add_argument("--requests", type=int, default=100, help="chat requests to send")
    s.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    s.add_argument("--policy", default="gorgo", choices=policies, help="the router's policy")
    s.set_defaults(func=_demo)


# What each room's commands.py lists: a function that adds one command's parser to the
# subparsers given (`gorgo`'s or `gorgo bench`'s), with the known policy names.
AddParser = Callable[[Any, Sequence[str]], None]

# `gorgo COMMAND` and `gorgo bench BENCH`, in the order of their --help.
COMMANDS: tuple[AddParser, ...] = (add_demo, *replay.PARSERS, *sim.PARSERS, *soak.PARSERS)
BENCHES: tuple[AddParser, ...] = (
    *bench_results.PARSERS,
    *bench_sim.PARSERS,
    *bench_tuner.PARSERS,
    *bench_live.PARSERS,
    *bench_router.PARSERS,
)


def add_commands(commands: Commands) -> None:
    for add in COMMANDS:
        add(commands.sub, commands.policies)
    bench = commands.bench()
    for add in BENCHES:
        add(bench, commands.policies)
