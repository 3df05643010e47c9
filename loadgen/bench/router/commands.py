"""The in-process router benches' `gorgo bench` parsers, one `add_<bench>` a bench. Each
imports its bench only when it runs: every `gorgo` command, `gorgo serve` and its warm
spares too, builds all parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _decide(args: argparse.Namespace) -> int:
    from loadgen.bench.router.decide import run_decide_bench

    return run_decide_bench(args.iterations)


def add_decide(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "decide",
        help="decision latency and prefix-index memory",
        description="In process: the router's decision latency and its prefix index's "
        "memory, then with a real tokenizer, warm and cold tokenize + decide of a "
        "32k-token chat turn.",
    )
    b.add_argument("--iterations", type=int, default=300, help="decisions per measurement")
    b.set_defaults(func=_decide)


def _kv_burst(args: argparse.Namespace) -> int:
    from loadgen.bench.router.kv_burst import run_kv_burst_bench

    return run_kv_burst_bench(args.bursts, args.idle_s)


def add_kv_burst(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "kv-burst",
        help="decision latency while a 32k-event KV burst is applied (page size 1)",
        description="Decision latency for a 32k-token prompt with no KV events, and while "
        "a 32k-event burst (page size 1) arrives over real ZMQ and is applied: what the "
        "burst adds (docs/benchmarks.md).",
    )
    b.add_argument("--bursts", type=int, default=8, help="32k-token prompts' bursts applied")
    b.add_argument("--idle-s", type=float, default=4.0, help="decisions measured with no events")
    b.set_defaults(func=_kv_burst)


def _kv_index(args: argparse.Namespace) -> int:
    from loadgen.bench.router.kv_index import run_kv_index_bench

    return run_kv_index_bench(args.tokens, args.repeat)


def add_kv_index(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "kv-index",
        help="a 32k-token prompt against the per-engine block index at page size 1, in "
        "process: decide, and apply its KV events one a token and coalesced",
        description="In process, one long prompt against the per-engine block index at "
        "page size 1: the decision's time, and applying its KV events one a token and "
        "coalesced (over a socket: gorgo bench kv-burst).",
    )
    b.add_argument("--tokens", type=int, default=32_768, help="the prompt's length")
    b.add_argument("--repeat", type=int, default=5, help="measurements, the best kept")
    b.set_defaults(func=_kv_index)


PARSERS = (add_decide, add_kv_burst, add_kv_index)
