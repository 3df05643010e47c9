"""The `gorgo` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from ext_proc.config import ConfigError, load_config, split_host_port


def _serve(args: argparse.Namespace) -> int:
    from ext_proc.app import running_service

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"gorgo serve: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with running_service(cfg) as svc:
            print(
                f"gorgo serve: ready. ext_proc gRPC on {cfg.listen.grpc.rpartition(':')[0]}:"
                f"{svc.grpc_port}, admin http://{cfg.listen.admin.rpartition(':')[0]}:"
                f"{svc.admin_port}/state, policy {cfg.policy}, "
                f"backends {', '.join(cfg.backend_ids)}",
                flush=True,
            )
            await stop.wait()

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"gorgo serve: {e}", file=sys.stderr)
        return 1
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    from ext_proc.envoy_config import render_envoy_config, render_mesh_snippet

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"gorgo envoy-config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_mesh_snippet(cfg) if args.mesh_snippet else render_envoy_config(cfg))
    return 0


def _engine(args: argparse.Namespace) -> int:
    from emulator.engine import EngineConfig, Faults, serve_engine, zero_delay_profile
    from ext_proc.profile import load_profile, profile_from_dict
    from ext_proc.tokens import load_tokenizer

    try:
        profile = load_profile(args.profile)
        if args.set:
            raw = {**vars(profile), **_key_values(args.set, "--set")}
            profile = profile_from_dict(raw, f"{args.profile} with --set")
        if args.zero_delay:
            profile = zero_delay_profile(profile)
        cfg = EngineConfig(
            name=args.name,
            profile=profile,
            seed=args.seed,
            tokenizer=load_tokenizer(args.tokenizer),
            faults=Faults(args.error_rate, args.stall_rate, args.stall_ms),
        )
    except ValueError as e:
        print(f"gorgo engine: {e}", file=sys.stderr)
        return 2
    return _run_forever(serve_engine(cfg, args.host, args.port))


def _key_values(items: Sequence[str], flag: str) -> dict[str, Any]:
    """KEY=VALUE pairs, values parsed as YAML scalars (numbers stay numbers)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML reads "1e6" as a string; a number was meant
            with contextlib.suppress(ValueError):
                parsed = float(parsed)
        out[key] = parsed
    return out


def _wan(args: argparse.Namespace) -> int:
    from emulator.wan import DelaySettings, SettingError, rtt_profile_ms, serve_wan

    def usage_error(message: object) -> int:
        print(f"gorgo wan: {message}", file=sys.stderr)
        return 2

    try:
        lhost, lport = split_host_port(args.listen, "--listen")
        thost, tport = split_host_port(args.target, "--target")
    except ConfigError as e:
        return usage_error(e)
    # argparse makes --rtt-ms and --profile exclusive and requires one; the rest is here.
    if args.profile is not None:
        if args.region is None:
            return usage_error("--region is required with --profile")
        if args.jitter_ms is not None:
            return usage_error("--jitter-ms goes with --rtt-ms; --profile sets its own jitter")
        try:
            rtt_ms, jitter_ms = rtt_profile_ms(args.profile, args.region)
        except ValueError as e:
            return usage_error(f"--region: {e}")
    else:
        if args.region is not None:
            return usage_error("--region goes with --profile, not --rtt-ms")
        rtt_ms, jitter_ms = args.rtt_ms, args.jitter_ms or 0.0
    try:
        DelaySettings(rtt_ms, jitter_ms, args.spike_probability, args.spike_ms)
    except SettingError as e:
        return usage_error(f"--{e.key.replace('_', '-')} {e.problem}")
    if not 0 <= args.control_port <= 65535:
        return usage_error(f"--control-port must be in 0..65535, got {args.control_port}")
    return _run_forever(
        serve_wan(
            lhost,
            lport,
            thost,
            tport,
            rtt_ms,
            jitter_ms=jitter_ms,
            seed=args.seed,
            spike_probability=args.spike_probability,
            spike_ms=args.spike_ms,
            control_port=args.control_port,
        )
    )


def _run_forever(coro: Coroutine[Any, Any, None]) -> int:
    async def main() -> None:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"gorgo: {e}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from emulator.stack import StackSettings, regions_for_profile, run_until_signalled

    regions = regions_for_profile(args.rtt_profile)
    return run_until_signalled(
        StackSettings(policy=args.policy, regions=regions, rtt_profile=args.rtt_profile)
    )


def _demo(args: argparse.Namespace) -> int:
    from loadgen.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, policy=args.policy)


def _bench_overhead(args: argparse.Namespace) -> int:
    from loadgen.bench_overhead import run_overhead_bench

    return run_overhead_bench(requests=args.requests)


def _replay(args: argparse.Namespace) -> int:
    from loadgen.replay import ReplayOptions, run_replay

    return run_replay(
        ReplayOptions(
            trace=args.trace,
            url=args.url,
            api=args.api,
            time_scale=args.time_scale,
            max_concurrency=args.max_concurrency,
            start_s=args.start_s,
            duration_s=args.duration_s,
            limit=args.limit,
            out=args.out,
            csv=args.csv,
            plot=args.plot,
            timeout_s=args.timeout_s,
            progress=not args.quiet,
        )
    )


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadgen.sim_cli import run_simulate_command
    from loadgen.simulate import SimSettings
    from loadgen.traces import TraceError, read_trace

    try:
        trace = read_trace(args.trace)
        base = SimSettings(
            rtt_profile=args.rtt_profile,
            engine_profile=args.engine_profile,
            seed=args.seed,
            tune=args.tune,
        )
        base.config()  # validates the profiles before hours of simulation
    except (TraceError, ValueError) as e:
        print(f"gorgo simulate: {e}", file=sys.stderr)
        return 2
    return run_simulate_command(
        trace,
        args.policy or ["gorgo"],
        args.time_scale or [1.0],
        Path(args.out),
        base,
        args.start_s,
        args.duration_s,
        args.limit,
        str(args.trace),
    )


def _bench_results(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadgen.bench_results import run_results_bench

    return run_results_bench(args.trace, Path(args.out), Path(args.img), Path(args.work))


def _bench_parity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadgen.bench_live import run_parity

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


def _bench_live(args: argparse.Namespace) -> int:
    from loadgen.bench_live import run_live_side_by_side

    return run_live_side_by_side(
        args.trace,
        args.policy or ["gorgo", "least_request", "session_affinity", "prefix_cache"],
        args.start_s,
        args.duration_s,
        args.time_scale,
    )


def _bench_load(args: argparse.Namespace) -> int:
    from loadgen.bench_load import run_load_bench

    return run_load_bench(args.streams, args.duration_s)


def _bench_decide(args: argparse.Namespace) -> int:
    from loadgen.bench_decide import run_decide_bench

    return run_decide_bench(args.iterations)


def _bench_engine(args: argparse.Namespace) -> int:
    from loadgen.bench_engine import run_engine_bench

    return run_engine_bench(args.streams, args.output_tokens, args.prompt_tokens)


def _bench_engine_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from emulator.calibrate import run_calibration

    return run_calibration(args.profile, Path(args.out), args.requests)


# The conversation trace beside the checkout (shared/ sits next to the project).
DEFAULT_TRACE = "../shared/traces/mooncake-fast25/conversation_trace.jsonl"


def build_parser() -> argparse.ArgumentParser:
    from ext_proc.policy import POLICIES

    policies = sorted(POLICIES)
    p = argparse.ArgumentParser(
        prog="gorgo", description="GORGO: TTFT-aware Envoy ext_proc router for LLM fleets"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the ext_proc gRPC service and admin HTTP")
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.set_defaults(func=_serve)

    s = sub.add_parser("envoy-config", help="print the Envoy front-door config for a gorgo config")
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.add_argument(
        "--mesh-snippet",
        action="store_true",
        help="print only the router's fragments, to paste into an existing Envoy",
    )
    s.set_defaults(func=_envoy_config)

    s = sub.add_parser(
        "engine",
        help="run one emulated SGLang engine",
        description="An emulated SGLang engine: OpenAI and native wire format, timed by the "
        "engine model (continuous batching, chunked prefill, radix prefix cache). Profiles: "
        "built-in names from ext_proc/profiles/ (default l40s-qwen3.5-35b-a3b-fp8: 2x L40S, "
        "Qwen3.5-35B-A3B FP8) or a YAML file; docs/engine-model.md explains the constants. "
        "Faults can also be changed at run time: POST /faults with the same names.",
    )
    s.add_argument("--name", required=True, help="backend id reported by the engine")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--profile", default="l40s-qwen3.5-35b-a3b-fp8", help="profile name or YAML")
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one profile constant (repeatable), e.g. --set prefill_tokens_per_s=1e6",
    )
    s.add_argument("--seed", type=int, default=0, help="seeds step jitter and fault draws")
    s.add_argument("--tokenizer", default="", help="local tokenizer.json (default: 4 bytes/token)")
    s.add_argument("--zero-delay", action="store_true", help="every step takes no time")
    s.add_argument("--error-rate", type=float, default=0.0, help="share answered with HTTP 500")
    s.add_argument("--stall-rate", type=float, default=0.0, help="share held before scheduling")
    s.add_argument("--stall-ms", type=float, default=0.0, help="how long a stalled request waits")
    s.set_defaults(func=_engine)

    from emulator.wan import RTT_PROFILES

    profiles_help = "; ".join(
        f"{name}: "
        + ", ".join(f"{region} {mean:g}+-{std:g}" for region, (mean, std) in rtts.items())
        for name, rtts in RTT_PROFILES.items()
    )
    s = sub.add_parser(
        "wan",
        help="run a TCP link that delays each direction by RTT/2",
        description="A TCP proxy that delays each chunk of bytes by half an RTT sample "
        "(lognormal, mean and std as given, plus rare spikes), keeping byte order.",
    )
    s.add_argument("--listen", required=True, help="host:port to accept on")
    s.add_argument("--target", required=True, help="host:port to forward to")
    rtt = s.add_mutually_exclusive_group(required=True)
    rtt.add_argument("--rtt-ms", type=float, metavar="MS", help="mean round-trip time to add")
    rtt.add_argument(
        "--profile",
        choices=sorted(RTT_PROFILES),
        help="take the RTT of --region from a named profile (RTT mean+-std in ms; "
        f"{profiles_help})",
    )
    s.add_argument("--region", metavar="ID", help="region id in --profile (required with it)")
    s.add_argument(
        "--jitter-ms",
        type=float,
        metavar="MS",
        help="std of the lognormal RTT samples, with --rtt-ms (default 0: constant)",
    )
    s.add_argument("--seed", type=int, metavar="N", help="seed the delay samples (repeatable)")
    s.add_argument(
        "--spike-probability",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per chunk of bytes that a delay spike hits, 0..1 (default 0: none)",
    )
    s.add_argument(
        "--spike-ms", type=float, default=0.0, metavar="MS", help="RTT added when a spike hits"
    )
    s.add_argument(
        "--control-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve GET/POST /rtt on 127.0.0.1:PORT to read or change rtt_ms, jitter_ms, "
        "spike_probability and spike_ms at run time (default 0: off)",
    )
    s.set_defaults(func=_wan)

    s = sub.add_parser("up", help="run the whole local stack (Envoy, gorgo, 3 regions)")
    s.add_argument("--policy", default="gorgo", choices=policies)
    s.add_argument(
        "--rtt-profile",
        default="network",
        choices=["network", "paper"],
        help="WAN delays: network = 1/90/180 ms, paper = 37/279/456 ms (with jitter)",
    )
    s.set_defaults(func=_up)

    s = sub.add_parser("demo", help="start the local stack, send requests, print a table")
    s.add_argument("--requests", type=int, default=100)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--policy", default="gorgo", choices=policies)
    s.set_defaults(func=_demo)

    s = sub.add_parser(
        "replay",
        help="replay a trace live against an OpenAI endpoint (open loop)",
        description="Send a trace's requests at their arrival times (times --time-scale), "
        "streaming, whether or not earlier ones finished; only --max-concurrency holds a "
        "request back, and how late it went out (slip) is recorded. Mooncake rows get "
        "synthesized prompts of their exact token counts; ART-Chat rows send their own "
        "body. Exit code 1 if every request failed, 2 for a bad trace or option.",
    )
    s.add_argument("trace", help="Mooncake or ART-Chat JSONL trace")
    s.add_argument("--url", required=True, help="endpoint, e.g. http://127.0.0.1:10000")
    s.add_argument(
        "--api",
        default="completions",
        choices=["completions", "chat"],
        help="Mooncake rows go to /v1/completions or /v1/chat/completions",
    )
    s.add_argument("--time-scale", type=float, default=1.0, metavar="X", help="2 = half the rate")
    s.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        metavar="N",
        help="at most N requests in flight; later arrivals wait (slip)",
    )
    s.add_argument("--start-s", type=float, default=0.0, help="window start (trace time)")
    s.add_argument("--duration-s", type=float, default=None, help="window length (trace time)")
    s.add_argument("--limit", type=int, default=None, help="at most this many requests")
    s.add_argument("--out", metavar="FILE.json", help="result file (the shared schema)")
    s.add_argument("--csv", metavar="FILE.csv", help="one row per request")
    s.add_argument("--plot", metavar="FILE.png", help="TTFT CDF and TTFT over time")
    s.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    s.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    s.set_defaults(func=_replay)

    s = sub.add_parser(
        "simulate",
        help="replay a trace offline on a virtual clock, policies side by side",
        description="The same router and engine model as the live fleet, on a virtual "
        "clock: one result file per policy and time_scale, summary.md and figures in --out.",
    )
    s.add_argument("trace", help="Mooncake or ART-Chat JSONL trace")
    s.add_argument("--policy", action="append", choices=policies, help="repeatable")
    s.add_argument(
        "--time-scale", action="append", type=float, help="repeatable; 2 = half the rate"
    )
    s.add_argument("--rtt-profile", default="network", choices=["network", "paper"])
    s.add_argument("--engine-profile", default="l40s-qwen3.5-35b-a3b-fp8")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--start-s", type=float, default=0.0, help="window start (trace time)")
    s.add_argument("--duration-s", type=float, default=None, help="window length")
    s.add_argument("--limit", type=int, default=None, help="at most this many requests")
    s.add_argument("--out", default="out/sim", help="output directory")
    s.add_argument(
        "--tune",
        default="off",
        choices=["off", "paired", "paper"],
        help="tune gorgo's weights online while simulating; writes a convergence plot",
    )
    s.set_defaults(func=_simulate)

    s = sub.add_parser("bench", help="benchmarks")
    bench = s.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bench.add_parser("overhead", help="Envoy alone vs Envoy + gorgo ext_proc")
    b.add_argument("--requests", type=int, default=500, help="requests per measurement")
    b.set_defaults(func=_bench_overhead)
    b = bench.add_parser("results", help="the paper's experiment in the simulator")
    b.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake conversation trace")
    b.add_argument("--out", default="docs/results.md")
    b.add_argument("--img", default="docs/img")
    b.add_argument("--work", default="out/bench", help="result files of every run")
    b.set_defaults(func=_bench_results)
    for name, func, help_text, duration in (
        ("parity", _bench_parity, "live replay vs simulator on one slice", 300.0),
        ("live", _bench_live, "policies side by side on isolated live fleets", 120.0),
    ):
        b = bench.add_parser(name, help=help_text)
        b.add_argument("--trace", default=DEFAULT_TRACE)
        b.add_argument("--policy", action="append", choices=policies, help="repeatable")
        b.add_argument("--start-s", type=float, default=600.0, help="slice start (trace time)")
        b.add_argument("--duration-s", type=float, default=duration, help="slice length")
        b.add_argument("--time-scale", type=float, default=1.0)
        if name == "parity":
            b.add_argument("--results", default="docs/results.md", help="where to write it")
            b.add_argument("--work", default="out/bench", help="result files")
            b.add_argument(
                "--reuse-live",
                action="store_true",
                help="reuse the live result files in --work (only re-simulate)",
            )
        b.set_defaults(func=func)
    b = bench.add_parser("load", help="concurrent streams through one router: errors, CPU, memory")
    b.add_argument("--streams", type=int, default=200)
    b.add_argument("--duration-s", type=float, default=60.0)
    b.set_defaults(func=_bench_load)
    b = bench.add_parser("decide", help="decision latency and prefix-index memory")
    b.add_argument("--iterations", type=int, default=300, help="decisions per measurement")
    b.set_defaults(func=_bench_decide)
    b = bench.add_parser("engine", help="live engine: emission lag vs the model, CPU per token")
    b.add_argument("--streams", type=int, default=64)
    b.add_argument("--output-tokens", type=int, default=256)
    b.add_argument("--prompt-tokens", type=int, default=1024)
    b.set_defaults(func=_bench_engine)
    b = bench.add_parser("engine-model", help="engine model vs calibration targets, figures")
    b.add_argument("--profile", default="l40s-qwen3.5-35b-a3b-fp8")
    b.add_argument("--requests", type=int, default=600, help="requests per load point")
    b.add_argument("--out", default="docs/img", help="directory for the PNG figures")
    b.set_defaults(func=_bench_engine_model)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
