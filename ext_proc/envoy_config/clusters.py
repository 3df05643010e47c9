"""Envoy's clusters for the fleet: one per backend (EDS files with envoy.xds_dir), the
endpoint-picker pool, the router's own gRPC cluster; the names and helpers the bootstrap
(bootstrap.py) builds on.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection
from typing import Any

from ext_proc.common.names import (
    HEADER_GATEWAY_ENDPOINT,
    LB_METADATA_NAMESPACE,
)
from ext_proc.config.schema import Config
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import split_host_port

EXT_PROC_CLUSTER = "gorgo_ext_proc"
FALLBACK_CLUSTER = "gorgo_fallback"
# endpoint_picker mode: one cluster of every backend, the endpoint picked per request.
POOL_CLUSTER = "gorgo_pool"
OTEL_CLUSTER = "otel_collector"
# The observing ext_proc filter's stats prefix (the routing filter's stats have none).
OBSERVE_STAT_PREFIX = "gorgo_observe"
# Endpoint metadata that names each endpoint's backend id, so the response can echo the
# backend even when the fallback cluster (all backends) served the request.
METADATA_NAMESPACE = "gorgo"

# Far above any fleet's concurrency: Envoy's default of 1024 would cap LLM streams.
CIRCUIT_BREAKER_LIMIT = 1_000_000

TYPE = "@type"
API = "type.googleapis.com/envoy"


def socket_address(address: str, key: str) -> dict[str, Any]:
    host, port = split_host_port(address, key)
    return {"socket_address": {"address": host, "port_value": port}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def endpoint(b: Backend) -> dict[str, Any]:
    return {
        "endpoint": {"address": socket_address(b.address, f"backend {b.id}")},
        "metadata": {"filter_metadata": {METADATA_NAMESPACE: {"backend": b.id}}},
    }


def circuit_breakers() -> dict[str, Any]:
    limit = CIRCUIT_BREAKER_LIMIT
    return {
        "thresholds": [
            {
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                # Concurrent retries: only connect failures are retried (no backend did
                # any work), so a dead backend under load must not exhaust this.
                "max_retries": limit,
            }
        ]
    }


def cluster(
    name: str, backends: list[Backend], cfg: Config, lb: str, standby: list[Backend] | None = None
) -> dict[str, Any]:
    """A cluster of `backends`; each `standby` backend sits at its own priority (1, 2, ...),
    used only by a retry (previous_priorities moves each retry one priority on) or when
    every higher priority is down."""
    every = [*backends, *(standby or [])]
    dns = any(not is_ip(split_host_port(b.address, b.id)[0]) for b in every)
    endpoints: list[dict[str, Any]] = [{"lb_endpoints": [endpoint(b) for b in backends]}]
    for priority, b in enumerate(standby or [], start=1):
        endpoints.append({"priority": priority, "lb_endpoints": [endpoint(b)]})
    return {
        "name": name,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": f"{cfg.envoy.connect_timeout_s}s",
        "lb_policy": lb,
        "circuit_breakers": circuit_breakers(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": endpoints,
        },
    }


def pool_cluster(cfg: Config, backends: list[Backend]) -> dict[str, Any]:
    """endpoint_picker mode: every backend in one cluster; Envoy's override_host policy
    sends each request to the endpoint the router named (header or envoy.lb metadata),
    and falls back to least request when none is named."""
    c = cluster(POOL_CLUSTER, backends, cfg, "LEAST_REQUEST")
    del c["lb_policy"]
    lb = "type.googleapis.com/envoy.extensions.load_balancing_policies"
    c["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        TYPE: f"{lb}.override_host.v3.OverrideHost",
                        "override_host_sources": [
                            {"header": HEADER_GATEWAY_ENDPOINT},
                            {
                                "metadata": {
                                    "key": LB_METADATA_NAMESPACE,
                                    "path": [{"key": HEADER_GATEWAY_ENDPOINT}],
                                }
                            },
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {
                                            TYPE: f"{lb}.least_request.v3.LeastRequest"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }
    return c


def grpc_cluster(name: str, address: str, key: str, *more: str) -> dict[str, Any]:
    """`more`: further endpoints of the same cluster (several router processes)."""
    host, _port = split_host_port(address, key)
    return {
        "name": name,
        "type": "STATIC" if is_ip(host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "circuit_breakers": circuit_breakers(),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                TYPE: f"{API}.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket_address(a, key)}} for a in (address, *more)
                    ]
                }
            ],
        },
    }


def backend_clusters(cfg: Config, draining: Collection[str] = ()) -> list[dict[str, Any]]:
    """The clusters that change with the fleet: each backend's (with the others as
    standby) and the fail-open fallback (cluster mode), or the pool (endpoint_picker).

    A `draining` backend keeps its own cluster (a decision made just before the drain, or
    a connect retry, still finds it) but gets no new work behind the router's back: it
    is left out of the fallback, the pool and the other clusters' standbys."""
    backends = list(cfg.backends)
    open_ = [b for b in backends if b.id not in draining] or backends
    if cfg.envoy.mode == "endpoint_picker":
        return [pool_cluster(cfg, open_)]
    by_rtt = sorted(open_, key=lambda b: b.rtt_prior_ms)
    return [
        # Each backend's cluster holds the others as standby, nearest first, so a
        # connect failure is retried on another backend (Envoy's retries stay inside
        # one cluster) and each further retry on yet another.
        *(
            cluster(b.id, [b], cfg, "ROUND_ROBIN", [o for o in by_rtt if o is not b])
            for b in backends
        ),
        cluster(FALLBACK_CLUSTER, open_, cfg, "LEAST_REQUEST"),
    ]


# envoy.xds_dir: the CDS file Envoy's bootstrap names; each EDS cluster's endpoints are
# in eds-<cluster>.yaml beside it (ext_proc/envoy_config/xds.py writes them).
CDS_FILE = "cds.yaml"


def eds_file(cluster: str) -> str:
    return f"eds-{cluster}.yaml"


def xds_path(cfg: Config, file: str) -> str:
    """Absolute, so Envoy and the router find the same file whatever their directories."""
    return os.path.join(os.path.abspath(cfg.envoy.xds_dir), file)


def file_config_source(path: str) -> dict[str, Any]:
    """A filesystem xDS subscription: Envoy reads `path` and reloads it whenever a file is
    moved onto it (the atomic rename of xds.py); a write in place is not seen."""
    return {"resource_api_version": "V3", "path_config_source": {"path": path}}
