"""The `gorgo engine` flags of P/D, by the engines' names (config.py cites them), and the
environment variables each engine reads, read as the engine reads them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from emulator.engine.disagg.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_KV_BYTE_SCALE,
    NULL,
    SGLANG_MODES,
    TRANSFER_BACKENDS,
    DisaggConfig,
    parse_routes,
)

SGLANG_FLAGS = {
    "disaggregation_mode": "--disaggregation-mode",
    "disaggregation_bootstrap_port": "--disaggregation-bootstrap-port",
    "disaggregation_transfer_backend": "--disaggregation-transfer-backend",
    "num_reserved_decode_tokens": "--num-reserved-decode-tokens",
}


def add_disagg_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--disaggregation-mode",
        choices=SGLANG_MODES,
        help="sglang: run as a prefill or a decode server of P/D disaggregation (default null)",
    )
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        metavar="PORT",
        help=f"sglang prefill: the bootstrap server's port (default {DEFAULT_BOOTSTRAP_PORT})",
    )
    g.add_argument(
        "--disaggregation-transfer-backend",
        choices=TRANSFER_BACKENDS,
        help="sglang: KV transfer backend (default mooncake; fake moves no KV)",
    )
    g.add_argument(
        "--num-reserved-decode-tokens",
        type=int,
        metavar="N",
        help="sglang decode: KV reserved per request beside its prompt (default 512)",
    )
    g.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help='vllm: e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\' (P/D over '
        "NIXL; roles kv_producer, kv_consumer, kv_both)",
    )
    g.add_argument(
        "--kv-byte-scale",
        type=float,
        default=DEFAULT_KV_BYTE_SCALE,
        metavar="S",
        help="P/D twins send their KV scaled down by S (a link between them needs "
        "`gorgo wan --byte-scale S`; docs/engine-model.md)",
    )
    g.add_argument(
        "--kv-advertise",
        default="",
        metavar="HOST:PORT",
        help="P/D prefill: the address it names for its side server (SGLang's /route "
        "rank_ip and rank_port, vLLM's remote_host and remote_port), e.g. a link in front of "
        "it; default where it listens (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST and _PORT)",
    )
    g.add_argument(
        "--kv-route",
        action="append",
        default=[],
        metavar="ADDR=VIA",
        help="P/D decode: dial VIA (HOST:PORT) for a transfer naming ADDR (a prefill's "
        "bootstrap address or remote_host:remote_port), e.g. the link from this decode's "
        "region to the prefill's; repeatable",
    )


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number, got {env[name]!r}") from None


def disagg_settings(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> DisaggConfig | None:
    """EngineConfig.disagg from the flavor's flags and environment (None: no P/D)."""
    env = os.environ if env is None else env
    sglang_given = [flag for key, flag in SGLANG_FLAGS.items() if getattr(args, key) is not None]
    common: dict[str, Any] = {
        "host": args.host,
        "kv_byte_scale": args.kv_byte_scale,
        "advertise": args.kv_advertise,
        "routes": parse_routes(args.kv_route),
    }
    if args.flavor == "vllm":
        if sglang_given:
            raise ValueError(f"{sglang_given[0]} is sglang's flag; vllm's is --kv-transfer-config")
        if not args.kv_transfer_config:
            return None
        return DisaggConfig.vllm(
            args.kv_transfer_config,
            side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
            side_channel_port=int(_env_float(env, "VLLM_NIXL_SIDE_CHANNEL_PORT", 5600)),
            abort_request_timeout_s=_env_float(env, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480),
            **common,
        )
    if args.kv_transfer_config:
        raise ValueError("--kv-transfer-config is vllm's flag; sglang's is --disaggregation-mode")
    mode = args.disaggregation_mode or NULL
    if mode == NULL:
        return None
    settings: dict[str, Any] = {
        "bootstrap_timeout_s": _env_float(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
        "waiting_timeout_s": _env_float(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
        # common/conn.py: the interval at least 2 s, at least one failure.
        "heartbeat_interval_s": max(
            _env_float(env, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0), 2.0
        ),
        "heartbeat_max_failures": max(
            int(_env_float(env, "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1
        ),
    }
    if args.disaggregation_bootstrap_port is not None:
        settings["bootstrap_port"] = args.disaggregation_bootstrap_port
    if args.disaggregation_transfer_backend is not None:
        settings["transfer_backend"] = args.disaggregation_transfer_backend
    if args.num_reserved_decode_tokens is not None:
        settings["reserved_decode_tokens"] = args.num_reserved_decode_tokens
    return DisaggConfig.sglang(mode, **settings, **common)
