"""`gorgo simulate`'s parser and how its flags become SimSettings. Light: the simulator
is imported only when it runs, since every `gorgo` command, `gorgo serve` too, builds all
parsers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ext_proc.vocab.backend import DEFAULT_PROFILE
from loadgen.client.protocol import add_protocol_flags
from loadgen.sim.rivals.names import RIVAL_NAMES
from loadgen.traces.load import TRACE_HELP


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
    gorgo: dict[str, object] = {}
    if args.weights is not None:
        rtt, queue = args.weights
        gorgo["weights"] = {"rtt": rtt, "queue": queue}
    for key in ("local_threshold_tokens", "remote_margin_ms"):  # its P/D knobs
        if getattr(args, key, None) is not None:
            gorgo[key] = getattr(args, key)
    if gorgo:
        router["policies"] = {"gorgo": gorgo}
    routing: dict[str, object] = {}
    if args.no_learn:
        routing["learn_latency"] = False
    if args.ttft_model:
        routing["ttft_model"] = args.ttft_model
    if routing:
        router["routing"] = routing
    return router


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from emulator.engine.priority import PriorityScheduling
    from emulator.stack.fleet import NO_FLEET, load_fleet
    from emulator.stack.settings import DEFAULT_REGIONS
    from loadgen.client.protocol import protocol_for
    from loadgen.sim.classes import load_classes
    from loadgen.sim.run import run_simulate_command
    from loadgen.sim.settings import SimSettings
    from loadgen.traces.load import load_trace
    from loadgen.traces.request import TraceError

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
            request_max_tokens=args.request_max_tokens,
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
            flow_control=args.flow_control == "on",
            classes=None if args.classes is None else load_classes(args.classes),
            engine_priority=None
            if args.engine_priority == "off"
            else PriorityScheduling(
                low_values_first=args.engine_priority == "low-first",
                preemption_threshold=args.engine_preemption_threshold,
            ),
            pd=args.pd,
            pd_aggregated=args.pd_aggregated,
            kv_link_gbps=args.kv_link_gbps,
            local_kv_link_gbps=args.local_kv_link_gbps,
            pd_protocol=args.pd_protocol,
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


def add_simulate(sub: Any, policies: Sequence[str]) -> None:
    s = sub.add_parser(
        "simulate",
        help="replay a trace offline on a virtual clock, policies side by side",
        description="The same router and engine model as the live fleet, on a virtual "
        "clock: one result file per policy and time_scale, summary.md and figures in --out.",
    )
    s.add_argument("trace", help=TRACE_HELP)
    s.add_argument(
        "--policy",
        action="append",
        choices=[*policies, *RIVAL_NAMES],
        help="repeatable; the rival routers' rules too (loadgen/sim/rivals: smg_*, "
        "vllm_router_*, llmd_*, dynamo_kv; with --pd their P/D modes: *_pd)",
    )
    s.add_argument(
        "--time-scale", action="append", type=float, help="repeatable; 2 = half the rate"
    )
    s.add_argument(
        "--rtt-profile",
        default="network",
        choices=["network", "paper", "single"],
        help="WAN delays: network = 1/90/180 ms, paper = 37/279/456 ms, single = every "
        "backend 1 ms away (with jitter)",
    )
    s.add_argument(
        "--engine-profile", default=DEFAULT_PROFILE, help="every engine's profile: name or YAML"
    )
    s.add_argument("--seed", type=int, default=0, help="seeds the policies and the engines")
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
        "--front-doors, N behind each door; with --prefix-state precise they share the "
        "engines' view; else each knows its own)",
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
        "clients spread over the regions; 0: the paper's single proxy with its "
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
        help="the routers tell each other their dispatches (live: over NATS, bus.nats_url)",
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
        help="each region's engine profile, the engines' truth (emulator/stack/fleet.py, "
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
    s.add_argument(
        "--ttft-model",
        choices=["profile", "replay"],
        default=None,
        help="how the router estimates the wait and the prefill (routing.ttft_model; "
        "default the config's: profile)",
    )
    s.add_argument(
        "--flow-control",
        choices=["on", "off"],
        default="off",
        help="the router's gateway queue (flow_control.enabled): requests wait in the router "
        "until the backend chosen for them has room",
    )
    s.add_argument(
        "--classes",
        default=None,
        metavar="FILE",
        help="request classes: YAML of `objectives` (as in the router config, plus each one's "
        "`share` of the sessions) and optional `tenants` ({name, share}); see docs/results.md",
    )
    s.add_argument(
        "--engine-priority",
        choices=["off", "on", "low-first"],
        default="off",
        help="the engines' own priority scheduling (SGLang --enable-priority-scheduling; "
        "low-first: with --schedule-low-priority-values-first): each request carries its "
        "class's priority (--classes), and running requests of a class worse by more than "
        "the threshold are preempted",
    )
    s.add_argument(
        "--engine-preemption-threshold",
        type=int,
        default=10,
        help="with --engine-priority: SGLang's --priority-scheduling-preemption-threshold "
        "(default 10, SGLang's)",
    )
    pd = s.add_mutually_exclusive_group()
    pd.add_argument(
        "--pd",
        action="store_true",
        help="prefill and decode apart: each region a prefill engine ({region}-prefill) and "
        "a decode engine, the prompt's KV between them over --kv-link-gbps (docs/results.md)",
    )
    pd.add_argument(
        "--pd-aggregated",
        action="store_true",
        help="the same engines as --pd, two per region, each taking requests whole (the "
        "baseline without P/D)",
    )
    s.add_argument(
        "--kv-link-gbps",
        type=float,
        default=10.0,
        help="with --pd: the KV link's bandwidth between two regions, Gbit/s (default 10)",
    )
    s.add_argument(
        "--local-kv-link-gbps",
        type=float,
        default=100.0,
        help="with --pd: the KV link's bandwidth within a region, Gbit/s (default 100)",
    )
    s.add_argument(
        "--local-threshold-tokens",
        type=int,
        help="with --pd: gorgo's policies.gorgo.local_threshold_tokens (a prompt with fewer "
        "uncached tokens is prefilled in its decode's region; default 0; a huge value: never "
        "in another region)",
    )
    s.add_argument(
        "--remote-margin-ms",
        type=float,
        help="with --pd: gorgo's policies.gorgo.remote_margin_ms (a remote prefill must win "
        "by this much; default 0)",
    )
    s.add_argument(
        "--pd-protocol",
        choices=["sglang", "vllm"],
        default="sglang",
        help="with --pd: how a decode engine starts on the KV that arrived (SGLang: the "
        "prefill's first token at once; vLLM: the last prompt token computed again)",
    )
    add_protocol_flags(s, "open protocol: no cap")
    s.add_argument(
        "--request-max-tokens",
        default="output",
        metavar="output|none|N",
        help="what each request says as max_tokens: output = its output length (the router "
        "knows it in advance; default), none = nothing (the router learns output lengths), "
        "N = a cap (outputs longer end at N)",
    )
    s.set_defaults(func=_simulate)


PARSERS = (add_simulate,)
