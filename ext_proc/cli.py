"""The `gorgo` command line.

The router owns `serve` and `envoy-config`. Other installed packages add subcommands
through the `gorgo.commands` entry-point group (the emulator adds `engine`, `wan`, `up`;
the load generator `demo`, `replay`, `simulate`, `bench ...`): each entry point is a
function that receives a `Commands` and adds its parsers. The router imports none of them;
one that cannot be loaded (not installed) is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from ext_proc.config.load import load_config
from ext_proc.service.check.command import add_check_commands
from ext_proc.vocab.params import ConfigError

ENTRY_POINT_GROUP = "gorgo.commands"
log = logging.getLogger("gorgo.cli")


def _serve(args: argparse.Namespace) -> int:
    # Imported here so `gorgo envoy-config` and the harness's commands start fast.
    from ext_proc.service.app import running_service
    from ext_proc.service.last_good import FILE, load_starting_config

    try:  # the file, else (it does not load) the last good config
        cfg, text, source = load_starting_config(args.config, args.last_good_config)
    except ConfigError as e:
        print(f"gorgo serve: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with running_service(cfg, config_path=args.config, source=source) as svc:
            reloader = svc.reloader
            assert reloader is not None
            if source.source == FILE:
                source.running(text)  # started: this is the last good config now
            # SIGHUP reloads the config file (so does a change to it, within a second).
            loop.add_signal_handler(signal.SIGHUP, reloader.request)
            print(
                f"gorgo serve: ready. ext_proc gRPC on {cfg.listen.grpc.rpartition(':')[0]}:"
                f"{svc.grpc_port}, admin http://{cfg.listen.admin.rpartition(':')[0]}:"
                f"{svc.admin_port}/state, policy {cfg.policy}, "
                f"backends {', '.join(cfg.backend_ids)}"
                + (f" (from the last good config {source.last_good})" if source.error else ""),
                flush=True,
            )
            await stop.wait()

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        asyncio.run(main())
    except OSError as e:
        print(f"gorgo serve: {e}", file=sys.stderr)
        return 1
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
            print(f"gorgo serve: profile written to {args.profile}", file=sys.stderr)
    return 0


def _envoy_config(args: argparse.Namespace) -> int:
    from ext_proc.envoy.bootstrap import render_envoy_config, render_mesh_snippet

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"gorgo envoy-config: {e}", file=sys.stderr)
        return 2
    if args.mesh_snippet:
        sys.stdout.write(render_mesh_snippet(cfg))
        return 0
    if cfg.envoy.xds_dir:
        # The bootstrap reads its backend clusters from these files: write them first, so
        # Envoy can start before the router (which rewrites them as the fleet changes).
        from ext_proc.envoy.xds import write_xds

        try:
            write_xds(cfg)
        except OSError as e:
            print(f"gorgo envoy-config: envoy.xds_dir: {e}", file=sys.stderr)
            return 1
        print(
            f"gorgo envoy-config: wrote the backend clusters to {cfg.envoy.xds_dir}",
            file=sys.stderr,
        )
    sys.stdout.write(render_envoy_config(cfg))
    return 0


@dataclass
class Commands:
    """What a package gets to add its subcommands: the top-level subparsers, the known
    policy names, and the shared `bench` group (created on first use)."""

    sub: Any
    policies: list[str]
    _bench: Any = field(default=None, repr=False)

    def bench(self) -> Any:
        if self._bench is None:
            s = self.sub.add_parser("bench", help="benchmarks")
            self._bench = s.add_subparsers(dest="bench", required=True, metavar="BENCH")
        return self._bench


def build_parser() -> argparse.ArgumentParser:
    from ext_proc.policy.catalog import POLICIES

    p = argparse.ArgumentParser(
        prog="gorgo", description="GORGO: TTFT-aware Envoy ext_proc router for LLM fleets"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the ext_proc gRPC service and admin HTTP")
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.add_argument(
        "--profile",
        metavar="FILE",
        help="profile the whole run (cProfile; slows it) and write the stats to FILE on "
        "exit, for python -m pstats FILE or gorgo bench path",
    )
    s.add_argument(
        "--last-good-config",
        metavar="PATH",
        help="keep a copy of the running config here (written after the start and each "
        "accepted reload); a --config that does not load at start then starts from it, "
        "with the error on /state (config.source last-good) and the file reloaded once "
        "fixed. gorgo up passes one in its work directory",
    )
    s.set_defaults(func=_serve)

    s = sub.add_parser("envoy-config", help="print the Envoy front-door config for a gorgo config")
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.add_argument(
        "--mesh-snippet",
        action="store_true",
        help="print only the router's fragments, to paste into an existing Envoy",
    )
    s.set_defaults(func=_envoy_config)
    add_check_commands(sub)  # check, config-schema

    commands = Commands(sub, sorted(POLICIES))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            add = ep.load()
        except ImportError as e:  # its package is not installed here
            log.debug("gorgo commands from %s left out: %s", ep.value, e)
            continue
        add(commands)
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
