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
    from ext_proc.envoy_config import render_envoy_config

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"gorgo envoy-config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_envoy_config(cfg))
    return 0


def _engine(args: argparse.Namespace) -> int:
    from emulator.engine import EngineConfig, serve_engine

    cfg = (
        EngineConfig.zero_delay(args.name)
        if args.zero_delay
        else EngineConfig(
            name=args.name,
            prefill_base_ms=args.prefill_base_ms,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_ms_per_token=args.decode_ms_per_token,
        )
    )
    return _run_forever(serve_engine(cfg, args.host, args.port))


def _wan(args: argparse.Namespace) -> int:
    from emulator.wan import serve_wan

    try:
        lhost, lport = split_host_port(args.listen, "--listen")
        thost, tport = split_host_port(args.target, "--target")
    except ConfigError as e:
        print(f"gorgo wan: {e}", file=sys.stderr)
        return 2
    return _run_forever(serve_wan(lhost, lport, thost, tport, args.rtt_ms))


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
    from emulator.stack import StackSettings, run_until_signalled

    return run_until_signalled(StackSettings(policy=args.policy))


def _demo(args: argparse.Namespace) -> int:
    from loadgen.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, policy=args.policy)


def _bench(args: argparse.Namespace) -> int:
    from loadgen.bench_overhead import run_overhead_bench

    return run_overhead_bench(requests=args.requests)


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
    s.set_defaults(func=_envoy_config)

    s = sub.add_parser("engine", help="run one emulated SGLang engine")
    s.add_argument("--name", required=True, help="backend id reported by the engine")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--prefill-base-ms", type=float, default=20.0)
    s.add_argument("--prefill-tokens-per-s", type=float, default=12000.0)
    s.add_argument("--decode-ms-per-token", type=float, default=10.0)
    s.add_argument("--zero-delay", action="store_true", help="answer at once (benchmarks)")
    s.set_defaults(func=_engine)

    s = sub.add_parser("wan", help="run a TCP link that delays each direction by RTT/2")
    s.add_argument("--listen", required=True, help="host:port to accept on")
    s.add_argument("--target", required=True, help="host:port to forward to")
    s.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to add")
    s.set_defaults(func=_wan)

    s = sub.add_parser("up", help="run the whole local stack (Envoy, gorgo, 3 regions)")
    s.add_argument("--policy", default="least_request", choices=policies)
    s.set_defaults(func=_up)

    s = sub.add_parser("demo", help="start the local stack, send requests, print a table")
    s.add_argument("--requests", type=int, default=100)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--policy", default="least_request", choices=policies)
    s.set_defaults(func=_demo)

    s = sub.add_parser("bench", help="benchmarks")
    bench = s.add_subparsers(dest="bench", required=True, metavar="BENCH")
    b = bench.add_parser("overhead", help="Envoy alone vs Envoy + gorgo ext_proc")
    b.add_argument("--requests", type=int, default=500, help="requests per measurement")
    b.set_defaults(func=_bench)
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
