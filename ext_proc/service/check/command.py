"""The commands `gorgo check` and `gorgo config-schema`: their parsers and handlers, added
to the CLI's subcommands by `add_check_commands` (ext_proc/cli.py). Router commands: they
need nothing of the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ext_proc.config.load import load_config
from ext_proc.vocab.params import ConfigError

# Exit statuses: all is well, a problem found, the config does not load.
OK, PROBLEMS, BAD_CONFIG = 0, 1, 2
# Each request's deadline by default: the router's own probe timeout (probes.timeout_s),
# short enough that a dead fleet answers in seconds.
DEFAULT_TIMEOUT_S = 2.0


def _check(args: argparse.Namespace) -> int:
    # Imported here so that `gorgo --help` and the other commands start fast.
    from ext_proc.service.check.judge import judge
    from ext_proc.service.check.probes import look_at_fleet
    from ext_proc.service.check.report import render_json, render_text

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        if args.json:
            doc = {"config": args.config, "ok": False, "exit_code": BAD_CONFIG, "error": str(e)}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        print(f"gorgo check: {e}", file=sys.stderr)
        return BAD_CONFIG
    if args.timeout_s <= 0:
        print(f"gorgo check: --timeout-s must be > 0, got {args.timeout_s:g}", file=sys.stderr)
        return BAD_CONFIG
    look = asyncio.run(look_at_fleet(cfg, args.timeout_s))
    verdict = judge(cfg, look)
    render = render_json if args.json else render_text
    sys.stdout.write(render(args.config, verdict, look))
    return PROBLEMS if verdict.problems else OK


def _config_schema(args: argparse.Namespace) -> int:
    from ext_proc.config.json_schema import config_schema

    sys.stdout.write(json.dumps(config_schema(), indent=2) + "\n")
    return OK


def add_check_commands(commands: Any) -> None:
    """Add `check` and `config-schema` to the CLI's subparsers (`commands.sub`)."""
    sub = commands.sub
    s = sub.add_parser(
        "check",
        help="check a config and its fleet before serve (tokens, models, metrics, KV, RTT)",
        description="Load the config, look at every backend as the router will read it "
        "(its models, /metrics, KV events, RTT, and whether the router's tokens are the "
        "engine's), print per backend and model what will be precise and what approximate, "
        "and every problem with its fix. Exit 0: all is well; 1: a problem; 2: the config "
        "does not load.",
    )
    s.add_argument("--config", required=True, help="gorgo YAML config file")
    s.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="how long each request to an engine may take, in seconds (backends are looked "
        "at concurrently)",
    )
    s.add_argument("--json", action="store_true", help="print the findings as JSON")
    s.set_defaults(func=_check)

    s = sub.add_parser(
        "config-schema",
        help="print the config's JSON Schema (draft 2020-12), for editors",
        description="Print a JSON Schema of the YAML config, generated from the dataclasses "
        "the loader decodes: types, ranges, defaults, enums, required and unknown keys. "
        "Editors with yaml-language-server use it through a "
        "`# yaml-language-server: $schema=FILE` comment (docs/configuration.md).",
    )
    s.set_defaults(func=_config_schema)
