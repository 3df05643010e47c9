"""One YAML file configures the service, and the Envoy config is generated from it.

Every section is a frozen dataclass; `load_config` validates types and keys and raises
`ConfigError` naming the offending key (e.g. `envoy.max_body_bytes`).
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ext_proc.profile import DEFAULT_PROFILE, load_profile

_BACKEND_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type or range."""


@dataclass(frozen=True)
class Backend:
    # Backend id = Envoy cluster name = value of the routing header.
    id: str
    # host:port where Envoy reaches this backend's engine (through its WAN link locally).
    address: str
    region: str = ""
    # RTT assumed until the first probe answers (ms).
    rtt_prior_ms: float = 50.0
    # Engine profile (ext_proc/profiles/NAME.yaml or a file): turns tokens into ms.
    engine_profile: str = DEFAULT_PROFILE
    # KV cache the prefix index mirrors for this backend; 0 = the profile's KV pool.
    kv_capacity_tokens: int = 0


@dataclass(frozen=True)
class TimeWeights:
    """Weights of the time-form cost (gorgo): both terms are ms of TTFT, so 1.0 each is
    the physical starting point; the tuner moves them."""

    rtt: float = 1.0
    queue: float = 1.0


@dataclass(frozen=True)
class TokenWeights:
    """Weights of the paper's token-form cost (gorgo_tokens), its initial values."""

    rtt: float = 0.5
    queue: float = 0.1


@dataclass(frozen=True)
class Routing:
    # Prefix-index granularity (tokens per hashed block). 256 = the ART-Chat traces'
    # blocks; a 128k-token prompt is 512 blocks, hashed in ~0.3-0.6 ms.
    block_tokens: int = 256
    # Costs within tie_ms, or within tie_fraction of the best, count as a tie (a fixed
    # order herds requests onto one backend). gorgo breaks ties by fewest in flight: cost
    # estimates err by tens of percent under load (queueing), and within that band the
    # lighter decode batch protects E2E; measured on the Mooncake trace, 20 % lowered p95
    # TTFT and p95 E2E against 2 % (docs/results.md). Other policies draw at random.
    tie_ms: float = 1.0
    tie_fraction: float = 0.2
    # Refit each backend's prefill coefficients from observed TTFTs (least squares).
    refit_prefill: bool = False
    # Passive health: this many failed requests in a row (5xx, reset) eject a backend for
    # eject_s, doubling while it keeps failing when re-admitted (0 = never eject).
    eject_after_errors: int = 2
    eject_s: float = 5.0
    # A body the router cannot read (bad JSON, wrong types): "route" sends it on by the
    # fallback route and the backend answers it; "reject" answers 400 with a JSON error
    # naming the problem, without loading a backend.
    unreadable_body: str = "route"
    # Stall detection: a request still waiting for its first token past its estimated
    # TTFT by more than max(this grace, that estimate) makes its backend's queue estimate
    # grow with the lateness, so a stalled backend is avoided while it still answers
    # probes (0 = off).
    stall_grace_ms: float = 500.0
    # Shed load: when every backend's queue estimate exceeds this (ms), answer 429 with
    # Retry-After instead of queueing (0 = never shed).
    shed_queue_ms: float = 0.0
    # session_affinity without a session key: hash of the first this-many prompt tokens.
    affinity_prefix_tokens: int = 256
    # prefix_cache baseline: follow the best cache match when it covers at least this
    # share of the prompt, unless load is imbalanced (max - min in flight > balance_abs
    # and max > balance_rel * min); then least request.
    prefix_min_fraction: float = 0.5
    balance_abs: int = 4
    balance_rel: float = 1.5


@dataclass(frozen=True)
class TunerConfig:
    # off | paired (default: parent and child on interleaved traffic) | paper (the
    # published method, to reproduce it). Only policies with weights are tuned.
    mode: str = "paired"
    # Weights, sigma and history are saved here after every step and restored on start
    # ("" = not persisted).
    state_file: str = ""
    # paired: completions per arm per round.
    arm_size: int = 24


@dataclass(frozen=True)
class Probes:
    # RTT probe period per backend: fresh enough to follow a changing WAN within seconds
    # (the paper's 30 s was too slow), cheap (one small GET per backend).
    interval_s: float = 2.0
    timeout_s: float = 2.0
    # EWMA weight of a new RTT sample (the paper's 0.3).
    ewma_alpha: float = 0.3
    # Consecutive probe failures before a backend is suspect (not chosen while others
    # are healthy); one success clears it.
    suspect_after: int = 2
    path: str = "/health"
    # Scrape each engine's Prometheus /metrics this often (0 = off); values older than
    # metrics_stale_s are ignored.
    metrics_interval_s: float = 0.0
    metrics_stale_s: float = 10.0


@dataclass(frozen=True)
class ServerTls:
    """TLS on the ext_proc's gRPC port (PEM files). All empty: plaintext, for loopback or a
    trusted pod network."""

    cert_file: str = ""
    key_file: str = ""
    # Set: every client (Envoy) must present a certificate signed by this CA (mTLS).
    client_ca_file: str = ""


@dataclass(frozen=True)
class ClientTls:
    """How Envoy reaches the ext_proc over TLS (paths as Envoy sees them)."""

    # Set: TLS, the ext_proc's certificate verified against this CA.
    ca_file: str = ""
    # Envoy's client certificate, for an ext_proc that requires mTLS.
    cert_file: str = ""
    key_file: str = ""
    # SNI and the name the certificate must carry; "" = the host of ext_proc_address.
    server_name: str = ""


@dataclass(frozen=True)
class Listen:
    grpc: str = "127.0.0.1:50051"
    tls: ServerTls = field(default_factory=ServerTls)
    # Admin HTTP (/healthz, /state): loopback by default, it shows internal state.
    admin: str = "127.0.0.1:9180"
    # Bearer token required by admin calls that change state (POST /tuner); "" = none
    # (the GORGO_ADMIN_TOKEN environment variable is used when this is empty).
    admin_token: str = ""


@dataclass(frozen=True)
class EnvoySettings:
    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    # Where Envoy reaches the ext_proc; defaults to listen.grpc.
    ext_proc_address: str = ""
    ext_proc_tls: ClientTls = field(default_factory=ClientTls)
    # Whole-body buffering for routing: 128k-token prompts are ~0.5 MB of text, JSON
    # escaping and multimodal parts can multiply that; 16 MiB leaves room.
    max_body_bytes: int = 16 * 1024 * 1024
    # Per-message ext_proc deadline. One Python process answering a burst of new
    # streams needs slack beyond its ~1 ms typical reply; past it Envoy fails open.
    message_timeout_ms: int = 1000
    # Long generations stream for minutes; Envoy's 15 s default route timeout cuts them.
    route_timeout_s: float = 600.0
    # Upstream connect timeout; a WAN hop costs one RTT (<0.5 s) per attempt.
    connect_timeout_s: float = 5.0
    # A request whose backend cannot be reached (connection refused or reset before the
    # request was sent) is retried this many times on other backends (0 = never).
    connect_retries: int = 2
    # How the decision reaches Envoy. "cluster": header x-gorgo-backend names a cluster
    # per backend (cluster_header route). "endpoint_picker": the Gateway API Inference
    # Extension protocol: header x-gateway-destination-endpoint and the envoy.lb dynamic
    # metadata name the endpoint inside one cluster (Envoy's override_host policy).
    mode: str = "cluster"
    # OTLP/gRPC collector (host:port) for Envoy's own spans; "" = no Envoy tracing.
    tracing_endpoint: str = ""
    # Share of requests Envoy traces (percent).
    tracing_sample_percent: float = 100.0


@dataclass(frozen=True)
class Telemetry:
    # OTLP/gRPC endpoint for the router's decision spans ("" = the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT variable, and if that is unset too, no export).
    otlp_endpoint: str = ""
    # Share of decisions traced; a decision under a sampled Envoy span follows Envoy's.
    sample_ratio: float = 1.0
    service_name: str = "gorgo"


@dataclass(frozen=True)
class Config:
    backends: tuple[Backend, ...]
    policy: str = "gorgo"
    seed: int = 0
    weights: TimeWeights = field(default_factory=TimeWeights)
    token_weights: TokenWeights = field(default_factory=TokenWeights)
    routing: Routing = field(default_factory=Routing)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    probes: Probes = field(default_factory=Probes)
    telemetry: Telemetry = field(default_factory=Telemetry)
    listen: Listen = field(default_factory=Listen)
    envoy: EnvoySettings = field(default_factory=EnvoySettings)
    # In-flight records whose completion never arrives (lost access log) expire after
    # this long, so the in-flight table stays bounded.
    request_timeout_s: float = 900.0

    @property
    def backend_ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.backends)

    @property
    def ext_proc_address(self) -> str:
        return self.envoy.ext_proc_address or self.listen.grpc


T = TypeVar("T")


def split_host_port(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: expected host:port, got {value!r}")
    return host, int(port)


def _convert(value: Any, typ: Any, key: str) -> Any:
    origin = get_origin(typ)
    if dataclasses.is_dataclass(typ) and isinstance(typ, type):
        return _build(typ, value, key)
    if origin is tuple:
        (item_type, _ellipsis) = get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return tuple(_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (Union, types.UnionType):
        raise ConfigError(f"{key}: unsupported union type")  # not used by the schema
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {typ!r}")


def _build(cls: type[T], raw: Any, prefix: str) -> T:
    where = prefix or "config"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        dotted = f"{prefix}.{unknown[0]}" if prefix else str(unknown[0])
        raise ConfigError(f"{dotted}: unknown key (expected one of: {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in raw:
            kwargs[name] = _convert(raw[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required key is missing")
    return cls(**kwargs)


def _validate(cfg: Config) -> None:
    if not cfg.backends:
        raise ConfigError("backends: at least one backend is required")
    seen: set[str] = set()
    for i, b in enumerate(cfg.backends):
        if not _BACKEND_ID.match(b.id):
            raise ConfigError(
                f"backends[{i}].id: {b.id!r} must be lowercase letters, digits, '.', '_' or "
                "'-' (it becomes an Envoy cluster name and a header value)"
            )
        if b.id in seen:
            raise ConfigError(f"backends[{i}].id: duplicate backend id {b.id!r}")
        seen.add(b.id)
        split_host_port(b.address, f"backends[{i}].address")
        if b.rtt_prior_ms < 0:
            raise ConfigError(f"backends[{i}].rtt_prior_ms: must be >= 0")
        if b.kv_capacity_tokens < 0:
            raise ConfigError(f"backends[{i}].kv_capacity_tokens: must be >= 0")
        try:
            load_profile(b.engine_profile)
        except ValueError as e:
            raise ConfigError(f"backends[{i}].engine_profile: {e}") from e
    split_host_port(cfg.listen.grpc, "listen.grpc")
    split_host_port(cfg.listen.admin, "listen.admin")
    split_host_port(cfg.envoy.listen, "envoy.listen")
    split_host_port(cfg.envoy.admin, "envoy.admin")
    split_host_port(cfg.ext_proc_address, "envoy.ext_proc_address")
    for key, value in (
        ("envoy.max_body_bytes", cfg.envoy.max_body_bytes),
        ("envoy.message_timeout_ms", cfg.envoy.message_timeout_ms),
    ):
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if cfg.request_timeout_s <= 0:
        raise ConfigError("request_timeout_s: must be > 0")
    positive: dict[str, float] = {
        "weights.rtt": cfg.weights.rtt,
        "weights.queue": cfg.weights.queue,
        "token_weights.rtt": cfg.token_weights.rtt,
        "token_weights.queue": cfg.token_weights.queue,
        "routing.block_tokens": cfg.routing.block_tokens,
        "routing.affinity_prefix_tokens": cfg.routing.affinity_prefix_tokens,
        "routing.balance_rel": cfg.routing.balance_rel,
        "probes.interval_s": cfg.probes.interval_s,
        "probes.timeout_s": cfg.probes.timeout_s,
        "probes.suspect_after": cfg.probes.suspect_after,
        "probes.metrics_stale_s": cfg.probes.metrics_stale_s,
    }
    for key, number in positive.items():
        if number <= 0:
            raise ConfigError(f"{key}: must be > 0, got {number}")
    non_negative: dict[str, float] = {
        "routing.tie_ms": cfg.routing.tie_ms,
        "routing.tie_fraction": cfg.routing.tie_fraction,
        "routing.eject_after_errors": cfg.routing.eject_after_errors,
        "routing.eject_s": cfg.routing.eject_s,
        "routing.shed_queue_ms": cfg.routing.shed_queue_ms,
        "routing.stall_grace_ms": cfg.routing.stall_grace_ms,
        "routing.balance_abs": cfg.routing.balance_abs,
        "envoy.connect_retries": cfg.envoy.connect_retries,
        "probes.metrics_interval_s": cfg.probes.metrics_interval_s,
    }
    for key, number in non_negative.items():
        if number < 0:
            raise ConfigError(f"{key}: must be >= 0, got {number}")
    if cfg.envoy.mode not in ("cluster", "endpoint_picker"):
        raise ConfigError(
            f"envoy.mode: expected cluster or endpoint_picker, got {cfg.envoy.mode!r}"
        )
    _validate_tls(cfg)
    if cfg.routing.unreadable_body not in ("route", "reject"):
        raise ConfigError(
            "routing.unreadable_body: expected route or reject, "
            f"got {cfg.routing.unreadable_body!r}"
        )
    if cfg.envoy.tracing_endpoint:
        split_host_port(cfg.envoy.tracing_endpoint, "envoy.tracing_endpoint")
    if not 0 <= cfg.envoy.tracing_sample_percent <= 100:
        raise ConfigError("envoy.tracing_sample_percent: must be in [0, 100]")
    if not 0 <= cfg.telemetry.sample_ratio <= 1:
        raise ConfigError("telemetry.sample_ratio: must be in [0, 1]")
    if cfg.tuner.mode not in ("off", "paired", "paper"):
        raise ConfigError(f"tuner.mode: expected off, paired or paper, got {cfg.tuner.mode!r}")
    if cfg.tuner.arm_size < 4:
        raise ConfigError(f"tuner.arm_size: must be >= 4, got {cfg.tuner.arm_size}")
    if not 0 < cfg.probes.ewma_alpha <= 1:
        raise ConfigError(f"probes.ewma_alpha: must be in (0, 1], got {cfg.probes.ewma_alpha}")
    if not 0 <= cfg.routing.prefix_min_fraction <= 1:
        raise ConfigError("routing.prefix_min_fraction: must be in [0, 1]")
    from ext_proc.policy import POLICIES  # late import: policies import config types

    if cfg.policy not in POLICIES:
        raise ConfigError(
            f"policy: unknown policy {cfg.policy!r} (known: {', '.join(sorted(POLICIES))})"
        )


def _validate_tls(cfg: Config) -> None:
    for key, tls in (
        ("listen.tls", cfg.listen.tls),
        ("envoy.ext_proc_tls", cfg.envoy.ext_proc_tls),
    ):
        if bool(tls.cert_file) != bool(tls.key_file):
            raise ConfigError(f"{key}: cert_file and key_file go together (one is missing)")
    if cfg.listen.tls.client_ca_file and not cfg.listen.tls.cert_file:
        raise ConfigError("listen.tls.client_ca_file: mTLS needs cert_file and key_file too")
    client = cfg.envoy.ext_proc_tls
    if (client.cert_file or client.server_name) and not client.ca_file:
        raise ConfigError("envoy.ext_proc_tls: cert_file and server_name need ca_file")
    # One file configures both sides of the generated Envoy config: a mismatch would make
    # every request fail open silently.
    if cfg.listen.tls.cert_file and not client.ca_file:
        raise ConfigError(
            "envoy.ext_proc_tls.ca_file: required when listen.tls is set (the generated "
            "Envoy config would speak plaintext to a TLS port)"
        )
    if cfg.listen.tls.client_ca_file and not client.cert_file:
        raise ConfigError(
            "envoy.ext_proc_tls.cert_file: required when listen.tls.client_ca_file is set "
            "(the router would refuse Envoy without a client certificate)"
        )


def config_from_dict(raw: Any) -> Config:
    cfg = _build(Config, raw, "")
    _validate(cfg)
    return cfg


def load_config(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    try:
        return config_from_dict(raw if raw is not None else {})
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from e
