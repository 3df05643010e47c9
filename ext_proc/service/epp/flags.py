"""`gorgo epp`'s command line: the flags of the Gateway API Inference Extension's endpoint
picker (v1.5, pkg/epp/server/options.go and its logging options), which its
`inferencepool` chart hard-codes (`--pool-name`, `--pool-namespace`, `--config-file`,
`--endpoint-selector`, ...), so our image can take its place. The flags that mean
something here are used; the others are accepted with a warning naming them, so a chart
of any version starts us. Go's flag syntax is taken as the chart writes it: one or two
dashes, `--flag value` or `--flag=value`, a boolean with or without a value.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from ext_proc.config.discovery import POOL_GROUP
from ext_proc.vocab.backend import EngineKind
from ext_proc.vocab.params import ConfigError

log = logging.getLogger("gorgo.epp")

# The extension's ports, which its chart's Deployment, Service and probes name.
GRPC_PORT = 9002
GRPC_HEALTH_PORT = 9003
METRICS_PORT = 9090

# The extension's flags that have no meaning here: accepted (with a warning when given).
IGNORED = (
    "model-server-metrics-scheme",
    "model-server-metrics-path",
    "model-server-metrics-port",
    "model-server-metrics-https-insecure-skip-verify",
    "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval",
    "metrics-staleness-threshold",
    "lora-info-metric",
    "cache-info-metric",
    "health-checking",
    "enable-pprof",
    "enable-cert-reload",
    "metrics-endpoint-auth",
    "zap-devel",
    "zap-log-level",
    "zap-stacktrace-level",
    "zap-time-encoding",
)
# The chart passes the engine's metric names for SGLang (and Triton): they say which
# engine the pool runs.
ENGINE_HINTS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
)


def go_bool(text: str) -> bool:
    """A boolean as Go's strconv.ParseBool reads it."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def port_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ports like 8000,8001, got {text!r}") from None


@dataclass
class EppOptions:
    """What the flags say, after parsing."""

    grpc_port: int = GRPC_PORT
    grpc_health_port: int = GRPC_HEALTH_PORT
    metrics_port: int = METRICS_PORT
    # Where the three ports listen (a pod: every interface).
    address: str = "0.0.0.0"
    pool_name: str = ""
    pool_namespace: str = ""
    pool_group: str = POOL_GROUP
    endpoint_selector: str = ""
    endpoint_target_ports: tuple[int, ...] = ()
    kubeconfig: str = ""
    config_file: str = ""
    config_text: str = ""
    secure_serving: bool = True
    cert_path: str = ""
    tracing: bool = True
    disable_endpoint_subset_filter: bool = False
    # Active-passive replicas: only the holder of a Lease is ready (loops/leader.py).
    leader_election: bool = False
    verbosity: int = 1
    zap_encoder: str = "console"
    engine: EngineKind | None = None
    # What was given that means nothing here, for the warning.
    ignored: list[str] = field(default_factory=list)


def _flag(p: argparse.ArgumentParser, name: str, **kw: Any) -> None:
    """One flag under both of Go's spellings, --name and -name."""
    p.add_argument(f"--{name}", f"-{name}", **kw)


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    _flag(p, name, type=go_bool, nargs="?", const=True, default=default, help=help)


def add_epp_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "grpc-port", type=int, default=GRPC_PORT, help="ext_proc gRPC port (Envoy's)")
    _flag(p, "grpc-health-port", type=int, default=GRPC_HEALTH_PORT, help="gRPC health port")
    _flag(p, "metrics-port", type=int, default=METRICS_PORT, help="Prometheus /metrics port")
    p.add_argument(
        "--address", default="0.0.0.0", help="where the ports listen (ours: not a chart flag)"
    )
    _flag(p, "pool-name", default="", help="the InferencePool whose pods are the backends")
    _flag(p, "pool-namespace", default="", help="its namespace (default: $NAMESPACE, else default)")
    _flag(p, "pool-group", default=POOL_GROUP, help="the InferencePool's API group")
    _flag(p, "endpoint-selector", default="", help="or the pods by label: key=value[,...]")
    _flag(p, "endpoint-target-ports", type=port_list, default=(), help="their ports: 8000[,...]")
    _flag(p, "kubeconfig", default="", help="kubeconfig file (default: in-cluster)")
    _flag(p, "config-file", default="", help="gorgo's YAML config (the chart's plugins file)")
    _flag(p, "config-text", default="", help="the same, as text")
    _bool_flag(p, "secure-serving", True, "TLS on the ext_proc port")
    _flag(
        p,
        "cert-path",
        default="",
        help="a directory with tls.crt and tls.key (default: "
        "a self-signed certificate made at start)",
    )
    _bool_flag(p, "tracing", True, "export decision spans (OTEL_EXPORTER_OTLP_ENDPOINT)")
    _bool_flag(p, "disable-endpoint-subset-filter", False, "ignore the subset hint")
    _bool_flag(
        p,
        "ha-enable-leader-election",
        False,
        "active-passive replicas: only the holder of a Lease (gorgo-epp-<pool>) is ready",
    )
    _flag(p, "v", type=int, default=1, help="log verbosity (3 and up: debug)")
    _flag(p, "zap-encoder", default="console", choices=("console", "json"), help="log format")
    for name in ENGINE_HINTS:
        _flag(p, name, default="", help=argparse.SUPPRESS)
    for name in IGNORED:
        _flag(p, name, nargs="?", const="true", default=None, help=argparse.SUPPRESS)


def epp_options(args: argparse.Namespace, unknown: Sequence[str] = ()) -> EppOptions:
    """The parsed flags as options; `unknown`: what the parser did not know."""
    hints = {getattr(args, n.replace("-", "_")) for n in ENGINE_HINTS} - {""}
    engine = None
    if any(h.strip('"').startswith("sglang") for h in hints):
        engine = EngineKind.SGLANG
    elif any(h.strip('"').startswith("vllm") for h in hints):
        engine = EngineKind.VLLM
    elif hints:
        log.warning("gorgo epp: engine metrics %s are not SGLang's or vLLM's", sorted(hints))
    ignored = [f"--{n}" for n in IGNORED if getattr(args, n.replace("-", "_")) is not None]
    return EppOptions(
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        address=args.address,
        pool_name=args.pool_name,
        pool_namespace=args.pool_namespace,
        pool_group=args.pool_group,
        endpoint_selector=args.endpoint_selector,
        endpoint_target_ports=args.endpoint_target_ports,
        kubeconfig=args.kubeconfig,
        config_file=args.config_file,
        config_text=args.config_text,
        secure_serving=args.secure_serving,
        cert_path=args.cert_path,
        tracing=args.tracing,
        disable_endpoint_subset_filter=args.disable_endpoint_subset_filter,
        leader_election=args.ha_enable_leader_election,
        verbosity=args.v,
        zap_encoder=args.zap_encoder,
        engine=engine,
        ignored=ignored + [u for u in unknown if u.startswith("-")],
    )


def config_dict(opts: EppOptions) -> dict[str, Any]:
    """The router's config as a dict: the gorgo YAML given (or none), with what the flags
    decide laid over it: endpoint-picker mode, the ports, the pool to discover."""
    if opts.config_file and opts.config_text:
        raise ConfigError("--config-file and --config-text: one or the other")
    raw: Any = {}
    where = "--config-text"
    if opts.config_file:
        where = opts.config_file
        try:
            with open(opts.config_file, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"--config-file: cannot read {opts.config_file}: {e.strerror}") from e
    elif opts.config_text:
        raw = yaml.safe_load(opts.config_text)
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a gorgo config (a mapping)")
    if raw.get("kind") == "EndpointPickerConfig":
        # The chart's default plugins file is the extension's own: its plugins are not ours.
        log.warning(
            "gorgo epp: %s is the extension's EndpointPickerConfig, not a gorgo config: "
            "running with gorgo's defaults (set the chart's pluginsConfigFile to a gorgo "
            "config to tune it; docs/envoy.md)",
            where,
        )
        raw = {}
    out: dict[str, Any] = dict(raw)
    raw = out
    discovers = opts.pool_name or opts.endpoint_selector or raw.get("discovery")
    if not discovers and not raw.get("backends"):
        raise ConfigError("--pool-name or --endpoint-selector is required")
    if opts.pool_name and opts.endpoint_selector:
        raise ConfigError("--pool-name or --endpoint-selector, not both")
    discovery = dict(raw.get("discovery") or {})
    kube = dict(discovery.get("kubernetes") or {})
    if opts.pool_name:
        kube.update(pool_name=opts.pool_name, pool_group=opts.pool_group)
    if opts.endpoint_selector:
        kube.update(
            endpoint_selector=opts.endpoint_selector,
            target_ports=list(opts.endpoint_target_ports),
        )
    if opts.pool_namespace:
        kube["namespace"] = opts.pool_namespace
    if opts.kubeconfig:
        kube["kubeconfig"] = opts.kubeconfig
    if opts.leader_election:
        kube["leader_election"] = {**(kube.get("leader_election") or {}), "enabled": True}
    discovery["kubernetes"] = kube
    template = dict(discovery.get("backend") or {})
    if opts.engine is not None:
        template.setdefault("engine", str(opts.engine))
    discovery["backend"] = template
    raw["discovery"] = discovery
    listen = dict(raw.get("listen") or {})
    listen["grpc"] = f"{opts.address}:{opts.grpc_port}"
    listen["admin"] = f"{opts.address}:{opts.metrics_port}"
    raw["listen"] = listen
    envoy = {**(raw.get("envoy") or {}), "mode": "endpoint_picker"}
    if opts.disable_endpoint_subset_filter:
        envoy["obey_subset_hint"] = False
    # The chart's Envoy routes to one address (ORIGINAL_DST): no fallback list after it.
    envoy.setdefault("connect_retries", 0)
    raw["envoy"] = envoy
    if not opts.tracing:
        raw["telemetry"] = {**(raw.get("telemetry") or {}), "sample_ratio": 0.0}
    return out
