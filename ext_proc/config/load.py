"""Load and check the config: decode the YAML strictly (unknown keys, wrong types, values
outside a field's declared range and keys that moved raise `ConfigError` naming the key,
e.g. `envoy.max_body_bytes`), then the checks across fields (`_validate`). Policy-only
knobs under `policies.<name>:` are decoded by the policy's own parameter class. A section
renamed (its field's `renamed_from`, as `bus:` once `fleet:`) still loads under its old
name, with a warning naming the new one; both names at once is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ext_proc.config.kv_endpoints import validate_distinct_binds, validate_kv_events
from ext_proc.config.kv_link import validate_kv_links, validate_roles
from ext_proc.config.schema import Config, TelemetryConfig
from ext_proc.estimate.profile import load_profile
from ext_proc.policy.catalog import POLICIES
from ext_proc.prompt.engine_tokens import load_engine_tokenizer
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import ConfigError, split_host_port

# What a backend id may be: it names an Envoy cluster and a routing header's value.
_BACKEND_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")

# An admin_hosts entry: a name or IP as a Host header writes it, with or without a port.
_ADMIN_HOST = re.compile(r"^([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?$")

log = logging.getLogger("gorgo.config")

# Keys that moved: an old config fails with the new key's name instead of a bare
# "unknown key".
MOVED = {
    "weights": "policies.gorgo.weights",
    "token_weights": "policies.gorgo_tokens.weights",
    "routing.tie_ms": "policies.gorgo.tie_ms",
    "routing.tie_fraction": "policies.gorgo.tie_fraction (and policies.gorgo_tokens.tie_fraction)",
    "routing.affinity_prefix_tokens": "policies.session_affinity.prefix_tokens",
    "routing.prefix_min_fraction": "policies.prefix_cache.min_fraction",
    "routing.balance_abs": "policies.prefix_cache.balance_abs",
    "routing.balance_rel": "policies.prefix_cache.balance_rel",
    # Dispatch pacing keeps same-instant dispatches in order, so none overtakes another.
    "policies.gorgo.overtake_weight": "routing.pace_sigmas (dispatch pacing replaced the "
    "overtake term)",
    # The learned speed factors replaced refitting the profile's prefill coefficients.
    "routing.refit_prefill": "routing.learn_latency (on by default: each backend's speed "
    "is learned against its profile)",
}


def _policies(raw: Any, _typ: Any, key: str) -> dict[str, Any]:
    """policies.<name>: each decoded by that policy's own parameter class."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for name, params in raw.items():
        if name not in POLICIES:
            raise ConfigError(
                f"{key}.{name}: unknown policy (known: {', '.join(sorted(POLICIES))})"
            )
        out[name] = decode(POLICIES[name].params, params or {}, f"{key}.{name}")
    return out


T = TypeVar("T")


def _convert(value: Any, typ: Any, key: str) -> Any:
    origin = get_origin(typ)
    if dataclasses.is_dataclass(typ) and isinstance(typ, type):
        return decode(typ, value, key)
    if isinstance(typ, type) and issubclass(typ, enum.StrEnum):
        choices = [m.value for m in typ]
        if value not in choices:
            raise ConfigError(f"{key}: expected {' or '.join(choices)}, got {value!r}")
        return typ(value)
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


def decode(cls: type[T], raw: Any, prefix: str) -> T:
    """Build dataclass `cls` from a YAML mapping, strictly: every error names its key."""
    where = prefix or "config"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    old_names = {
        f.metadata["renamed_from"] for f in fields.values() if "renamed_from" in f.metadata
    }
    # by their text: YAML keys may be numbers or null beside strings (found by fuzzing:
    # sorting them raised TypeError)
    unknown = sorted((k for k in raw if k not in fields and k not in old_names), key=str)
    if unknown:
        dotted = f"{prefix}.{unknown[0]}" if prefix else str(unknown[0])
        if dotted in MOVED:
            raise ConfigError(f"{dotted}: moved to {MOVED[dotted]}")
        near = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"{dotted}: unknown key ({hint}expected one of: {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        written = _written_as(f, raw, prefix)
        if written in raw:
            decoder = _DECODERS.get(f.metadata.get("decode", ""), _convert)
            key = f"{prefix}.{written}" if prefix else written  # errors name what was written
            kwargs[name] = decoder(raw[written], hints[name], key)
            limits = f.metadata.get("range")
            if limits is not None:
                limits.check(kwargs[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required key is missing")
    return cls(**kwargs)


def _written_as(f: dataclasses.Field[Any], raw: Mapping[Any, Any], prefix: str) -> str:
    """The key a field is written under in `raw`: its name, or the old name it was renamed
    from (a warning says to write the new one); both at once is an error naming both."""
    old = f.metadata.get("renamed_from")
    if old is None or old not in raw:
        return f.name
    new_key, old_key = (f"{prefix}.{n}" if prefix else n for n in (f.name, old))
    if f.name in raw:
        raise ConfigError(
            f"{new_key}: given twice, as {new_key} and as {old_key} (its old name): keep "
            f"{new_key} only"
        )
    log.warning("config: %s is deprecated, renamed %s: write %s: instead", old_key, new_key, f.name)
    return str(old)


def _validate(cfg: Config) -> None:
    """Checks across fields (each field's own range is checked where it is decoded)."""
    if not cfg.backends and not cfg.discovery.enabled:
        raise ConfigError(
            "backends: at least one backend is required (or discovery.kubernetes to find them)"
        )
    _validate_discovery(cfg)
    seen: set[str] = set()
    for i, b in enumerate(cfg.backends):
        validate_backend(b, f"backends[{i}].")
        if b.id in seen:
            raise ConfigError(f"backends[{i}].id: duplicate backend id {b.id!r}")
        seen.add(b.id)
    validate_distinct_binds(cfg.backends)
    validate_roles(cfg.backends)
    validate_kv_links(cfg.routing.kv_link)
    split_host_port(cfg.listen.grpc, "listen.grpc")
    split_host_port(cfg.listen.admin, "listen.admin")
    for i, host in enumerate(cfg.listen.admin_hosts):
        if not _ADMIN_HOST.match(host):
            raise ConfigError(
                f"listen.admin_hosts[{i}]: expected a host name or name:port as a client "
                f"sends it in Host (gorgo, gorgo.gorgo.svc:9180, [::1]), got {host!r}"
            )
    split_host_port(cfg.envoy.listen, "envoy.listen")
    split_host_port(cfg.envoy.admin, "envoy.admin")
    split_host_port(cfg.ext_proc_address, "envoy.ext_proc_address")
    for i, address in enumerate(cfg.envoy.ext_proc_addresses):
        split_host_port(address, f"envoy.ext_proc_addresses[{i}]")
    if cfg.envoy.tracing_endpoint:
        split_host_port(cfg.envoy.tracing_endpoint, "envoy.tracing_endpoint")
    _validate_tls(cfg)
    _validate_otlp(cfg.telemetry)
    nats = cfg.bus.nats_url
    if nats and not re.match(
        r"^(nats|tls)://[^/\s]+:\d{1,5}(,(nats|tls)://[^/\s]+:\d{1,5})*$", nats
    ):
        raise ConfigError(f"bus.nats_url: expected nats://HOST:PORT[,nats://...], got {nats!r}")
    if not re.match(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", cfg.bus.subject):
        raise ConfigError(
            f"bus.subject: NATS subject tokens (letters, digits, '_', '-', dot-separated), "
            f"got {cfg.bus.subject!r}"
        )
    if cfg.bus.router_id and not re.match(r"^[A-Za-z0-9_-]+$", cfg.bus.router_id):
        raise ConfigError(
            f"bus.router_id: letters, digits, '_' or '-' (one subject token), "
            f"got {cfg.bus.router_id!r}"
        )
    if cfg.tokenizer.path or cfg.tokenizer.chat_template:
        load_engine_tokenizer(cfg.tokenizer)  # the files exist, parse and have a template
    # A decision paced longer than Envoy waits for it would take the fallback route.
    if cfg.routing.pace_max_ms * 2 > cfg.envoy.message_timeout_ms:
        raise ConfigError(
            f"routing.pace_max_ms: at most half of envoy.message_timeout_ms "
            f"({cfg.envoy.message_timeout_ms}), got {cfg.routing.pace_max_ms:g}"
        )
    interval_s = cfg.probes.metrics_interval_s
    if 0 < interval_s < 0.1:
        raise ConfigError(f"probes.metrics_interval_s: at least 0.1 (or 0 = off), got {interval_s}")
    _validate_models(cfg)
    _validate_flow_control(cfg)
    if cfg.policy not in POLICIES:
        raise ConfigError(
            f"policy: unknown policy {cfg.policy!r} (known: {', '.join(sorted(POLICIES))})"
        )


def _validate_discovery(cfg: Config) -> None:
    k8s = cfg.discovery.kubernetes
    key = "discovery.kubernetes"
    if k8s.pool_name and k8s.endpoint_selector:
        raise ConfigError(f"{key}: pool_name or endpoint_selector, not both")
    if k8s.endpoint_selector:
        parse_selector(k8s.endpoint_selector, f"{key}.endpoint_selector")
        if not 1 <= len(k8s.target_ports) <= 8:
            raise ConfigError(f"{key}.target_ports: 1 to 8 ports go with endpoint_selector")
    elif k8s.target_ports:
        raise ConfigError(f"{key}.target_ports: only with endpoint_selector (a pool names its own)")
    for i, port in enumerate(k8s.target_ports):
        if not 0 < port < 65536:
            raise ConfigError(f"{key}.target_ports[{i}]: a port 1-65535, got {port}")
    le = k8s.leader_election
    if le.enabled and not k8s.enabled:
        raise ConfigError(f"{key}.leader_election: needs pool_name or endpoint_selector")
    # kubernetes_asyncio's election refuses anything else (leaderelection/electionconfig.py)
    if not (le.lease_duration_s > le.renew_deadline_s > 1.2 * le.retry_period_s >= 1.2):
        raise ConfigError(
            f"{key}.leader_election: need lease_duration_s > renew_deadline_s > "
            f"1.2 x retry_period_s, retry_period_s >= 1; got {le.lease_duration_s}, "
            f"{le.renew_deadline_s}, {le.retry_period_s}"
        )
    # The template as a backend would be (a placeholder id and address).
    validate_backend(cfg.discovery.backend.backend("template", "127.0.0.1:1"), "discovery.backend.")


def parse_selector(text: str, key: str) -> dict[str, str]:
    """`key=value[,key=value]` (the extension's --endpoint-selector) as a label map."""
    labels: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name or any(c.isspace() for c in part):
            raise ConfigError(f"{key}: expected key=value[,key=value] without spaces, got {text!r}")
        labels[name] = value
    return labels


def _validate_flow_control(cfg: Config) -> None:
    fc = cfg.flow_control
    names = _unique_names([o.name for o in fc.objectives], "flow_control.objectives")
    regions = {b.region for b in cfg.backends}
    if cfg.discovery.enabled:  # the backends it will find are in the template's region
        regions.add(cfg.discovery.backend.region)
    for i, o in enumerate(fc.objectives):
        key = f"flow_control.objectives[{i}]"
        for j, region in enumerate(o.regions):
            if region not in regions:
                known = ", ".join(sorted(r for r in regions if r)) or "none"
                raise ConfigError(
                    f"{key}.regions[{j}]: no backend is in region {region!r} (regions: {known})"
                )
    if fc.default_objective and fc.default_objective not in names:
        raise ConfigError(
            f"flow_control.default_objective: {fc.default_objective!r} is not one of "
            f"flow_control.objectives ({', '.join(sorted(names)) or 'none'})"
        )
    for name in ("objective_header", "tenant_header", "slo_header"):
        header = getattr(fc, name)
        if not header or header != header.lower() or not header.replace("-", "").isalnum():
            raise ConfigError(
                f"flow_control.{name}: {header!r} is not a lower-case HTTP header name"
            )


def _unique_names(names: list[str], key: str) -> set[str]:
    """The names of a list's items: each given, none twice (the error names the item)."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not name:
            raise ConfigError(f"{key}[{i}].name: a name is required")
        if name in seen:
            raise ConfigError(f"{key}[{i}].name: {name!r} listed twice")
        seen.add(name)
    return seen


def _validate_models(cfg: Config) -> None:
    _unique_names([alias.name for alias in cfg.models], "models")
    for i, alias in enumerate(cfg.models):
        key = f"models[{i}]"
        if not alias.served:
            raise ConfigError(f"{key}.served: at least one served model is required")
        for j, share in enumerate(alias.served):
            if not share.model:
                raise ConfigError(f"{key}.served[{j}].model: a model name is required")


def validate_backend(b: Backend, prefix: str = "") -> None:
    """One backend's checks across its fields; errors name `prefix` + the key."""
    if not _BACKEND_ID.match(b.id):
        raise ConfigError(
            f"{prefix}id: {b.id!r} must be lowercase letters, digits, '.', '_' or "
            "'-' (it becomes an Envoy cluster name and a header value)"
        )
    split_host_port(b.address, f"{prefix}address")
    validate_kv_events(b, prefix)
    try:
        load_profile(b.engine_profile)
    except ValueError as e:
        raise ConfigError(f"{prefix}engine_profile: {e}") from e


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


def _validate_otlp(t: TelemetryConfig) -> None:
    key = "telemetry.otlp_endpoint"
    if t.otlp_endpoint.startswith("https://"):  # the OTel variable's form: TLS by scheme
        bare = t.otlp_endpoint.split("://", 1)[1].rstrip("/")
        raise ConfigError(
            f"{key}: expected host:port without a scheme, got {t.otlp_endpoint!r} (write "
            f"{bare!r} and set telemetry.otlp_tls: true)"
        )
    if t.otlp_endpoint:
        split_host_port(t.otlp_endpoint, key)
    files = {"ca_file": t.otlp_ca_file, "cert_file": t.otlp_cert_file, "key_file": t.otlp_key_file}
    if bool(t.otlp_cert_file) != bool(t.otlp_key_file):
        raise ConfigError(
            "telemetry.otlp_cert_file, otlp_key_file: a client certificate and its key go "
            "together (one is missing)"
        )
    for name, path in files.items():
        if not path:
            continue
        if not t.otlp_tls:  # a certificate file means TLS was meant: never plaintext silently
            raise ConfigError(f"telemetry.otlp_{name}: set telemetry.otlp_tls: true to use it")
        try:
            pem = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"telemetry.otlp_{name}: cannot read {path!r}: {e.strerror}") from e
        if b"-----BEGIN " not in pem:
            raise ConfigError(f"telemetry.otlp_{name}: {path!r} is not a PEM file")


def config_from_dict(raw: Any) -> Config:
    cfg = decode(Config, raw, "")
    _validate(cfg)
    return cfg


def load_config(path: str | Path) -> Config:
    return read_config(path)[0]


def read_config(path: str | Path) -> tuple[Config, str]:
    """The config in `path` and the very text it was loaded from (what the router keeps
    as its last good config: service/last_good.py)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from e
    except UnicodeDecodeError as e:  # found by fuzzing: it escaped as no ConfigError
        raise ConfigError(f"{p}: not UTF-8 text: byte {e.start} ({e.reason})") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    try:
        return config_from_dict(raw if raw is not None else {}), text
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from e


def backend_from_dict(raw: Any) -> Backend:
    """One backend exactly as an item of `backends:` (the admin API's POST /backends);
    errors name the key as written in that object (`address`, `kv_events.endpoint`)."""
    b = decode(Backend, raw, "")
    validate_backend(b)
    return b


# Fields the schema marks for a decoder of their own (`field(metadata={"decode": NAME})`).
_DECODERS = {"policies": _policies}
