"""`gorgo up`: the whole local stack (Envoy, gorgo, the emulated or real engines, WAN
links), its flags and how they become StackSettings."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def _up(args: argparse.Namespace) -> int:
    from emulator.stack.fleet import NO_FLEET, load_fleet
    from emulator.stack.pd import DEFAULT_KV_LINK_GBPS, PdSettings
    from emulator.stack.settings import StackSettings, regions_for_profile
    from emulator.stack.stack import run_until_signalled

    regions = regions_for_profile(args.rtt_profile)
    if not 1 <= args.regions <= len(regions):
        print(f"gorgo up: --regions must be 1..{len(regions)}", file=sys.stderr)
        return 2
    regions = regions[: args.regions]
    if not 1 <= args.front_doors <= len(regions):
        print(f"gorgo up: --front-doors must be 1..{len(regions)}", file=sys.stderr)
        return 2
    if args.routers < 1:
        print("gorgo up: --routers must be 1 or more", file=sys.stderr)
        return 2
    try:  # the engines' profiles; the router keeps the shipped one
        fleet = NO_FLEET if args.fleet is None else load_fleet(args.fleet, [r.id for r in regions])
    except ValueError as e:
        print(f"gorgo up: {e}", file=sys.stderr)
        return 2
    if fleet.profiles and args.engine == "vllm":
        print("gorgo up: --fleet sets emulated engines' profiles, not real vLLM's", file=sys.stderr)
        return 2
    if (fleet.models or fleet.loras) and args.engine == "vllm":
        print(
            "gorgo up: --fleet's model and lora_modules set emulated engines', not real vLLM's",
            file=sys.stderr,
        )
        return 2
    pd = None
    if args.pd:
        protocol = args.pd_protocol or args.flavor or "sglang"
        if args.flavor not in (None, protocol):
            print(
                f"gorgo up: the P/D twins are {protocol}'s (--pd-protocol), not --flavor "
                f"{args.flavor}'s",
                file=sys.stderr,
            )
            return 2
        if args.engine == "vllm":
            print("gorgo up: --pd runs emulated twins, not real vLLM", file=sys.stderr)
            return 2
        if args.front_doors > 1:
            print(
                "gorgo up: --pd routes the prefill twins too, which only the first front "
                "door reaches: --front-doors 1 with --pd",
                file=sys.stderr,
            )
            return 2
        gbps = DEFAULT_KV_LINK_GBPS if args.kv_link_gbps is None else args.kv_link_gbps
        try:
            pd = PdSettings(protocol=protocol, kv_link_gbps=gbps)
        except ValueError as e:
            print(f"gorgo up: {e}", file=sys.stderr)
            return 2
    elif args.pd_protocol is not None or args.kv_link_gbps is not None:
        print("gorgo up: --pd-protocol and --kv-link-gbps go with --pd", file=sys.stderr)
        return 2
    return run_until_signalled(
        StackSettings(
            policy=args.policy,
            regions=regions,
            rtt_profile=args.rtt_profile,
            flavor=pd.protocol if pd else args.flavor or "sglang",
            pd=pd,
            real_engine=args.engine == "vllm",
            engine_tokenizer=args.tokenizer,
            kv_events=args.kv_events or args.front_doors > 1 or args.routers > 1,
            routers=args.routers,
            front_door_regions=[r.id for r in regions[1 : args.front_doors]],
            share_dispatches=not args.no_share_dispatches,
            engine_profiles=fleet.profiles,
            engine_models=fleet.models,
            engine_loras=fleet.loras,
            # not the flag's default: --help would print the environment's token
            admin_token=os.environ.get("GORGO_ADMIN_TOKEN", "")
            if args.admin_token is None
            else args.admin_token,
        )
    )


def add_up_command(sub: Any, policies: Sequence[str]) -> None:
    """The `up` subcommand on `gorgo`'s subparsers."""
    s = sub.add_parser(
        "up",
        help="run the whole local stack (Envoy, gorgo, 3 regions or --regions N)",
        description="The local stack as child processes, no Docker: an Envoy front door, "
        "the router, an emulated engine (or real vLLM) in each of three regions behind a WAN "
        "delay link. Its ready line names the front door, the router's admin (with its "
        "admin token) and the logs' directory; Ctrl-C stops it all. A child that dies is "
        "restarted with backoff; a crash loop stops the stack.",
    )
    s.add_argument("--policy", default="gorgo", choices=policies, help="the router's policy")
    s.add_argument(
        "--rtt-profile",
        default="network",
        choices=["network", "paper"],
        help="WAN delays: network = 1/90/180 ms, paper = 37/279/456 ms (with jitter)",
    )
    s.add_argument(
        "--engine",
        default="emulated",
        choices=["emulated", "vllm"],
        help="emulated engines, or real vLLM instances serving a tiny local "
        "model on this machine's CPU (installed on first use by `make vllm`)",
    )
    s.add_argument(
        "--regions",
        type=int,
        default=3,
        metavar="N",
        help="start the first N regions only (us-ashburn first): with --engine vllm, 1 "
        "leaves the second core to the router, Envoy and the client",
    )
    s.add_argument(
        "--flavor",
        default=None,
        choices=["sglang", "vllm"],
        help="which engine the emulated backends are the twin of (default sglang)",
    )
    s.add_argument(
        "--pd",
        action="store_true",
        help="P/D disaggregation: each region runs a prefill twin and a decode twin in its "
        "engine's place (the router picks both legs: the decodes role decode, the prefills "
        "role prefill, each behind its region's link), the KV moving from any "
        "region's prefill to any region's decode over a WAN link of that pair's RTT "
        "(docs/engine-model.md)",
    )
    s.add_argument(
        "--pd-protocol",
        choices=["sglang", "vllm"],
        default=None,
        help="with --pd: the twins' P/D protocol and flavor, SGLang's bootstrap protocol "
        "or vLLM's NixlConnector (default --flavor's: sglang)",
    )
    s.add_argument(
        "--kv-link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="with --pd: each KV link's bandwidth in Gbit/s, 0 unlimited (default 10)",
    )
    s.add_argument(
        "--front-doors",
        type=int,
        default=1,
        metavar="N",
        help="an Envoy and a router in each of the first N regions, each reaching every "
        "backend at its own RTTs; the routers share the engines' KV events (implies "
        "--kv-events) and tell each other their dispatches over a NATS server the stack "
        "starts. 1: one front door in us-ashburn (the paper's setup)",
    )
    s.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="N router processes behind the front door's Envoy (its ext_proc cluster lists "
        "them all): they share the engines' KV events (implies --kv-events) and, over a NATS "
        "server the stack starts, their dispatches and what each saw of the others' requests",
    )
    s.add_argument(
        "--no-share-dispatches",
        action="store_true",
        help="with several front doors, no NATS: each router knows only its own dispatches",
    )
    s.add_argument(
        "--kv-events",
        action="store_true",
        help="the router subscribes to the engines' KV cache events (emulated or real vLLM): "
        "its prefix state is the engines' own (/state prefix_state: precise)",
    )
    s.add_argument(
        "--tokenizer",
        default="tiny",
        metavar="tiny|approx|PATH",
        help="the emulated engines' (gorgo engine --tokenizer); the router finds it itself",
    )
    s.add_argument(
        "--fleet",
        metavar="FLEET.yaml",
        help="each region's emulated engine profile (docs/engine-model.md), served model "
        "name and LoRA adapters (docs/engines.md); the router keeps the shipped profile and "
        "must learn them",
    )
    s.add_argument(
        "--admin-token",
        default=None,
        metavar="TOKEN",
        help="the routers' admin token, for calls that change their state (Authorization: "
        "Bearer TOKEN); default GORGO_ADMIN_TOKEN, else a random one, printed in the ready line",
    )
    s.set_defaults(func=_up)
