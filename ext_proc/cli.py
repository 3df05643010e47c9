"""The `gorgo` command line.

The router's own commands are the parsers ROUTER_COMMANDS adds (`serve`, `envoy-config`):
registering one is a line there. Other installed packages add theirs through the
`gorgo.commands` entry-point group (the emulator adds `engine`, `wan`, `up`; the load
generator `demo`, `replay`, `simulate`, `bench ...`): each entry point is a function that
receives a `Commands` and adds its parsers. The router imports none of them; one that
cannot be loaded (not installed) is left out. `gorgo --help` lists the two kinds apart,
from where each command came: router commands, then harness commands.

Every parser is a `Parser` (argparse gives subparsers their parent's class), so each
command's help shows its flags' defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import signal
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

from ext_proc.config.load import load_config
from ext_proc.service.check.command import add_check_commands
from ext_proc.service.epp.command import add_epp_command
from ext_proc.vocab.params import ConfigError

ENTRY_POINT_GROUP = "gorgo.commands"
DISTRIBUTION = "gorgo-router"  # pyproject's name: `gorgo --version` reads its metadata
HARNESS_INSTALL = "pip install 'gorgo-router[harness]'"
DOCS_EPILOG = (
    "Every command and flag: docs/configuration.md#the-gorgo-command; the quick start: "
    "README.md (both in the source repository)."
)
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
    from ext_proc.envoy_config.bootstrap import render_envoy_config, render_mesh_snippet

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
        from ext_proc.envoy_config.xds import write_xds

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
            s = self.sub.add_parser(
                "bench",
                help="benchmarks",
                description="Benchmarks of the router, the engine model and the policies, "
                "live or in the simulator; each prints its figures and most write a report "
                "(docs/benchmarks.md, docs/results.md). gorgo bench BENCH --help for one.",
            )
            self._bench = s.add_subparsers(dest="bench", metavar="BENCH")
            s.set_defaults(func=_help_of(s))  # a bare `gorgo bench`: its help
        return self._bench


# A function that adds one router command's parser (and its func) to `gorgo`'s subparsers.
AddCommand = Callable[[Commands], None]


def add_serve(commands: Commands) -> None:
    s = commands.sub.add_parser(
        "serve",
        help="run the ext_proc gRPC service and admin HTTP",
        description="The router: the ext_proc gRPC service Envoy calls for every request "
        "(and its access-log service), and the admin HTTP (/healthz, /metrics, /state, the "
        "operator page /ui). SIGTERM drains and stops it; SIGHUP, or a change to the config "
        "file, reloads the config. It prints one ready line on stdout once it listens.",
    )
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


def add_envoy_config(commands: Commands) -> None:
    s = commands.sub.add_parser(
        "envoy-config",
        help="print the Envoy front-door config for a gorgo config",
        description="Print the Envoy bootstrap for the fleet a gorgo config describes: the "
        "front door, one cluster a backend, the ext_proc filter calling the router, the "
        "access log it learns completions from. With envoy.xds_dir set, it first writes the "
        "backend clusters' xDS files there. --mesh-snippet prints only the router's "
        "fragments, to paste into an Envoy you already run (docs/envoy.md).",
    )
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.add_argument(
        "--mesh-snippet",
        action="store_true",
        help="print only the router's fragments, to paste into an existing Envoy",
    )
    s.set_defaults(func=_envoy_config)


# The router's own commands, in the order of `gorgo --help`: registering one is a line here.
ROUTER_COMMANDS: tuple[AddCommand, ...] = (
    add_serve,
    add_envoy_config,
    add_check_commands,  # check, config-schema
    add_epp_command,
)


def shows_default(action: argparse.Action) -> bool:
    """Whether a flag's help shows its default: not for none (None), an off switch (False),
    an empty value, nor help/version/subcommands."""
    d = action.default
    if d is None or d is False or d is argparse.SUPPRESS:
        return False
    if isinstance(d, str | list | tuple) and not d:
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, "*")


def typed(default: Any) -> str:
    """A default as one would type it: a list as its items, space-separated."""
    if isinstance(default, list | tuple):
        return " ".join(str(d) for d in default)
    return str(default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (when it shows one: shows_default), typed as
    on a command line; a flag without help shows its default alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not shows_default(action):
            return text
        return f"{text} (default: {typed(action.default).replace('%', '%%')})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):
            action = copy.copy(action)
            action.help, action.default = "(default: %(default)s)", typed(action.default)
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """`gorgo`'s parser and, through argparse (a subparser is of its parent's class), every
    subcommand's: help with the flags' defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        # No abbreviated flags: `gorgo epp --v 1` (the extension's chart) is not --verbose.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """A command's func that prints the parser's help (a group named without its command)."""

    def print_help(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 0

    return print_help


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _group_commands(p: argparse.ArgumentParser, sub: Any, router: Collection[str]) -> None:
    """List the commands in two groups of the top-level help, router commands (`router`)
    and harness commands, instead of one list under COMMAND. argparse keeps each command's
    help row in the subparsers action's `_choices_actions`; the groups take them over."""
    router_group = p.add_argument_group("router commands")
    rows = list(sub._choices_actions)
    harness = [row for row in rows if row.dest not in router]
    harness_group = p.add_argument_group(
        f"harness commands ({HARNESS_INSTALL})",
        None if harness else "not installed here",
    )
    router_group._group_actions.extend(row for row in rows if row.dest in router)
    harness_group._group_actions.extend(harness)
    sub._choices_actions = []


def build_parser() -> argparse.ArgumentParser:
    from ext_proc.policy.catalog import POLICIES

    p = Parser(
        prog="gorgo",
        description="GORGO: TTFT-aware Envoy ext_proc router for LLM fleets",
        epilog=DOCS_EPILOG,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(
        dest="command", metavar="COMMAND", help="a command below; gorgo COMMAND --help: its flags"
    )
    p.set_defaults(func=_help_of(p))  # a bare `gorgo`: this help

    commands = Commands(sub, sorted(POLICIES))
    for add in ROUTER_COMMANDS:
        add(commands)
    router = set(sub.choices)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            add = ep.load()
        except ImportError as e:  # its package is not installed here
            log.debug("gorgo commands from %s left out: %s", ep.value, e)
            continue
        add(commands)
    _group_commands(p, sub, router)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Only `gorgo epp` takes flags it does not know (another version of the extension's
    # chart may pass them); every other command refuses them as argparse does.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
