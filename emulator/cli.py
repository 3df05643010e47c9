"""The emulator's `gorgo` subcommands (`engine`, `wan`, `up`, `bench engine-model`),
contributed to the router's command line through the `gorgo.commands` entry-point group:
the router never imports the emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from emulator.stack.up_cli import add_up_command
from ext_proc.cli import Commands
from ext_proc.vocab.params import ConfigError, split_host_port

TOKENIZER_HELP = (
    "tiny: the tiny model's byte-level BPE and ChatML template (the real-vLLM "
    "tier's), built once into ~/.cache/gorgo ($GORGO_CACHE_DIR); approx: 4 UTF-8 bytes per "
    "token; or a tokenizer.json, or a model directory holding one"
)
# Launch flags each engine has, by flavor: (flag, setting). The twin takes the real
# engine's names, so one command line serves both; the other engine's name is an error.
ENGINE_FLAGS = {
    "sglang": {
        "page_size": "--page-size",
        "max_running_requests": "--max-running-requests",
        "context_length": "--context-length",
        "enable_cache_report": "--enable-cache-report",
        "stream_response_default_include_usage": "--stream-response-default-include-usage",
        "enable_metrics": "--enable-metrics",
        "lora_paths": "--lora-paths",
        "max_loras_per_batch": "--max-loras-per-batch",
        "enable_priority_scheduling": "--enable-priority-scheduling",
        "schedule_low_priority_values_first": "--schedule-low-priority-values-first",
        "priority_scheduling_preemption_threshold": "--priority-scheduling-preemption-threshold",
        "disable_priority_preemption": "--disable-priority-preemption",
    },
    "vllm": {
        "block_size": "--block-size",
        "max_num_seqs": "--max-num-seqs",
        "max_model_len": "--max-model-len",
        "enable_prompt_tokens_details": "--enable-prompt-tokens-details",
        "enable_force_include_usage": "--enable-force-include-usage",
        "lora_modules": "--lora-modules",
        "max_loras": "--max-loras",
        "scheduling_policy": "--scheduling-policy",
    },
}


def _flavor_setting(args: argparse.Namespace, sglang: str, vllm: str) -> Any:
    """The value of one engine setting, from the flavor's own flag; the other engine's
    flag is refused with a message naming the right one."""
    mine, other = (sglang, vllm) if args.flavor == "sglang" else (vllm, sglang)
    other_flavor = "vllm" if args.flavor == "sglang" else "sglang"
    if getattr(args, other) not in (None, False):
        raise ValueError(
            f"{ENGINE_FLAGS[other_flavor][other]} is {other_flavor}'s flag; "
            f"{args.flavor}'s is {ENGINE_FLAGS[args.flavor][mine]}"
        )
    return getattr(args, mine)


def _priority_setting(args: argparse.Namespace) -> Any:
    """EngineConfig.priority from the flavor's flags: vLLM --scheduling-policy priority;
    SGLang --enable-priority-scheduling (+ its sign, threshold and preemption flags, which
    SGLang takes without it and then ignores)."""
    from emulator.engine.priority import SGLANG_PREEMPTION_THRESHOLD, PriorityScheduling

    on = _flavor_setting(args, "enable_priority_scheduling", "scheduling_policy")
    if args.flavor == "vllm":
        sglang_only = (
            "schedule_low_priority_values_first",
            "priority_scheduling_preemption_threshold",
            "disable_priority_preemption",
        )
        for key in sglang_only:
            if getattr(args, key) not in (None, False):
                raise ValueError(f"{ENGINE_FLAGS['sglang'][key]} is sglang's flag")
        return PriorityScheduling.vllm() if on == "priority" else None
    threshold = args.priority_scheduling_preemption_threshold
    return (
        PriorityScheduling(
            low_values_first=args.schedule_low_priority_values_first,
            preemption_threshold=SGLANG_PREEMPTION_THRESHOLD if threshold is None else threshold,
            preemption=not args.disable_priority_preemption,
        )
        if on
        else None
    )


def _engine(args: argparse.Namespace) -> int:
    import os

    from emulator.engine.config import (
        DEFAULT_CONTEXT_TOKENS,
        DEFAULT_PAGE_TOKENS,
        EngineConfig,
        Faults,
        zero_delay_profile,
    )
    from emulator.engine.disagg.cli import disagg_settings
    from emulator.engine.kv_publisher import KvEventsConfig
    from emulator.engine.server import serve_engine
    from emulator.engine.tokenizer import load_twin_tokenizer
    from ext_proc.estimate.profile import load_profile, profile_from_dict

    try:
        profile = load_profile(args.profile)
        overrides = _key_values(args.set, "--set") if args.set else {}
        page = _flavor_setting(args, "page_size", "block_size")
        if page is not None or "block_tokens" not in overrides:
            overrides["block_tokens"] = page or DEFAULT_PAGE_TOKENS[args.flavor]
        slots = _flavor_setting(args, "max_running_requests", "max_num_seqs")
        if slots is not None:
            overrides["max_running_requests"] = slots
        profile = profile_from_dict({**vars(profile), **overrides}, f"{args.profile} with flags")
        if args.zero_delay:
            profile = zero_delay_profile(profile)
        health_env = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        # A model directory (tokenizer.json, tokenizer_config.json): the engines report it
        # as their model path, where a router on this machine finds the same files.
        tokens = load_twin_tokenizer(args.tokenizer, args.chat_template)
        if args.trust_request_chat_template and args.flavor != "vllm":
            raise ValueError("--trust-request-chat-template is vllm's flag")
        # SGLang's served name defaults to the model path (server_args.py); the vLLM
        # twin keeps the real tier's --served-model-name tiny.
        sglang_name = tokens.model_dir or "default"
        names = args.served_model_name or [sglang_name if args.flavor == "sglang" else "tiny"]
        if len(names) > 1 and args.flavor == "sglang":
            raise ValueError("--served-model-name takes one name in sglang (several in vllm)")
        lora = _lora_settings(args)
        cfg = EngineConfig(
            name=args.name,
            profile=profile,
            seed=args.seed,
            model=names[0],
            model_aliases=tuple(names[1:]),
            **lora,
            model_path=tokens.model_dir,
            tokenizer=tokens.tokenizer,
            chat_template=tokens.template,
            trust_request_chat_template=args.trust_request_chat_template,
            faults=Faults(
                args.error_rate,
                args.stall_rate,
                args.stall_ms,
                args.stream_error_rate,
                args.stream_error_after,
            ),
            flavor=args.flavor,
            cache_report=bool(
                _flavor_setting(args, "enable_cache_report", "enable_prompt_tokens_details")
            ),
            default_include_usage=bool(
                _flavor_setting(
                    args, "stream_response_default_include_usage", "enable_force_include_usage"
                )
            ),
            # vLLM always serves /metrics; SGLang only with --enable-metrics.
            enable_metrics=args.flavor == "vllm" or args.enable_metrics,
            context_length=_flavor_setting(args, "context_length", "max_model_len")
            or DEFAULT_CONTEXT_TOKENS,
            kv_events=KvEventsConfig.parse(args.kv_events_config, args.flavor)
            if args.kv_events_config
            else None,
            priority=_priority_setting(args),
            warmup_s=args.warmup_s,
            health_generation=health_env.lower() not in ("0", "false", "no"),
            disagg=disagg_settings(args),
        )
    except ValueError as e:  # ConfigError is one
        print(f"gorgo engine: {e}", file=sys.stderr)
        return 2
    return _run_forever(serve_engine(cfg, args.host, args.port))


def _lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's LoRA settings from the flavor's flags (emulator/engine/lora.py)."""
    import os

    from emulator.engine.lora import LoraModule, check_slowdown, parse_lora_module

    flag = "--lora-modules" if args.flavor == "vllm" else "--lora-paths"
    items = _flavor_setting(args, "lora_paths", "lora_modules") or []
    modules = [parse_lora_module(item, flag) for item in items]
    default, per_name = 1.0, {}
    for item in args.lora_slowdown:
        name, sep, value = item.rpartition("=")
        try:
            factor = check_slowdown(float(value), f"--lora-slowdown {item!r}")
        except ValueError as e:
            raise ValueError(
                f"--lora-slowdown {item!r}: expected FACTOR or NAME=FACTOR >= 1"
            ) from e
        if sep:
            per_name[name] = factor
        else:
            default = factor
    unknown = sorted(set(per_name) - {m.name for m in modules})
    if unknown:
        raise ValueError(f"--lora-slowdown {unknown[0]}: no such adapter in {flag}")
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return {
        "runtime_lora_updating": None if env is None else env.lower() in ("1", "true"),
        "enable_lora": args.enable_lora,
        "lora_modules": tuple(
            LoraModule(m.name, m.path, per_name.get(m.name, m.slowdown)) for m in modules
        ),
        "max_loras": _flavor_setting(args, "max_loras_per_batch", "max_loras"),
        "lora_slowdown": default,
    }


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
        DelaySettings(
            rtt_ms, jitter_ms, args.spike_probability, args.spike_ms, args.gbps, args.byte_scale
        )
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
            gbps=args.gbps,
            byte_scale=args.byte_scale,
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


def _bench_engine_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from emulator.engine.calibrate import run_calibration

    return run_calibration(args.profile, Path(args.out), args.requests)


def add_commands(commands: Commands) -> None:
    from emulator.engine.disagg.cli import add_disagg_flags

    sub = commands.sub
    policies = commands.policies
    s = sub.add_parser(
        "engine",
        help="run one emulated engine (SGLang's or vLLM's twin)",
        description="An emulated engine: SGLang's (--flavor sglang, the default) or vLLM's "
        "(--flavor vllm) wire format, health, metrics, errors and KV events, timed by the "
        "engine model (continuous batching, chunked prefill, radix prefix cache). The "
        "engines' own launch flags set what they set on the real engine; docs/engine-model.md "
        "lists every behaviour with the engine's source it comes from. Profiles: built-in "
        "names from ext_proc/estimate/profiles/ (default l40s-qwen3.5-35b-a3b-fp8: 2x L40S, "
        "Qwen3.5-35B-A3B FP8) or a YAML file. Faults can also be changed at run time: "
        "POST /faults with the same names.",
    )
    s.add_argument(
        "--flavor",
        choices=["sglang", "vllm"],
        default="sglang",
        help="whose twin: its wire format, flags, metrics and errors",
    )
    s.add_argument("--name", required=True, help="backend id reported by the engine")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=30000, help="port to listen on (SGLang's)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model name (/v1/models, responses); vllm takes several, responses name the first",
    )
    s.add_argument("--profile", default="l40s-qwen3.5-35b-a3b-fp8", help="profile name or YAML")
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one profile constant (repeatable), e.g. --set prefill_tokens_per_s=1e6",
    )
    g = s.add_argument_group("the engines' own flags (each flavor takes its engine's names)")
    g.add_argument("--page-size", type=int, help="sglang: tokens per KV page (default 1)")
    g.add_argument("--block-size", type=int, help="vllm: tokens per KV block (CPU default 128)")
    g.add_argument("--max-running-requests", type=int, help="sglang: batch slots")
    g.add_argument("--max-num-seqs", type=int, help="vllm: batch slots")
    g.add_argument("--context-length", type=int, help="sglang: longest prompt + output")
    g.add_argument("--max-model-len", type=int, help="vllm: longest prompt + output")
    g.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="sglang: usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vllm: usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--stream-response-default-include-usage",
        action="store_true",
        help="sglang: a usage chunk in every stream",
    )
    g.add_argument(
        "--enable-force-include-usage", action="store_true", help="vllm: usage in every stream"
    )
    g.add_argument("--enable-metrics", action="store_true", help="sglang: serve /metrics")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help='vllm: adapters loaded at start (NAME=PATH or {"name", "path"}; needs --enable-lora)',
    )
    g.add_argument(
        "--lora-paths",
        nargs="+",
        metavar="NAME=PATH",
        help="sglang: adapters loaded at start (NAME=PATH or PATH; enables LoRA)",
    )
    g.add_argument("--max-loras", type=int, help="vllm: adapters per batch (default 1)")
    g.add_argument("--max-loras-per-batch", type=int, help="sglang: adapters per batch (default 8)")
    g.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="vllm: priority serves a lower `priority` first and preempts the largest "
        "(priority, arrival) when KV runs out (default fcfs: the field is ignored)",
    )
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="sglang: serve a higher `priority` first, preempting running requests past "
        "the threshold (off: the field is ignored)",
    )
    g.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="sglang: with priority scheduling, lower values first",
    )
    g.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        help="sglang: how much better a waiting request must be to preempt (default 10)",
    )
    g.add_argument(
        "--disable-priority-preemption",
        action="store_true",
        help="sglang: priority orders the queue only",
    )
    trust = "vllm: a request may bring its own chat_template"
    g.add_argument("--trust-request-chat-template", action="store_true", help=trust)
    g.add_argument(
        "--kv-events-config",
        default="",
        metavar="JSON",
        help='KV cache events, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
        '(vllm also needs "enable_kv_cache_events": true; sglang: "encoding": "array" for '
        "the tagged-array events of releases before 2026)",
    )
    add_disagg_flags(g)
    s.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="sglang: /health answers 503 this long after start (the engine's warmup)",
    )
    s.add_argument("--seed", type=int, default=0, help="seeds step jitter and fault draws")
    s.add_argument("--tokenizer", default="tiny", metavar="tiny|approx|PATH", help=TOKENIZER_HELP)
    s.add_argument(
        "--chat-template",
        default="",
        help="a Jinja file or a tokenizer_config.json with chat_template (default: the "
        "tokenizer_config.json beside the tokenizer)",
    )
    s.add_argument("--zero-delay", action="store_true", help="every step takes no time")
    s.add_argument(
        "--lora-slowdown",
        action="append",
        default=[],
        metavar="FACTOR|NAME=FACTOR",
        help="an adapter's steps take FACTOR times the base model's (default 1; repeatable)",
    )
    s.add_argument("--error-rate", type=float, default=0.0, help="share answered with HTTP 500")
    s.add_argument("--stall-rate", type=float, default=0.0, help="share held before scheduling")
    s.add_argument("--stall-ms", type=float, default=0.0, help="how long a stalled request waits")
    s.add_argument(
        "--stream-error-rate",
        type=float,
        default=0.0,
        help="share of streams that fail inside their HTTP 200 (an error event, then [DONE])",
    )
    s.add_argument(
        "--stream-error-after",
        type=int,
        default=0,
        help="tokens before a failing stream's error event (0: it is the first chunk)",
    )
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
        help="chance per chunk of bytes that a delay spike hits, 0..1 (0: none)",
    )
    s.add_argument(
        "--spike-ms", type=float, default=0.0, metavar="MS", help="RTT added when a spike hits"
    )
    s.add_argument(
        "--gbps",
        type=float,
        default=0.0,
        metavar="G",
        help="bandwidth of each direction in Gbit/s: bytes leave one after another at it "
        "(0: unlimited)",
    )
    s.add_argument(
        "--byte-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="each byte stands for S bytes at --gbps: set it to the engines' --kv-byte-scale "
        "on a link that carries their scaled-down KV",
    )
    s.add_argument(
        "--control-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve GET/POST /rtt on 127.0.0.1:PORT to read or change rtt_ms, jitter_ms, "
        "spike_probability, spike_ms, gbps and byte_scale at run time (0: off)",
    )
    s.set_defaults(func=_wan)

    add_up_command(sub, policies)

    bench = commands.bench()
    b = bench.add_parser(
        "engine-model",
        help="engine model vs calibration targets, figures",
        description="The engine model (emulator/engine) in process at rising arrival "
        "rates: TTFT and ITL percentiles and the mean batch at each, the figures its "
        "calibration is judged by (docs/engine-model.md), written to --out.",
    )
    b.add_argument(
        "--profile", default="l40s-qwen3.5-35b-a3b-fp8", help="engine profile: name or YAML"
    )
    b.add_argument("--requests", type=int, default=600, help="requests per load point")
    b.add_argument("--out", default="docs/img", help="directory for the PNG figures")
    b.set_defaults(func=_bench_engine_model)
