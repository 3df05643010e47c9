"""An Envoy configured as the Gateway API Inference Extension's standalone chart configures
its Envoy in front of an endpoint picker (config/charts/standalone, values.yaml, the
`envoy` preset), for gorgo as that picker: the e2e tests and `gorgo bench overhead
--picker-stream`.

As the chart: one route to an ORIGINAL_DST cluster that takes the upstream address from
`x-gateway-destination-endpoint`; an ext_proc filter with every phase sent and both bodies
FULL_DUPLEX_STREAMED (trailers SEND), a 1000 s message timeout, no failure_mode_allow; the
picker's cluster over TLS that accepts any certificate (an empty validation context), health
checked with the standard gRPC health service on the ext_proc service's name.

Beyond the chart, what the gateways that implement the protocol add (Envoy Gateway,
kgateway, Istio), needed for the two metadata entries of the protocol:
- `metadata_options`: the ext_proc filter forwards the `envoy.lb.subset_hint` and `envoy.lb`
  namespaces of the request's dynamic metadata to the picker, and accepts `envoy.lb` back.
- the subset hint: the control plane knows which endpoints a route may use; here it puts
  the list on the route's metadata (`SUBSET_ROUTE_HEADER` picks the route), and a Lua
  filter copies it into the request's dynamic metadata before ext_proc sends the headers.
- the served endpoint: the route adds `x-gateway-destination-endpoint-served:
  %UPSTREAM_HOST%` to the response, and a header-to-metadata filter after ext_proc moves it
  into `envoy.lb` (removed from the response), so the picker reads it in the response
  headers' metadata. `SERVED_ROUTE_HEADER` picks a route that reports a fixed endpoint
  instead, as a data plane that went on to another endpoint would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ext_proc.common.names import (
    EXT_PROC_SERVICE,
    HEADER_GATEWAY_ENDPOINT,
    HEADER_GATEWAY_ENDPOINT_SERVED,
    LB_METADATA_NAMESPACE,
    SUBSET_METADATA_KEY,
    SUBSET_METADATA_NAMESPACE,
)

API = "type.googleapis.com/envoy"
TYPE = "@type"
# Request headers that choose the test routes (a gateway's routes match on what it likes).
SUBSET_ROUTE_HEADER = "x-test-subset"
SERVED_ROUTE_HEADER = "x-test-served"
LUA_FILTER = "envoy.filters.http.lua"

# Copies the route's subset list (route metadata under the Lua filter's name) into the
# request's dynamic metadata, where the ext_proc filter forwards it from.
SUBSET_LUA = f"""
function envoy_on_request(handle)
  local subset = handle:metadata():get("subset")
  if subset ~= nil then
    handle:streamInfo():dynamicMetadata():set(
      "{SUBSET_METADATA_NAMESPACE}", "{SUBSET_METADATA_KEY}", subset)
  end
end
"""


# The chart's transport to the picker: TLS, any certificate accepted.
_TLS_ANY = {
    "transport_socket": {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            TYPE: f"{API}.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"validation_context": {}},
        },
    }
}


def _route(
    name: str, match_header: str | None, subset: Sequence[str] | None, served: str
) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": "/"}
    if match_header is not None:
        header, value = match_header.split("=", 1)
        match["headers"] = [{"name": header, "string_match": {"exact": value}}]
    route: dict[str, Any] = {
        "name": name,
        "match": match,
        "route": {
            "cluster": "original_destination_cluster",
            "timeout": "86400s",
            "idle_timeout": "86400s",
        },
        "response_headers_to_add": [
            {
                "header": {"key": HEADER_GATEWAY_ENDPOINT_SERVED, "value": served},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }
    if subset is not None:
        route["metadata"] = {"filter_metadata": {LUA_FILTER: {"subset": list(subset)}}}
    return route


def gateway_envoy_config(
    listen_port: int,
    admin_port: int,
    picker_port: int,
    subsets: Mapping[str, Sequence[str]] | None = None,
    served: Mapping[str, str] | None = None,
    tls: bool = True,
) -> str:
    """The YAML: `subsets` maps a value of SUBSET_ROUTE_HEADER to the route's subset list,
    `served` a value of SERVED_ROUTE_HEADER to the endpoint its responses report."""
    subsets = subsets or {}
    served = served or {}
    routes = [
        _route(f"subset-{k}", f"{SUBSET_ROUTE_HEADER}={k}", v, "%UPSTREAM_HOST%")
        for k, v in subsets.items()
    ]
    routes += [
        _route(f"served-{k}", f"{SERVED_ROUTE_HEADER}={k}", None, v) for k, v in served.items()
    ]
    routes.append(_route("default", None, None, "%UPSTREAM_HOST%"))
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            TYPE: f"{API}.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "ext_proc", "authority": f"localhost:{picker_port}"},
                "timeout": "10s",
            },
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": "1000s",
            "metadata_options": {
                "forwarding_namespaces": {
                    "untyped": [SUBSET_METADATA_NAMESPACE, LB_METADATA_NAMESPACE]
                },
                "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
            },
        },
    }
    lua = {
        "name": LUA_FILTER,
        "typed_config": {
            TYPE: f"{API}.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": SUBSET_LUA},
        },
    }
    served_to_metadata = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            TYPE: f"{API}.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [
                {
                    "header": HEADER_GATEWAY_ENDPOINT_SERVED,
                    "on_header_present": {
                        "metadata_namespace": LB_METADATA_NAMESPACE,
                        "key": HEADER_GATEWAY_ENDPOINT_SERVED,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            TYPE: f"{API}.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True,
        },
    }
    hcm = {
        TYPE: f"{API}.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "name": "vllm",
            "virtual_hosts": [{"name": "vllm-default", "domains": ["*"], "routes": routes}],
        },
        # on the response path filters run in reverse: header-to-metadata before ext_proc
        "http_filters": [lua, ext_proc, served_to_metadata, router],
    }
    thresholds = {
        "max_connections": 40000,
        "max_pending_requests": 40000,
        "max_requests": 40000,
    }
    config = {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "per_connection_buffer_limit_bytes": 32768,
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
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "1000s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "circuit_breakers": {"thresholds": [thresholds]},
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": HEADER_GATEWAY_ENDPOINT,
                    },
                },
                {
                    "name": "ext_proc",
                    "type": "STATIC",
                    "connect_timeout": "86400s",
                    "lb_policy": "LEAST_REQUEST",
                    "circuit_breakers": {"thresholds": [{**thresholds, "max_retries": 1024}]},
                    "health_checks": [
                        {
                            "timeout": "2s",
                            "interval": "10s",
                            "unhealthy_threshold": 3,
                            "healthy_threshold": 2,
                            "reuse_connection": True,
                            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
                            **({"tls_options": {"alpn_protocols": ["h2"]}} if tls else {}),
                        }
                    ],
                    **(_TLS_ANY if tls else {}),
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            TYPE: f"{API}.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {
                                "http2_protocol_options": {
                                    "initial_stream_window_size": 65536,
                                    "initial_connection_window_size": 1048576,
                                }
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "ext_proc",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": picker_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }
    return yaml.safe_dump(config, sort_keys=False)
