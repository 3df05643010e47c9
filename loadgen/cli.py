"""The load generator's `gorgo` subcommands (`demo`, `replay`, `simulate`, `bench ...`),
contributed to the router's command line through the `gorgo.commands` entry-point group:
the router never imports the load generator.
"""

from __future__ import annotations

import argparse
import sys

from ext_proc.cli import Commands
from ext_proc.vocab.backend import DEFAULT_PROFILE

# The conversation trace beside the checkout (shared/ sits next to the project).
DEFAULT_TRACE = "../shared/traces/mooncake-fast25/conversation_trace.jsonl"


def _demo(args: argparse.Namespace) -> int:
    from loadgen.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, policy=args.policy)


def _bench_overhead(args: argparse.Namespace) -> int:
    from loadgen.bench_overhead import run_overhead_bench

    return run_overhead_bench(requests=args.requests, long_only=args.long_prompts)


def _replay(args: argparse.Namespace) -> int:
    from loadgen.replay import ReplayOptions, run_replay

    return run_replay(
        ReplayOptions(
            trace=args.trace,
            url=args.url,
            api=args.api,
            time_scale=args.time_scale,
            protocol=args.protocol,
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            max_input_tokens=args.max_input_tokens,
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


def _shares(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 0.5,0.3,0.2, got {text!r}"
        ) from None


def _weights(text: str) -> tuple[float, float]:
    """--weights RTT,QUEUE: gorgo's two weights, both positive (its parameters' bounds)."""
    try:
        rtt, queue = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RTT,QUEUE like 1,0.5, got {text!r}") from None
    if not (rtt > 0 and queue > 0):  # also refuses nan
        raise argparse.ArgumentTypeError(f"both weights must be > 0, got {text!r}")
    return rtt, queue


def _sim_router(args: argparse.Namespace) -> dict[str, object]:
    """The router config the simulate flags add (merged into the generated one)."""
    router: dict[str, object] = {}
    if args.weights is not None:
        rtt, queue = args.weights
        router["policies"] = {"gorgo": {"weights": {"rtt": rtt, "queue": queue}}}
    if args.no_learn:
        router["routing"] = {"learn_latency": False}
    return router


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from emulator.fleet import NO_FLEET, load_fleet
    from emulator.stack import DEFAULT_REGIONS
    from loadgen.protocol import protocol_for
    from loadgen.sim_cli import run_simulate_command
    from loadgen.simulate import SimSettings
    from loadgen.traces import TraceError, load_trace

    if args.router_knows_fleet and args.fleet is None:
        print("gorgo simulate: --router-knows-fleet needs --fleet", file=sys.stderr)
        return 2
    try:
        regions = [r.id for r in DEFAULT_REGIONS]
        fleet = NO_FLEET if args.fleet is None else load_fleet(args.fleet, regions)
        protocol = protocol_for(
            args.protocol,
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            max_input_tokens=args.max_input_tokens,
        )
        trace = load_trace(args.trace)
        base = SimSettings(
            rtt_profile=args.rtt_profile,
            engine_profile=args.engine_profile,
            seed=args.seed,
            tune=args.tune,
            prefix_state=args.prefix_state,
            routers=args.routers,
            engine_reports=args.engine_reports,
            front_doors=args.front_doors,
            origin_shares=args.origin_shares or (),
            share_dispatches=args.share_dispatches,
            protocol=protocol,
            router=_sim_router(args),
            fleet=fleet,
            router_knows_fleet=args.router_knows_fleet,
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
        args.spread_arrivals,
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
    if args.fleet:
        from pathlib import Path

        from loadgen.bench_fleet_live import run_fleet_live

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
    from loadgen.bench_live import run_live_side_by_side

    return run_live_side_by_side(
        args.trace,
        args.policy or ["gorgo", "least_request", "session_affinity", "prefix_cache"],
        args.start_s,
        120.0 if args.duration_s is None else args.duration_s,
        args.time_scale,
    )


def _bench_prefix(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loadgen.bench_prefix import Fleet, run_prefix_bench

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


def _bench_load(args: argparse.Namespace) -> int:
    from loadgen.bench_load import run_load_bench

    return run_load_bench(args.streams, args.duration_s)


def _bench_path(args: argparse.Namespace) -> int:
    from loadgen.bench_path import run_path_bench

    return run_path_bench(args.requests)


def _bench_routers(args: argparse.Namespace) -> int:
    from loadgen.bench_routers import run_routers_bench

    return run_routers_bench(args.routers, args.concurrency, args.duration_s)


def _bench_page(args: argparse.Namespace) -> int:
    from loadgen.bench_page import run_page_bench

    return run_page_bench(args.streams, args.phase_s, args.requests)


def _bench_decide(args: argparse.Namespace) -> int:
    from loadgen.bench_decide import run_decide_bench

    return run_decide_bench(args.iterations)


def _bench_kv_burst(args: argparse.Namespace) -> int:
    from loadgen.bench_kv_burst import run_kv_burst_bench

    return run_kv_burst_bench(args.bursts, args.idle_s)


def _bench_tuner(args: argparse.Namespace) -> int:
    from loadgen.bench_tuner_report import run_tuner_bench

    return run_tuner_bench(
        args.trace,
        args.time_scale,
        args.change_at_s,
        args.seeds,
        args.convergence,
        args.paper_regime,
    )


def _bench_target(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from loadgen.bench_target import CONVERSATION, SYNTHETIC
    from loadgen.bench_target_report import run_target_bench

    return run_target_bench(
        args.trace,
        args.workload or [CONVERSATION, SYNTHETIC],
        args.start_s,
        args.duration_s,
        args.rtt_profile or ["network", "paper"],
        args.protocol or ["open", "paper"],
        args.time_scale,
        args.extra or [],
        Path(args.work),
        Path(args.out) if args.out else None,
        args.jobs,
        args.reuse,
        args.rerun or [],
        args.seed,
        "gorgo " + shlex.join(sys.argv[1:]),
        not args.no_run,
        args.engine_profile,
    )


def _bench_engine(args: argparse.Namespace) -> int:
    from loadgen.bench_engine import run_engine_bench

    return run_engine_bench(args.streams, args.output_tokens, args.prompt_tokens)


TRACE_HELP = (
    "Mooncake or ART-Chat JSONL trace, or paper-synthetic[:SEED]: a generated window "
    "shaped like the GORGO paper's (docs/benchmarks.md)"
)


def _add_protocol(s: argparse.ArgumentParser, open_cap: str) -> None:
    """The client protocol's flags, the same for replay and simulate (loadgen.protocol)."""
    s.add_argument(
        "--protocol",
        default="open",
        choices=["open", "paper"],
        help="client protocol preset: open (no caps) or paper (--max-concurrency 64 "
        "--max-tokens 128 --max-input-tokens 24000, the GORGO paper's client); the flags "
        "below override it",
    )
    s.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests in flight; an arrival that finds all taken waits for one "
        f"(first come, first served), recorded as its slip; TTFT from dispatch ({open_cap})",
    )
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="set every request's output length to N tokens",
    )
    s.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        metavar="N",
        help="drop requests whose prompt is over N tokens before the run (counted)",
    )


def add_commands(commands: Commands) -> None:
    sub = commands.sub
    policies = commands.policies
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
    s.add_argument("trace", help=TRACE_HELP)
    s.add_argument("--url", required=True, help="endpoint, e.g. http://127.0.0.1:10000")
    s.add_argument(
        "--api",
        default="completions",
        choices=["completions", "chat"],
        help="Mooncake rows go to /v1/completions or /v1/chat/completions",
    )
    s.add_argument("--time-scale", type=float, default=1.0, metavar="X", help="2 = half the rate")
    _add_protocol(s, "open protocol: 256, the connection pool")
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
    s.add_argument("trace", help=TRACE_HELP)
    s.add_argument("--policy", action="append", choices=policies, help="repeatable")
    s.add_argument(
        "--time-scale", action="append", type=float, help="repeatable; 2 = half the rate"
    )
    s.add_argument("--rtt-profile", default="network", choices=["network", "paper"])
    s.add_argument("--engine-profile", default=DEFAULT_PROFILE)
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
    s.add_argument(
        "--prefix-state",
        default="approximate",
        choices=["approximate", "precise"],
        help="the router's prefix state: its own estimate, or the engines' own cache changes "
        "(as their KV events would deliver them)",
    )
    s.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="routers deciding side by side, each session through one of them (with "
        "--prefix-state precise they share the engines' view; else each knows its own)",
    )
    s.add_argument(
        "--engine-reports",
        action="store_true",
        help="the routers read the engines' own load reports (/metrics) every "
        "probes.metrics_interval_s, as the live ones do",
    )
    s.add_argument(
        "--front-doors",
        type=int,
        default=0,
        metavar="N",
        help="a front door (Envoy + router) in each of the first N regions; sessions come "
        "from every region and enter their own region's door (1: the single proxy, its "
        "clients spread over the regions; 0, the default: the paper's single proxy with its "
        "clients beside it). Results per region",
    )
    s.add_argument(
        "--spread-arrivals",
        type=float,
        default=0.0,
        metavar="S",
        help="spread each arrival over [t, t + S) (the conversation trace stamps arrivals in "
        "3 s steps); 0: as stamped",
    )
    s.add_argument(
        "--share-dispatches",
        action="store_true",
        help="the routers tell each other their dispatches (live: over NATS, fleet.nats_url)",
    )
    s.add_argument(
        "--origin-shares",
        type=_shares,
        default=None,
        metavar="A,B,C",
        help="share of sessions from each region (with --front-doors; default equal)",
    )
    s.add_argument(
        "--fleet",
        metavar="FLEET.yaml",
        help="each region's engine profile, the engines' truth (emulator/fleet.py, "
        "docs/engine-model.md); the router keeps --engine-profile for every backend",
    )
    s.add_argument(
        "--router-knows-fleet",
        action="store_true",
        help="with --fleet: tell the router each engine's true profile (the reference)",
    )
    s.add_argument(
        "--weights",
        type=_weights,
        default=None,
        metavar="RTT,QUEUE",
        help="gorgo's starting weights (static with --tune off); default the policy's (1,1)",
    )
    s.add_argument(
        "--no-learn",
        action="store_true",
        help="the router keeps its profiles as they are: no learned speed per backend "
        "(routing.learn_latency false)",
    )
    _add_protocol(s, "open protocol: no cap")
    s.set_defaults(func=_simulate)

    bench = commands.bench()
    b = bench.add_parser("overhead", help="Envoy alone vs Envoy + gorgo ext_proc")
    b.add_argument("--requests", type=int, default=500, help="requests per measurement")
    b.add_argument(
        "--long-prompts",
        action="store_true",
        help="only 128k-token prompts from 32 concurrent clients (requests/2 per phase, >= 64)",
    )
    b.set_defaults(func=_bench_overhead)
    b = bench.add_parser("results", help="the paper's experiment in the simulator")
    b.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake conversation trace")
    b.add_argument("--out", default="docs/results.md")
    b.add_argument("--img", default="docs/img")
    b.add_argument("--work", default="out/bench", help="result files of every run")
    b.set_defaults(func=_bench_results)
    for name, func, help_text, duration in (
        ("parity", _bench_parity, "live replay vs simulator on one slice", 300.0),
        ("live", _bench_live, "policies side by side on isolated live fleets", None),
    ):
        b = bench.add_parser(name, help=help_text)
        b.add_argument("--trace", default=DEFAULT_TRACE)
        b.add_argument("--policy", action="append", choices=policies, help="repeatable")
        b.add_argument("--start-s", type=float, default=600.0, help="slice start (trace time)")
        b.add_argument(
            "--duration-s",
            type=float,
            default=duration,
            help="slice length"
            if duration
            else "slice length (default 120; with --fleet the rest of the trace, cut by --limit)",
        )
        b.add_argument("--time-scale", type=float, default=1.0)
        if name == "live":
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
        if name == "parity":
            b.add_argument("--results", default="docs/results.md", help="where to write it")
            b.add_argument("--work", default="out/bench", help="result files")
            b.add_argument(
                "--reuse-live",
                action="store_true",
                help="reuse the live result files in --work (only re-simulate)",
            )
        b.set_defaults(func=func)
    b = bench.add_parser(
        "prefix-state",
        help="precise vs approximate prefix state live: prediction error, hit rate, p95s",
    )
    b.add_argument("--trace", default=DEFAULT_TRACE)
    b.add_argument("--start-s", type=float, default=600.0, help="slice start (trace time)")
    b.add_argument("--duration-s", type=float, default=120.0, help="slice length")
    b.add_argument("--limit", type=int, default=None, help="at most this many requests")
    b.add_argument("--time-scale", type=float, default=1.0)
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
    b.set_defaults(func=_bench_prefix)
    b = bench.add_parser("load", help="concurrent streams through one router: errors, CPU, memory")
    b.add_argument("--streams", type=int, default=200)
    b.add_argument("--duration-s", type=float, default=60.0)
    b.set_defaults(func=_bench_load)
    b = bench.add_parser(
        "routers", help="requests/s with several router processes behind one Envoy vs one"
    )
    b.add_argument("--routers", type=int, default=2)
    b.add_argument("--concurrency", type=int, default=32)
    b.add_argument("--duration-s", type=float, default=20.0, help="per round (4 rounds)")
    b.set_defaults(func=_bench_routers)
    b = bench.add_parser(
        "path", help="where a request's time goes in the router: CPU per step (cProfile)"
    )
    b.add_argument("--requests", type=int, default=300, help="requests per prompt size")
    b.set_defaults(func=_bench_path)
    b = bench.add_parser(
        "page",
        help="the operator page: render time in headless Chromium, and the router's decide, "
        "overhead and load figures with the page closed and open",
    )
    b.add_argument("--streams", type=int, default=200, help="concurrent streams of the load phases")
    b.add_argument("--phase-s", type=float, default=20.0, help="length of each load phase")
    b.add_argument("--requests", type=int, default=200, help="pairs per overhead phase")
    b.set_defaults(func=_bench_page)
    b = bench.add_parser("tuner", help="the tuner through a regime change; false accepts")
    b.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake conversation trace")
    b.add_argument("--time-scale", type=float, default=6.0)
    b.add_argument("--change-at-s", type=float, default=600.0, help="trace time of the change")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
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
    b.set_defaults(func=_bench_tuner)
    b = bench.add_parser(
        "target",
        help="the target matrix: gorgo vs the best baseline per cell (p95 TTFT <= 0.8 x, "
        "E2E <= 1.0 x), with its floors",
        description="Every baseline and gorgo in each cell (workload window x RTT profile x "
        "protocol x time_scale); per cell the best baseline, gorgo's p95 TTFT and E2E "
        "ratios, whether it meets the target (<= 0.8 / <= 1.0), the no-queue and burst "
        "floors and two clairvoyant references, unbounded cache and the engines' real KV pool "
        "(loadgen/bench_target.py). Progress on "
        "stderr, the table on stdout and in --out.",
    )
    b.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake conversation trace")
    b.add_argument(
        "--workload",
        action="append",
        choices=["conversation", "synthetic"],
        help="repeatable; default both (conversation: the trace's windows; synthetic: "
        "paper-synthetic)",
    )
    b.add_argument(
        "--start-s",
        action="append",
        type=float,
        help="conversation window start, repeatable (default 0, 1200, 2400)",
    )
    b.add_argument("--duration-s", type=float, default=1200.0, help="conversation window length")
    b.add_argument("--rtt-profile", action="append", choices=["network", "paper"])
    b.add_argument("--protocol", action="append", choices=["open", "paper"])
    b.add_argument(
        "--time-scale",
        action="append",
        type=float,
        help="repeatable; default per workload and protocol (loadgen.bench_target.TIME_SCALES)",
    )
    b.add_argument("--extra", action="append", choices=policies, help="another policy's ratios too")
    b.add_argument(
        "--engine-profile",
        default=DEFAULT_PROFILE,
        help="every engine's profile (a built-in name or a YAML file): what the cells "
        "would be on other engines, e.g. a larger KV pool",
    )
    b.add_argument("--jobs", type=int, default=1, help="simulations in parallel")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--work", default="out/bench-target", help="result files, one per run")
    b.add_argument("--out", default="out/bench-target/target.md", help="the table ('' : none)")
    b.add_argument(
        "--reuse", action="store_true", help="read existing result files instead of running"
    )
    b.add_argument(
        "--rerun", action="append", metavar="POLICY", help="with --reuse: run this one anyway"
    )
    b.add_argument(
        "--no-run",
        action="store_true",
        help="only the table from the result files in --work (cells missing a run left out)",
    )
    b.set_defaults(func=_bench_target)
    b = bench.add_parser("decide", help="decision latency and prefix-index memory")
    b.add_argument("--iterations", type=int, default=300, help="decisions per measurement")
    b.set_defaults(func=_bench_decide)
    b = bench.add_parser(
        "kv-burst", help="decision latency while a 32k-event KV burst is applied (page size 1)"
    )
    b.add_argument("--bursts", type=int, default=8, help="32k-token prompts' bursts applied")
    b.add_argument("--idle-s", type=float, default=4.0, help="decisions measured with no events")
    b.set_defaults(func=_bench_kv_burst)
    b = bench.add_parser("engine", help="live engine: emission lag vs the model, CPU per token")
    b.add_argument("--streams", type=int, default=64)
    b.add_argument("--output-tokens", type=int, default=256)
    b.add_argument("--prompt-tokens", type=int, default=1024)
    b.set_defaults(func=_bench_engine)
