"""What a P/D twin is configured with, pure: the role and the engines' own knobs, each
named and defaulted as the engine's source has it.

SGLang (python/sglang/srt/server_args.py; environ.py for the SGLANG_DISAGGREGATION_*
variables): `--disaggregation-mode null|prefill|decode`, `--disaggregation-bootstrap-port`
(8998), `--disaggregation-transfer-backend` (mooncake), `--num-reserved-decode-tokens`
(512); SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (300 s: the prefill waits this long for the
decode's KV indices), SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s: the decode waits this
long for the KV once bootstrapped), SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (5 s, at least
2) and _MAX_FAILURE (2): the decode's probe of each prefill's bootstrap server
(disaggregation/common/conn.py). decode.py DecodePreallocQueue retries fetching a prefill's
parallel info 15 times a second apart, then aborts the request.

vLLM (vllm/config/kv_transfer.py; envs.py): `--kv-transfer-config` JSON with kv_connector,
kv_role (kv_producer, kv_consumer, kv_both; required with a connector), engine_id (a
uuid4 when not given) and kv_load_failure_policy (fail, the default, or recompute);
VLLM_NIXL_SIDE_CHANNEL_HOST (localhost) and _PORT (5600), where the NIXL handshake
listens; VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s): the producer frees KV no decode has read
by then. The decode's handshake waits 5 s for an answer (nixl/worker.py _nixl_handshake,
zmq RCVTIMEO 5000 ms). The twin speaks NixlConnector only.

The twin's own: `host` (where its side server listens: the engine's --host),
`kv_byte_scale` (emulator/engine/disagg/kv.py), and the two that place twins on an emulated
WAN (the local stack's `gorgo up --pd`, docs/engine-model.md): `advertise`, the HOST:PORT a
prefill names for its side server (SGLang's /route rank_ip and rank_port, vLLM's
remote_host and remote_port; "" = where it listens), and a decode's `routes`: a transfer
naming ADDR is dialled at VIA, the link that carries it from the decode's region (the
network's routing, which loopback lacks). Tests shorten the timeouts; the CLI reads the
environment variables as the engines do.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

SGLANG, VLLM = "sglang", "vllm"
NULL, PREFILL, DECODE, BOTH = "null", "prefill", "decode", "both"
SGLANG_MODES = (NULL, PREFILL, DECODE)
DEFAULT_BOOTSTRAP_PORT = 8998
# disaggregation/utils.py: a request naming this host skips the transfer (fake/conn.py).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "mori", "fake")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
NIXL_CONNECTOR = "NixlConnector"
LOAD_FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_SIDE_CHANNEL_PORT = 5600
# The twin's default KV scale: 1 wire byte per KiB of KV (kv.py).
DEFAULT_KV_BYTE_SCALE = 1024.0


@dataclass(frozen=True)
class DisaggConfig:
    """One twin's P/D settings; `flavor` says which engine's protocol it speaks. Build it
    with `sglang(...)` or `vllm(...)`."""

    flavor: str
    # SGLang: --disaggregation-mode; vLLM: from kv_role (producer: prefill, consumer:
    # decode, both: whichever a request asks for).
    mode: str
    host: str = "127.0.0.1"
    kv_byte_scale: float = DEFAULT_KV_BYTE_SCALE
    # SGLang
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    transfer_backend: str = "mooncake"
    reserved_decode_tokens: int = 512
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    heartbeat_max_failures: int = 2
    ensure_retries: int = 15
    ensure_retry_interval_s: float = 1.0
    # vLLM
    kv_transfer_config: dict[str, Any] = field(default_factory=dict)
    side_channel_host: str = "localhost"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    abort_request_timeout_s: float = 480.0
    handshake_timeout_s: float = 5.0
    # The WAN placement (module docstring): HOST:PORT advertised, ADDR -> VIA dialled.
    advertise: str = ""
    routes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.advertise:
            host_port(self.advertise, "--kv-advertise")
        for addr, via in self.routes.items():
            host_port(addr, "--kv-route")
            host_port(via, "--kv-route")
        if self.flavor == SGLANG and self.mode not in SGLANG_MODES:
            raise ValueError(
                f"--disaggregation-mode must be one of {', '.join(SGLANG_MODES)}, got {self.mode!r}"
            )
        if not (math.isfinite(self.kv_byte_scale) and self.kv_byte_scale >= 1):
            raise ValueError(f"--kv-byte-scale must be >= 1, got {self.kv_byte_scale}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                "--disaggregation-transfer-backend must be one of "
                f"{', '.join(TRANSFER_BACKENDS)}, got {self.transfer_backend!r}"
            )
        for key in ("bootstrap_port", "side_channel_port"):
            if not 0 <= getattr(self, key) <= 65535:
                raise ValueError(f"{key} must be in 0..65535, got {getattr(self, key)}")
        for key in (
            "bootstrap_timeout_s",
            "waiting_timeout_s",
            "heartbeat_interval_s",
            "ensure_retry_interval_s",
            "abort_request_timeout_s",
            "handshake_timeout_s",
        ):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a number > 0, got {value!r}")

    @classmethod
    def sglang(cls, mode: str, **settings: Any) -> DisaggConfig:
        return cls(SGLANG, mode, **settings)

    @classmethod
    def vllm(cls, kv_transfer_config: str | dict[str, Any], **settings: Any) -> DisaggConfig:
        raw = parse_kv_transfer_config(kv_transfer_config)
        return cls(VLLM, ROLE_MODES[raw["kv_role"]], kv_transfer_config=raw, **settings)

    @property
    def active(self) -> bool:
        """Whether the twin takes part in P/D at all (SGLang's mode null does not)."""
        return self.mode != NULL

    @property
    def engine_id(self) -> str:
        return str(self.kv_transfer_config.get("engine_id", ""))

    @property
    def recompute_on_failure(self) -> bool:
        return self.kv_transfer_config.get("kv_load_failure_policy") == "recompute"

    def prefills(self) -> bool:
        return self.mode in (PREFILL, BOTH)

    def decodes(self) -> bool:
        return self.mode in (DECODE, BOTH)

    def with_ports(self, bootstrap_port: int, side_channel_port: int) -> DisaggConfig:
        return replace(self, bootstrap_port=bootstrap_port, side_channel_port=side_channel_port)

    def advertised(self) -> tuple[str, int]:
        """The (host, port) this twin names for its side server: `advertise`, else where
        it listens (SGLang: its host and bootstrap port; vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST
        and _PORT)."""
        if self.advertise:
            return host_port(self.advertise, "--kv-advertise")
        if self.flavor == SGLANG:
            return self.host, self.bootstrap_port
        return self.side_channel_host, self.side_channel_port

    def via(self, addr: str) -> str:
        """Where to dial for a transfer naming `addr` (HOST:PORT): its route, else itself."""
        return self.routes.get(addr, addr)


ROLE_MODES = {"kv_producer": PREFILL, "kv_consumer": DECODE, "kv_both": BOTH}


def host_port(value: str, flag: str) -> tuple[str, int]:
    """HOST:PORT (a port 1-65535); ValueError names the flag."""
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) <= 65535):
        raise ValueError(f"{flag}: expected HOST:PORT, got {value!r}")
    return host, int(port)


def parse_routes(items: list[str]) -> dict[str, str]:
    """--kv-route ADDR=VIA items as a dict (each side HOST:PORT)."""
    routes: dict[str, str] = {}
    for item in items:
        addr, sep, via = item.partition("=")
        if not sep:
            raise ValueError(f"--kv-route: expected ADDR=VIA, got {item!r}")
        routes[addr] = via
    return routes


def parse_kv_transfer_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """vLLM's --kv-transfer-config, checked as KVTransferConfig.__post_init__ checks it
    (a role with every connector; a known role and failure policy), with engine_id and
    kv_load_failure_policy filled in as vLLM fills them. ValueError names the problem."""
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    else:
        raw = dict(value)
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    connector, role = raw.get("kv_connector"), raw.get("kv_role")
    if connector is None:
        raise ValueError("--kv-transfer-config: kv_connector is required")
    if connector != NIXL_CONNECTOR:
        raise ValueError(f"--kv-transfer-config: the twin speaks {NIXL_CONNECTOR} only")
    if role is None:
        raise ValueError(
            "Please specify kv_disagg_role when kv_connector is set, supported roles are "
            f"{KV_ROLES}"
        )
    if role not in KV_ROLES:
        raise ValueError(f"Unsupported kv_role: {role}. Supported roles are {KV_ROLES}")
    policy = raw.setdefault("kv_load_failure_policy", "fail")
    if policy not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}")
    if raw.get("engine_id") is None:
        raw["engine_id"] = str(uuid.uuid4())
    return raw


def disagg_mode(disagg: DisaggConfig | None) -> str:
    """The mode the twin reports (SGLang's server args: "null" when not disaggregated)."""
    return NULL if disagg is None else disagg.mode
