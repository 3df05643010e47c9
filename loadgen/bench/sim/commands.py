"""The simulator benches' `gorgo bench` parsers, one `add_<bench>` a bench. Each imports its
bench only when it runs: every `gorgo` command, `gorgo serve` and its warm spares too,
builds all parsers, and the benches import the simulator and numpy."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ext_proc.vocab.backend import DEFAULT_PROFILE
from loadgen.bench.sim.policies import BASELINES
from loadgen.traces.readers import CONVERSATION_TRACE


def _target(args: argparse.Namespace) -> int:
    import shlex

    from loadgen.bench.sim.target import CONVERSATION, SYNTHETIC
    from loadgen.bench.sim.target_report import run_target_bench

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
        args.against,
    )


def add_target(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "target",
        help="the target matrix: gorgo vs the best baseline per cell (p95 TTFT <= 0.8 x, "
        "E2E <= 1.0 x), with its floors",
        description="Every baseline and gorgo in each cell (workload window x RTT profile x "
        "protocol x time_scale); per cell the best baseline, gorgo's p95 TTFT and E2E "
        "ratios, whether it meets the target (<= 0.8 / <= 1.0), the no-queue and burst "
        "floors and two clairvoyant references, unbounded cache and the engines' real KV pool "
        "(loadgen/bench/sim/target.py). Progress on stderr, the table on stdout and in --out.",
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
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
    b.add_argument(
        "--rtt-profile",
        action="append",
        choices=["network", "paper"],
        help="WAN delays, repeatable (default both)",
    )
    b.add_argument(
        "--protocol",
        action="append",
        choices=["open", "paper"],
        help="client protocol, repeatable (default both)",
    )
    b.add_argument(
        "--time-scale",
        action="append",
        type=float,
        help="repeatable; default per workload and protocol (loadgen.bench.sim.target's "
        "TIME_SCALES)",
    )
    b.add_argument("--extra", action="append", choices=policies, help="another policy's ratios too")
    b.add_argument(
        "--against",
        choices=["paper", "peers"],
        default="paper",
        help="the baselines: the paper's (target p95 TTFT <= 0.8 x the best) or the rules of "
        "SMG, vllm-router, llm-d and Dynamo (loadgen/sim/rivals; <= 0.85 x)",
    )
    b.add_argument(
        "--engine-profile",
        default=DEFAULT_PROFILE,
        help="every engine's profile (a built-in name or a YAML file): what the cells "
        "would be on other engines, e.g. a larger KV pool",
    )
    b.add_argument("--jobs", type=int, default=1, help="simulations in parallel")
    b.add_argument("--seed", type=int, default=0, help="seed of every simulation")
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
    b.set_defaults(func=_target)


def _learn(args: argparse.Namespace) -> int:
    from loadgen.bench.sim.learn import run_learn_bench

    return run_learn_bench(args.trace, args.jobs, args.seeds, args.out, args.ttft_model)


def add_learn(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "learn",
        help="the learned speed on the uniform fleet: gorgo with routing.learn_latency on "
        "vs off in every cell of gorgo bench target",
        description="gorgo with routing.learn_latency on and off, seed by seed, in every "
        "cell of gorgo bench target's matrix on the uniform fleet, in the simulator: what "
        "learning the engines' speed costs or gains where the shipped profile is right "
        "(docs/results.md).",
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument("--jobs", type=int, default=1, help="simulations in parallel")
    b.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    b.add_argument("--out", default="out/bench-learn.md", help="the report")
    b.add_argument(
        "--ttft-model",
        choices=["profile", "replay"],
        default="profile",
        help="the router's routing.ttft_model (replay: the step model fitted or not)",
    )
    b.set_defaults(func=_learn)


def _fleets(args: argparse.Namespace) -> int:
    from loadgen.bench.sim import fleets

    return fleets.run_fleets_bench(
        args.fleets or fleets.FLEETS,
        args.time_scales or fleets.TIME_SCALES,
        args.workers,
        args.ttft_model,
    )


def add_fleets(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "fleets",
        help="the learned latency model on heterogeneous fleets (loadgen/data/fleets/), "
        "against the shipped and the true profiles",
        description="On each heterogeneous fleet of loadgen/data/fleets/, in the simulator: "
        "gorgo with the shipped profile, with the latency it learns, and with the engines' "
        "true profiles (the reference), side by side (docs/cost-model.md, docs/results.md).",
    )
    b.add_argument("--fleets", nargs="+", help="default fast-far slow-near mixed-gpus")
    b.add_argument("--time-scales", nargs="+", type=float, help="default 3 4 6")
    b.add_argument("--workers", type=int, default=2, help="simulations in parallel")
    b.add_argument(
        "--ttft-model",
        choices=["profile", "replay"],
        default="profile",
        help="the router's routing.ttft_model",
    )
    b.set_defaults(func=_fleets)


def _models(args: argparse.Namespace) -> int:
    from loadgen.bench.sim import models

    return models.run_models_bench(
        args.trace,
        args.windows or models.WINDOWS,
        args.time_scales or models.TIME_SCALES,
        args.policies or models.POLICIES,
        args.seed,
        args.workers,
        args.out,
    )


def add_models(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "models",
        help="many models in the simulator (routing by model): the two-models trace on "
        "loadgen/data/fleets/two-models.yaml, gorgo vs every baseline",
        description="Many models in the simulator: the two-models trace (a model per "
        "conversation) on the fleet of loadgen/data/fleets/two-models.yaml, where each "
        "region serves some of the models, gorgo against every baseline (docs/results.md "
        '"Many models").',
    )
    b.add_argument("--trace", default=CONVERSATION_TRACE, help="Mooncake conversation trace")
    b.add_argument(
        "--windows", nargs="+", type=float, metavar="START_S", help="default 0 1200 2400"
    )
    b.add_argument("--time-scales", nargs="+", type=float, help="default 3 4")
    b.add_argument("--policies", nargs="+", choices=("gorgo", *BASELINES), help="default all")
    b.add_argument("--seed", type=int, default=0, help="seed of every simulation")
    b.add_argument("--workers", type=int, default=2, help="simulations in parallel")
    b.add_argument("--out", default="out/bench-models.md", help="the report")
    b.set_defaults(func=_models)


def _predict(args: argparse.Namespace) -> int:
    from loadgen.bench.sim import predict

    return predict.run_predict_bench(
        args.fleets or predict.ALL_FLEETS,
        args.time_scales or predict.TIME_SCALES,
        args.workers,
        args.request_max_tokens,
        args.json,
        json.loads(args.default) if args.default else None,
        args.arms or predict.ARMS,
    )


def add_predict(bench: Any, policies: Sequence[str]) -> None:
    b = bench.add_parser(
        "predict",
        help="the default prediction and routing against the ones before the replay "
        "(profile, decode not priced), learning on, on every fleet and load",
        description="gorgo as configured by default against routing.ttft_model: profile "
        "without the decode priced (the defaults until 2026-12-05), learning on, on the "
        "uniform fleet and each of loadgen/data/fleets/, per window and time_scale: the "
        "worst backend's TTFT and E2E MAPE and the p95s' ratios (docs/results.md).",
    )
    b.add_argument("--fleets", nargs="+", help="default uniform fast-far slow-near mixed-gpus")
    b.add_argument("--time-scales", nargs="+", type=float, help="default 2 3 4 6")
    b.add_argument("--workers", type=int, default=2, help="simulations in parallel")
    b.add_argument(
        "--request-max-tokens",
        default="output",
        metavar="output|none|N",
        help="each request's max_tokens: the trace's output length, none (learned), or a cap",
    )
    b.add_argument("--json", metavar="FILE", help="every run's figures as JSON")
    b.add_argument(
        "--default",
        metavar="JSON",
        help='router overrides for the default arm, e.g. \'{"policies": {"gorgo": '
        '{"decode_weight": 0.5}}}\'',
    )
    b.add_argument("--arms", nargs="+", choices=["before", "default"], help="default both")
    b.set_defaults(func=_predict)


PARSERS = (add_target, add_learn, add_fleets, add_models, add_predict)
