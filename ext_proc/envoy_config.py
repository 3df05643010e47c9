"""Generate the Envoy front-door config from the same backend list the service uses.

`gorgo envoy-config --config FILE` prints it; `gorgo up` writes it before starting Envoy;
envoy/front-door.yaml is this output for config/gorgo.yaml (a test keeps them equal).
"""

from __future__ import annotations

import ipaddress
from typing import Any

import yaml

from ext_proc.config import Backend, Config, split_host_port
from ext_proc.names import (
    ACCESS_LOG_NAME,
    HEADER_BACKEND,
    ROUTE_FALLBACK,
    ROUTE_GORGO,
    ROUTING_HEADERS,
)

EXT_PROC_CLUSTER = "gorgo_ext_proc"
FALLBACK_CLUSTER = "gorgo_fallback"
# Endpoint metadata that names each endpoint's backend id, so the response can echo the
# backend even when the fallback cluster (all backends) served the request.
METADATA_NAMESPACE = "gorgo"

# Far above any fleet's concurrency: Envoy's default of 1024 would cap LLM streams.
CIRCUIT_BREAKER_LIMIT = 1_000_000

_TYPE = "@type"
_API = "type.googleapis.com/envoy"


def _socket(address: str, key: str) -> dict[str, Any]:
    host, port = split_host_port(address, key)
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _endpoint(b: Backend) -> dict[str, Any]:
    return {
        "endpoint": {"address": _socket(b.address, f"backend {b.id}")},
        "metadata": {"filter_metadata": {METADATA_NAMESPACE: {"backend": b.id}}},
    }


def _circuit_breakers() -> dict[str, Any]:
    limit = CIRCUIT_BREAKER_LIMIT
    return {
        "thresholds": [
            {
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": 3,
            }
        ]
    }


def _cluster(name: str, backends: list[Backend], cfg: Config, lb: str) -> dict[str, Any]:
    dns = any(not _is_ip(split_host_port(b.address, b.id)[0]) for b in backends)
    return {
        "name": name,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": f"{cfg.envoy.connect_timeout_s}s",
        "lb_policy": lb,
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [_endpoint(b) for b in backends]}],
        },
    }


def _ext_proc_cluster(cfg: Config) -> dict[str, Any]:
    host, _port = split_host_port(cfg.ext_proc_address, "envoy.ext_proc_address")
    return {
        "name": EXT_PROC_CLUSTER,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "circuit_breakers": _circuit_breakers(),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _TYPE: f"{_API}.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EXT_PROC_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket(cfg.ext_proc_address, "ext_proc_address")}}
                    ]
                }
            ],
        },
    }


def _ext_proc_filters(cfg: Config) -> list[dict[str, Any]]:
    """Two ext_proc filters to the same service: one routes (Envoy waits for it), one
    observes the first response chunk without holding it (observability mode)."""
    typed = f"{_API}.extensions.filters.http.ext_proc.v3.ExternalProcessor"
    grpc_service = {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}}
    route = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPE: typed,
            "grpc_service": grpc_service,
            # Fail open: if the router is down or slow, Envoy forwards the request without
            # the routing header and the fallback route serves it.
            "failure_mode_allow": True,
            "message_timeout": f"{cfg.envoy.message_timeout_ms / 1000}s",
            # Two messages, each one gRPC round trip on the request's path.
            "processing_mode": {
                # Needed even though routing reads the body: with headers skipped Envoy
                # forwards them at once and a body-phase route change is ignored.
                "request_header_mode": "SEND",
                # The whole body in one message: routing needs the prompt before the
                # upstream is chosen. Bounded by the listener's buffer limit.
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    observe = {
        "name": "gorgo.observe",
        "typed_config": {
            _TYPE: typed,
            "grpc_service": grpc_service,
            "failure_mode_allow": True,
            # Envoy sends and does not wait: timing the first token never delays it.
            "observability_mode": True,
            "processing_mode": {
                "request_header_mode": "SEND",  # carries the request id
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SKIP",
                # The first chunk is TTFT; the server then closes the stream, so no later
                # chunk reaches Python.
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    return [route, observe]


def _access_log() -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            _TYPE: f"{_API}.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": ACCESS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
                # Completion feeds the in-flight count: send each entry at once.
                "buffer_size_bytes": 0,
                "buffer_flush_interval": "0.05s",
            },
            "additional_response_headers_to_log": [HEADER_BACKEND],
        },
    }


def _route(cfg: Config) -> dict[str, Any]:
    timeout = f"{cfg.envoy.route_timeout_s}s"
    return {
        "name": "gorgo",
        "virtual_hosts": [
            {
                "name": "llm",
                "domains": ["*"],
                "routes": [
                    {
                        "name": ROUTE_GORGO,
                        "match": {
                            "prefix": "/",
                            "headers": [{"name": HEADER_BACKEND, "present_match": True}],
                        },
                        "route": {"cluster_header": HEADER_BACKEND, "timeout": timeout},
                    },
                    {
                        # No routing header: the router failed open, skipped a non-LLM
                        # call, or could not read the body. Least-request over all.
                        "name": ROUTE_FALLBACK,
                        "match": {"prefix": "/"},
                        "route": {"cluster": FALLBACK_CLUSTER, "timeout": timeout},
                    },
                ],
                "response_headers_to_add": [
                    {
                        "header": {
                            "key": HEADER_BACKEND,
                            "value": f"%UPSTREAM_METADATA({METADATA_NAMESPACE}:backend)%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
            }
        ],
    }


def build_envoy_config(cfg: Config, ext_proc: bool = True) -> dict[str, Any]:
    """The front door. ext_proc=False gives the same proxy without the router (every
    request takes the fallback route): the baseline of the overhead benchmark."""
    backends = list(cfg.backends)
    hcm = {
        _TYPE: f"{_API}.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "front_door",
        "generate_request_id": True,
        # Client-sent routing headers are removed before any filter or route sees them.
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    _TYPE: f"{_API}.extensions.http.early_header_mutation.header_mutation.v3"
                    ".HeaderMutation",
                    "mutations": [{"remove": h} for h in ROUTING_HEADERS],
                },
            }
        ],
        "access_log": [_access_log()] if ext_proc else [],
        "route_config": _route(cfg),
        "http_filters": [
            *(_ext_proc_filters(cfg) if ext_proc else []),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {_TYPE: f"{_API}.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    return {
        "admin": {"address": _socket(cfg.envoy.admin, "envoy.admin")},
        "static_resources": {
            "listeners": [
                {
                    "name": "front_door",
                    "address": _socket(cfg.envoy.listen, "envoy.listen"),
                    # Buffered routing needs the whole body in memory; Envoy answers 413
                    # beyond this (default 1 MiB).
                    "per_connection_buffer_limit_bytes": cfg.envoy.max_body_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                *(_cluster(b.id, [b], cfg, "ROUND_ROBIN") for b in backends),
                _cluster(FALLBACK_CLUSTER, backends, cfg, "LEAST_REQUEST"),
                _ext_proc_cluster(cfg),
            ],
        },
    }


def render_envoy_config(cfg: Config, ext_proc: bool = True) -> str:
    header = (
        "# Generated by `gorgo envoy-config` from the gorgo config; do not edit by hand.\n"
        "# Front door: ext_proc picks the backend (x-gorgo-backend -> cluster_header route),\n"
        "# fail-open fallback route, completion reported over the gRPC access log.\n"
    )
    return header + yaml.safe_dump(build_envoy_config(cfg, ext_proc), sort_keys=False, width=100)
