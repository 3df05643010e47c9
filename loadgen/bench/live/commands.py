"""The live-stack benches' `gorgo bench` parsers, one `add_<bench>` a bench. Each imports
its bench only when it runs: every `gorgo` command, `gorgo serve` and its warm spares too,
builds all parsers, and the benches import the stack, aiohttp and numpy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.traces.readers import CONVERSATION_TRACE


def _overhead(args: argparse.Namespace) -> int:
    from loadgen.bench.live.overhead import run_overhead_bench, run_picker_stream_bench

    if args.picker_stream:
        return run_picker_stream_bench(max(10, args.requests // 10), args.rounds)
    if args.peers:
        from loadgen.bench.live.rival_cost import run_rival_cost_bench

        return run_rival_cost_bench(args.requests)
    return run_overhead_bench(
        requests=args.requests, long_only=args.long_prompts, flow=args.flow_control, otlp=args.otlp
    )


def add_overhead(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "overhead",
        help="Envoy alone vs Envoy + gorgo ext_proc",
        description="What the router adds to a request: the same requests through Envoy "
        "alone and through Envoy with the router, in turns, on zero-delay engines; the "
        "added latency and the router's CPU per request (docs/benchmarks.md).",
    )
    b.add_argument("--requests", type=int, default=500, help="requests per measurement")
    b.add_argument(
        "--long-prompts",
        action="store_true",
        help="only 128k-token prompts from 32 concurrent clients (requests/2 per phase, >= 64)",
    )
    b.add_argument(
        "--flow-control",
        action="store_true",
        help="also a router with flow control on (room everywhere), in turn in the same run",
    )
    b.add_argument(
        "--otlp",
        action="store_true",
        help="the router exports its decision spans to an OTLP receiver (as a user runs it)",
    )
    b.add_argument(
        "--picker-stream",
        action="store_true",
        help="instead: the endpoint picker behind the extension's chart-like Envoy (both "
        "bodies FULL_DUPLEX_STREAMED) against the default front door, router CPU per request "
        "and inter-token gaps (requests/10 a mode a round, at least 10)",
    )
    b.add_argument("--rounds", type=int, default=3, help="--picker-stream's rounds")
    b.add_argument(
        "--peers",
        action="store_true",
        help="instead: the engines reached directly, Envoy alone, Envoy + gorgo, SMG and "
        "vllm-router (cache_aware, their defaults; `make peers`) side by side: added TTFT, "
        "CPU per request, RSS, requests/s at concurrency 16",
    )
    b.set_defaults(func=_overhead)


def _slice_flags(b: argparse.ArgumentParser, policies: Sequence[str]) -> None:
    """The trace slice `parity` and `live` replay, and the policies on it."""
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument("--policy", action="append", choices=policies, help="repeatable")
    b.add_argument("--start-s", type=float, default=600.0, help="slice start (trace time)")


def _parity(args: argparse.Namespace) -> int:
    from loadgen.bench.live.parity import run_parity

    return run_parity(
        args.trace,
        args.policy or ["gorgo", "least_request"],
        args.start_s,
        args.duration_s,
        args.time_scale,
        Path(args.results),
        Path(args.work),
        args.reuse_live,
    )


def add_parity(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "parity",
        help="live replay vs simulator on one slice",
        description="One slice of the trace replayed live on the local stack and simulated, "
        "per policy: how far the simulator's percentiles are from the live ones, written "
        "into docs/results.md.",
    )
    _slice_flags(b, policies)
    b.add_argument("--duration-s", type=float, default=300.0, help="slice length")
    b.add_argument("--time-scale", type=float, default=1.0, help="2 = half the trace's rate")
    b.add_argument("--results", default="docs/results.md", help="where to write it")
    b.add_argument("--work", default="out/bench", help="result files")
    b.add_argument(
        "--reuse-live",
        action="store_true",
        help="reuse the live result files in --work (only re-simulate)",
    )
    b.set_defaults(func=_parity)


def _live(args: argparse.Namespace) -> int:
    if args.fleet:
        from loadgen.bench.live.fleet import run_fleet_live

        if args.policy and len(args.policy) > 1:
            print("gorgo bench live: --fleet runs one policy", file=sys.stderr)
            return 2
        return run_fleet_live(
            args.trace,
            args.fleet,
            (args.policy or ["gorgo"])[0],
            args.start_s,
            args.duration_s,
            args.limit,
            args.time_scale,
            Path(args.work),
        )
    from loadgen.bench.live.parity import run_live_side_by_side

    return run_live_side_by_side(
        args.trace,
        args.policy or ["gorgo", "least_request", "session_affinity", "prefix_cache"],
        args.start_s,
        120.0 if args.duration_s is None else args.duration_s,
        args.time_scale,
    )


def add_live(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "live",
        help="policies side by side on isolated live fleets",
        description="A slice of the trace replayed live, each policy on a local stack of "
        "its own at the same time; or, with --fleet, one stack on a heterogeneous fleet and "
        "how well the router predicts each backend's TTFT and E2E.",
    )
    _slice_flags(b, policies)
    b.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="slice length (default 120; with --fleet the rest of the trace, cut by --limit)",
    )
    b.add_argument("--time-scale", type=float, default=1.0, help="2 = half the trace's rate")
    b.add_argument(
        "--fleet",
        metavar="FLEET.yaml",
        help="instead: one stack as `gorgo up --fleet FLEET.yaml` (one --policy, "
        "gorgo by default), the slice replayed, then /state's per-backend "
        "completions, TTFT/E2E prediction MAPE and bias; PASS when every backend "
        "has >= 200 completions and TTFT MAPE <= 15 %% (the live prediction target)",
    )
    b.add_argument("--limit", type=int, default=None, help="at most this many requests")
    b.add_argument("--work", default="out/bench", help="result file and final /state")
    b.set_defaults(func=_live)


def _prefix_state(args: argparse.Namespace) -> int:
    from loadgen.bench.live.prefix_state import Fleet, run_prefix_bench

    modes = ("precise", "approximate") if args.only is None else (args.only,)
    fleet = Fleet(args.front_doors, args.engine == "vllm", args.max_input_tokens, modes)
    return run_prefix_bench(
        args.trace,
        args.start_s,
        args.duration_s,
        args.limit,
        args.time_scale,
        Path(args.out),
        fleet,
    )


def add_prefix_state(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "prefix-state",
        help="precise vs approximate prefix state live: prediction error, hit rate, p95s",
        description="The same slice of the trace on two live stacks: one whose router "
        "follows the engines' KV cache events (precise prefix state), one that tracks its "
        "own dispatches (approximate); the cached-token prediction error, the hit rate and "
        "the p95 TTFT and E2E of each (docs/benchmarks.md).",
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument("--start-s", type=float, default=600.0, help="slice start (trace time)")
    b.add_argument("--duration-s", type=float, default=120.0, help="slice length")
    b.add_argument("--limit", type=int, default=None, help="at most this many requests")
    b.add_argument("--time-scale", type=float, default=1.0, help="2 = half the trace's rate")
    b.add_argument("--out", default="out/bench", help="result files")
    b.add_argument(
        "--front-doors",
        type=int,
        default=1,
        metavar="N",
        help="the precise fleet's front doors: an Envoy and a router in each of the first N "
        "regions, all on the engines' events, each conversation through one of them",
    )
    b.add_argument(
        "--engine",
        choices=["twin", "vllm"],
        default="twin",
        help="the engines: the emulated twins, or real vLLM (the tiny model; make vllm)",
    )
    b.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help="leave out longer trace requests (real vLLM here serves 4,096-token contexts)",
    )
    b.add_argument(
        "--only",
        choices=["precise", "approximate"],
        default=None,
        help="run one fleet only (default: both, and their ratios)",
    )
    b.set_defaults(func=_prefix_state)


def _load(args: argparse.Namespace) -> int:
    from loadgen.bench.live.load import run_load_bench

    return run_load_bench(args.streams, args.duration_s)


def add_load(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "load",
        help="concurrent streams through one router: errors, CPU, memory",
        description="Many concurrent streams through Envoy and one router for a while: the "
        "errors (it exits 1 on any), the router's CPU and memory per request "
        "(docs/benchmarks.md).",
    )
    b.add_argument("--streams", type=int, default=200, help="concurrent streams")
    b.add_argument("--duration-s", type=float, default=60.0, help="how long they run")
    b.set_defaults(func=_load)


def _routers(args: argparse.Namespace) -> int:
    from loadgen.bench.live.routers import run_routers_bench

    return run_routers_bench(args.routers, args.concurrency, args.duration_s)


def add_routers(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "routers",
        help="requests/s with several router processes behind one Envoy vs one",
        description="Requests per second, and each router process's CPU per 1,000 "
        "requests, with one router and with N behind one Envoy, in four alternating rounds "
        "on zero-delay engines.",
    )
    b.add_argument("--routers", type=int, default=2, help="router processes, N")
    b.add_argument("--concurrency", type=int, default=32, help="clients in flight")
    b.add_argument("--duration-s", type=float, default=20.0, help="per round (4 rounds)")
    b.set_defaults(func=_routers)


def _path(args: argparse.Namespace) -> int:
    from loadgen.bench.live.path import run_path_bench

    return run_path_bench(args.requests)


def add_path(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "path",
        help="where a request's time goes in the router: CPU per step (cProfile)",
        description="Where a request's CPU goes in the router: the floor (the same gRPC "
        "streams, nothing done), tracing off and on, and step by step from a cProfile of a "
        "live gorgo serve --profile, per prompt size.",
    )
    b.add_argument("--requests", type=int, default=300, help="requests per prompt size")
    b.set_defaults(func=_path)


def _page(args: argparse.Namespace) -> int:
    from loadgen.bench.live.page import run_page_bench

    return run_page_bench(args.streams, args.phase_s, args.requests)


def add_page(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "page",
        help="the operator page: render time in headless Chromium, and the router's decide, "
        "overhead and load figures with the page closed and open",
        description="The operator's page (/ui) of a live stack in headless Chromium: how "
        "long it takes to render, and the router's decision latency, overhead and load "
        "figures with the page closed and open.",
    )
    b.add_argument("--streams", type=int, default=200, help="concurrent streams of the load phases")
    b.add_argument("--phase-s", type=float, default=20.0, help="length of each load phase")
    b.add_argument("--requests", type=int, default=200, help="pairs per overhead phase")
    b.set_defaults(func=_page)


def _engine(args: argparse.Namespace) -> int:
    from loadgen.bench.live.engine import run_engine_bench

    return run_engine_bench(args.streams, args.output_tokens, args.prompt_tokens)


def add_engine(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "engine",
        help="live engine: emission lag vs the model, CPU per token",
        description="One emulated engine process under concurrent streams: how late its "
        "tokens leave against the engine model's schedule, and its CPU per token.",
    )
    b.add_argument("--streams", type=int, default=64, help="concurrent streams")
    b.add_argument("--output-tokens", type=int, default=256, help="tokens each stream asks for")
    b.add_argument("--prompt-tokens", type=int, default=1024, help="each prompt's length")
    b.set_defaults(func=_engine)


def _screenshot(args: argparse.Namespace) -> int:
    from loadgen.bench.live.screenshot import OUT, run_screenshot

    return run_screenshot(Path(args.path) if args.path else OUT)


def add_screenshot(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "screenshot",
        help="the operator's page of a fresh local stack after a few hundred chats, as a PNG "
        "(headless Chromium; make screenshot)",
        description="`make screenshot`: a fresh local stack, a few hundred chats through it, "
        "then the operator's page (/ui) in headless Chromium, saved as a PNG.",
    )
    b.add_argument("path", nargs="?", help="where to write it (default docs/img/operator-page.png)")
    b.set_defaults(func=_screenshot)


def _peers(args: argparse.Namespace) -> int:
    from loadgen.bench.peers.run import RivalsOptions, run_rivals_bench

    return run_rivals_bench(
        RivalsOptions(
            trace=args.trace,
            start_s=args.start_s,
            duration_s=args.duration_s,
            time_scale=args.time_scale,
            repeat=args.repeat,
            rtt_profile=args.rtt_profile,
            fronts=tuple(f.strip() for f in args.fronts.split(",") if f.strip()),
            out=args.out,
            classes=args.classes,
            pd=args.pd,
            pd_protocol=args.pd_protocol,
            kv_link_gbps=args.kv_link_gbps,
        )
    )


def add_peers(bench: Any, policies: Sequence[str]) -> None:
    from emulator.rivals.fronts import DEFAULT_FRONTS

    b = bench.add_parser(
        "peers",
        help="gorgo against SMG and vllm-router, live on the same emulated fleet (make peers)",
        description="Each front door in turn (gorgo with shipped defaults, the rival routers "
        "with the flags of emulator/rivals/fronts.py) in front of a fresh emulated fleet behind "
        "WAN links, the same trace window replayed open loop through each; TTFT, E2E, "
        "failures, cache hit rate, the router's CPU per request and RSS (docs/results.md, "
        '"Against the routers users deploy").',
    )
    b.add_argument("trace", help="Mooncake or ART-Chat JSONL trace, or paper-synthetic[:SEED]")
    b.add_argument("--start-s", type=float, default=0.0, help="window start (trace time)")
    b.add_argument("--duration-s", type=float, default=60.0, help="window length (trace time)")
    b.add_argument("--time-scale", type=float, default=3.0, help="2 = half the trace's rate")
    b.add_argument("--repeat", type=int, default=1, help="rounds, order reversed every other")
    b.add_argument(
        "--rtt-profile",
        default="network",
        help="WAN delays: network, paper, or single (every backend 1 ms away)",
    )
    b.add_argument(
        "--fronts",
        default=",".join(DEFAULT_FRONTS),
        help="comma-separated: gorgo and emulator/rivals/fronts.py's names",
    )
    b.add_argument("--out", help='write {"fronts": {NAME: SUMMARY}} here, a plot beside it')
    b.add_argument(
        "--classes",
        help="request classes (gorgo simulate --classes' YAML): gorgo with flow control and "
        "these objectives, SMG with its priority scheduler (x-smg-priority by rank); per "
        "class SLO attainment and goodput",
    )
    b.add_argument(
        "--pd",
        action="store_true",
        help="each front on a fresh P/D fleet (gorgo up --pd's twins and KV links): gorgo "
        "as its Envoy front door, the rivals in their P/D modes (--fronts gorgo,smg:pd,"
        "vllm-router:pd), each rival on its protocol's twins; per front, where its "
        "prefill and decode legs went",
    )
    b.add_argument(
        "--pd-protocol",
        choices=["sglang", "vllm"],
        default=None,
        help="with --pd: every fleet's twins speak this (a rival that does not is an "
        "error); default: gorgo runs once on each protocol a rival speaks, beside it",
    )
    b.add_argument(
        "--kv-link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="with --pd: each KV link's bandwidth in Gbit/s, 0 unlimited (default 10)",
    )
    b.set_defaults(func=_peers)


PARSERS = (
    add_overhead,
    add_peers,
    add_parity,
    add_live,
    add_prefix_state,
    add_load,
    add_routers,
    add_path,
    add_page,
    add_engine,
    add_screenshot,
)
