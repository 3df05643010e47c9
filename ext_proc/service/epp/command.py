"""`gorgo epp` in the CLI: its parser (the extension's flags, ext_proc/service/epp/flags.py)
and its run, imported when the command runs (ext_proc/service/epp/run.py)."""

from __future__ import annotations

import argparse
from typing import Any

from ext_proc.service.epp.flags import add_epp_arguments, epp_options


def add_epp_command(commands: Any) -> None:
    """`gorgo epp` in the CLI (`commands.sub`): unknown flags are accepted with a warning,
    as the chart may pass flags of another version of the extension."""
    s = commands.sub.add_parser(
        "epp",
        help="run as a Gateway API Inference Extension endpoint picker (its chart's flags)",
        description="The router as the inference extension's endpoint picker, started with "
        "the flags and ports its inferencepool chart gives its own picker: ext_proc over TLS "
        "on 9002 (self-signed unless --cert-path), the gRPC health service on 9003, "
        "/metrics on 9090, the backends from the InferencePool's pods (or "
        "--endpoint-selector) through the Kubernetes API. --config-file is a gorgo config; "
        "the chart's own plugins file means gorgo's defaults. Flags of the extension that "
        "mean nothing here are accepted with a warning (docs/envoy.md, deploy/k8s/README.md).",
    )
    add_epp_arguments(s)
    s.set_defaults(func=_run_epp, accepts_unknown=True)


def _run_epp(args: argparse.Namespace) -> int:
    from ext_proc.service.epp.run import run

    return run(epp_options(args, getattr(args, "unknown", ())))
