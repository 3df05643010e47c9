"""`gorgo replay`'s parser. Light: the replay's modules (aiohttp, the loop) are imported
only when it runs, since every `gorgo` command, `gorgo serve` too, builds all parsers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from loadgen.client.protocol import add_protocol_flags
from loadgen.traces.load import TRACE_HELP


def _replay(args: argparse.Namespace) -> int:
    from loadgen.replay.run import ReplayOptions, run_replay

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


def add_replay(sub: Any, policies: Sequence[str]) -> None:
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
    add_protocol_flags(s, "open protocol: 256, the connection pool")
    s.add_argument("--start-s", type=float, default=0.0, help="window start (trace time)")
    s.add_argument("--duration-s", type=float, default=None, help="window length (trace time)")
    s.add_argument("--limit", type=int, default=None, help="at most this many requests")
    s.add_argument("--out", metavar="FILE.json", help="result file (the shared schema)")
    s.add_argument("--csv", metavar="FILE.csv", help="one row per request")
    s.add_argument("--plot", metavar="FILE.png", help="TTFT CDF and TTFT over time")
    s.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    s.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a closing line)",
    )
    s.set_defaults(func=_replay)


PARSERS = (add_replay,)
