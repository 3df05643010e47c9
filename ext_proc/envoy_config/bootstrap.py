"""Generate the Envoy front-door config from the same backend list the service uses.

`gorgo envoy-config --config FILE` prints it; `gorgo up` writes it before starting Envoy;
envoy/front-door.yaml is this output for config/gorgo.yaml (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml

from ext_proc.common.names import (
    HEADER_BACKEND,
    HEADER_PREFILL_BACKEND,
    ROUTE_FALLBACK,
    ROUTE_GORGO,
    ROUTING_HEADERS,
)
from ext_proc.config.schema import Config
from ext_proc.envoy_config.clusters import (
    API,
    CDS_FILE,
    EXT_PROC_CLUSTER,
    FALLBACK_CLUSTER,
    METADATA_NAMESPACE,
    OTEL_CLUSTER,
    POOL_CLUSTER,
    TYPE,
    backend_clusters,
    file_config_source,
    grpc_cluster,
    is_ip,
    socket_address,
    xds_path,
)
from ext_proc.envoy_config.filters import ACCESS_LOG_OPTIONS, access_logs, ext_proc_filters, node_id
from ext_proc.vocab.errors import (
    BAD_REQUEST,
    BODY_TOO_LARGE,
    UNAVAILABLE,
    UPSTREAM_ERROR,
    UPSTREAM_TIMEOUT,
    ApiError,
)
from ext_proc.vocab.params import ConfigError, split_host_port


def _retry_policy(cfg: Config, other_priorities: bool) -> dict[str, Any]:
    """Retry on another backend when the chosen one cannot be reached, or (retry_resets)
    its connection is lost before the response began: nothing reached the client, so it
    sees one answer. 5xx answers are not retried (the backend may have worked); the
    router ejects a backend that keeps failing instead."""
    reset = "reset" if cfg.envoy.retry_resets else "reset-before-request"
    policy: dict[str, Any] = {
        "retry_on": f"connect-failure,refused-stream,{reset}",
        "num_retries": cfg.envoy.connect_retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    TYPE: f"{API}.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }
    if other_priorities:  # cluster mode: the chosen backend is priority 0, standbys 1, 2..
        policy["retry_priority"] = {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                TYPE: f"{API}.extensions.retry.priority.previous_priorities.v3"
                ".PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        }
    return policy


def _tracing(cfg: Config) -> dict[str, Any]:
    return {
        "random_sampling": {"value": cfg.envoy.tracing_sample_percent},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                TYPE: f"{API}.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": OTEL_CLUSTER}},
                "service_name": "gorgo-envoy",
            },
        },
    }


def _retries(cfg: Config, other_priorities: bool) -> dict[str, Any]:
    if not cfg.envoy.connect_retries:
        return {}
    return {"retry_policy": _retry_policy(cfg, other_priorities)}


def _ext_proc_tls(cfg: Config) -> dict[str, Any]:
    """Envoy -> ext_proc over TLS (mTLS with a client certificate)."""
    tls = cfg.envoy.ext_proc_tls
    name = tls.server_name or split_host_port(cfg.ext_proc_address, "envoy.ext_proc_address")[0]
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": tls.ca_file},
            # Envoy checks no name unless told to: the certificate must carry this one.
            "match_typed_subject_alt_names": [
                {"san_type": "IP_ADDRESS" if is_ip(name) else "DNS", "matcher": {"exact": name}}
            ],
        },
    }
    if tls.cert_file:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": tls.cert_file},
                "private_key": {"filename": tls.key_file},
            }
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            TYPE: f"{API}.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            **({} if is_ip(name) else {"sni": name}),
            "common_tls_context": common,
        },
    }


def _route(cfg: Config) -> dict[str, Any]:
    timeout = f"{cfg.envoy.route_timeout_s}s"
    if cfg.envoy.mode == "endpoint_picker":
        routes: list[dict[str, Any]] = [
            {
                "name": ROUTE_GORGO,
                "match": {"prefix": "/"},
                "route": {
                    "cluster": POOL_CLUSTER,
                    "timeout": timeout,
                    **_retries(cfg, other_priorities=False),
                },
            }
        ]
    else:
        routes = [
            {
                "name": ROUTE_GORGO,
                "match": {
                    "prefix": "/",
                    "headers": [{"name": HEADER_BACKEND, "present_match": True}],
                },
                "route": {
                    "cluster_header": HEADER_BACKEND,
                    "timeout": timeout,
                    **_retries(cfg, other_priorities=True),
                },
            },
            {
                # No routing header: the router failed open, skipped a non-LLM call, or
                # could not read the body. Least-request over all.
                "name": ROUTE_FALLBACK,
                "match": {"prefix": "/"},
                "route": {
                    "cluster": FALLBACK_CLUSTER,
                    "timeout": timeout,
                    **_retries(cfg, other_priorities=False),
                },
            },
        ]
    return {
        "name": "gorgo",
        # envoy.xds_dir: the clusters arrive by CDS after the route table loads; Envoy
        # would refuse a static table naming a cluster it does not have yet.
        **({"validate_clusters": False} if cfg.envoy.xds_dir else {}),
        "virtual_hosts": [
            {
                "name": "llm",
                "domains": ["*"],
                "routes": routes,
                "response_headers_to_add": [
                    {
                        "header": {
                            "key": HEADER_BACKEND,
                            "value": f"%UPSTREAM_METADATA({METADATA_NAMESPACE}:backend)%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                    {
                        # a disaggregated request: its prefill engine, as the router named
                        # it on the request (empty, so left out, for any other request)
                        "header": {
                            "key": HEADER_PREFILL_BACKEND,
                            "value": f"%REQ({HEADER_PREFILL_BACKEND})%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                ],
            }
        ],
    }


def _json_local_replies() -> dict[str, Any]:
    """Envoy's own error answers in the OpenAI error shape the router's use, so a client's
    SDK parses every error alike (ext_proc/vocab/errors.py names each): a body over the
    buffer limit (413) and those that carry a response flag (no healthy upstream, a
    connect failure or timeout), by status. The router's own answers (ext_proc immediate
    responses) are JSON already and carry no flag; an engine's errors pass as it wrote them.
    Envoy's own words stay in `message`; what it said in the response code details is in
    its access log."""

    def status(op: str, code: int) -> dict[str, Any]:
        # runtime_key: a required field, never set (the value is the default)
        value = {"default_value": code, "runtime_key": f"gorgo.local_reply.{code}"}
        return {"status_code_filter": {"comparison": {"op": op, "value": value}}}

    def flagged(*status_filter: dict[str, Any]) -> dict[str, Any]:
        """Envoy's reply carries a response flag (and its status matches)."""
        flag: dict[str, Any] = {"response_flag_filter": {}}
        return {"and_filter": {"filters": [flag, *status_filter]}} if status_filter else flag

    def mapper(filt: dict[str, Any], error: ApiError) -> dict[str, Any]:
        body = error.as_json("%LOCAL_REPLY_BODY%")
        override = {"json_format": body, "content_type": "application/json"}
        return {"filter": filt, "body_format_override": override}

    return {
        "mappers": [  # the first that matches answers
            mapper(status("EQ", BODY_TOO_LARGE.status), BODY_TOO_LARGE),
            mapper(flagged(status("EQ", UPSTREAM_TIMEOUT.status)), UPSTREAM_TIMEOUT),
            mapper(flagged(status("EQ", UNAVAILABLE.status)), UNAVAILABLE),
            mapper(flagged(status("GE", UPSTREAM_ERROR.status)), UPSTREAM_ERROR),
            mapper(flagged(), BAD_REQUEST),
        ]
    }


def build_envoy_config(cfg: Config, ext_proc: bool = True) -> dict[str, Any]:
    """The front door. ext_proc=False gives the same proxy without the router (every
    request takes the fallback route): the baseline of the overhead benchmark.

    With `envoy.xds_dir` set, the backend clusters are not in it: Envoy reads them from
    the CDS file there (write them first with ext_proc.envoy_config.xds.write_xds)."""
    hcm = {
        TYPE: f"{API}.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "front_door",
        "generate_request_id": True,
        # Client-sent routing headers are removed before any filter or route sees them.
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    TYPE: f"{API}.extensions.http.early_header_mutation.header_mutation.v3"
                    ".HeaderMutation",
                    "mutations": [{"remove": h} for h in ROUTING_HEADERS],
                },
            }
        ],
        "access_log": access_logs() if ext_proc else [],
        **({"access_log_options": ACCESS_LOG_OPTIONS} if ext_proc else {}),
        "local_reply_config": _json_local_replies(),
        "route_config": _route(cfg),
        "http_filters": [
            *(ext_proc_filters(cfg) if ext_proc else []),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {TYPE: f"{API}.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    if cfg.envoy.tracing_endpoint:
        hcm["tracing"] = _tracing(cfg)
    dynamic = bool(cfg.envoy.xds_dir)
    clusters = [] if dynamic else backend_clusters(cfg)
    first, *more = cfg.ext_proc_addresses
    key = "envoy.ext_proc_addresses" if more else "envoy.ext_proc_address"
    if more and not cfg.bus.nats_url:
        raise ConfigError(
            f"{key}: {len(more) + 1} routers behind one Envoy must share their dispatches "
            "and completions: set bus.nats_url"
        )
    ext_proc_cluster = grpc_cluster(EXT_PROC_CLUSTER, first, key, *more)
    if cfg.envoy.ext_proc_tls.ca_file:
        ext_proc_cluster["transport_socket"] = _ext_proc_tls(cfg)
    clusters.append(ext_proc_cluster)
    if cfg.envoy.tracing_endpoint:
        clusters.append(
            grpc_cluster(OTEL_CLUSTER, cfg.envoy.tracing_endpoint, "envoy.tracing_endpoint")
        )
    return {
        # xDS needs a node identity, even from files; the access log names it.
        "node": {"id": node_id(cfg), "cluster": "gorgo"},
        "admin": {"address": socket_address(cfg.envoy.admin, "envoy.admin")},
        **(
            {"dynamic_resources": {"cds_config": file_config_source(xds_path(cfg, CDS_FILE))}}
            if dynamic
            else {}
        ),
        "static_resources": {
            "listeners": [
                {
                    "name": "front_door",
                    "address": socket_address(cfg.envoy.listen, "envoy.listen"),
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
            "clusters": clusters,
        },
    }


def build_mesh_snippet(cfg: Config) -> dict[str, Any]:
    """The router's parts of the front door, cut from `build_envoy_config` (so the two
    cannot differ), for pasting into an Envoy that already exists."""
    # The clusters in full, even with envoy.xds_dir: a mesh's own control plane serves them.
    full = build_envoy_config(replace(cfg, envoy=replace(cfg.envoy, xds_dir="")))
    listener = full["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    filters = hcm["http_filters"][:-1]  # everything but the router filter
    for f in filters:  # the mesh's Envoy has its own node id: its streams go unnamed
        f["typed_config"].get("grpc_service", {}).pop("initial_metadata", None)
    return {
        "per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"],
        "early_header_mutation_extensions": hcm["early_header_mutation_extensions"],
        "http_filters": filters,
        "access_log": hcm["access_log"],
        "access_log_options": hcm["access_log_options"],
        **({"tracing": hcm["tracing"]} if "tracing" in hcm else {}),
        "routes": vhost["routes"],
        "response_headers_to_add": vhost["response_headers_to_add"],
        "clusters": full["static_resources"]["clusters"],
    }


# Where each fragment of the mesh snippet goes in an existing Envoy.
_MESH_PLACES = {
    "per_connection_buffer_limit_bytes": "your listener (buffered bodies over 1 MiB)",
    "early_header_mutation_extensions": "your http_connection_manager (strips client copies)",
    "http_filters": "your HCM's http_filters, before the router filter",
    "access_log": "your HCM's access_log (completions to gorgo)",
    "access_log_options": "your HCM (each start logged: gorgo sees Envoy go)",
    "tracing": "your HCM, unless it traces already (Envoy spans)",
    "routes": "your LLM virtual host's routes (the fallback matches any path)",
    "response_headers_to_add": "that virtual host (echoes the chosen backend)",
    "clusters": "static_resources: gorgo_ext_proc; the others unless you serve them",
}


def render_mesh_snippet(cfg: Config) -> str:
    snippet = build_mesh_snippet(cfg)
    header = [
        "# Generated by `gorgo envoy-config --mesh-snippet` from the gorgo config; do not edit",
        "# by hand. Fragments for an existing Envoy, steps in docs/envoy.md ('Dropping it into",
        "# an existing Envoy'). Backends that change at run time come from your control plane:",
        "# add the cluster named after the backend id before telling gorgo; drain in gorgo",
        "# before deleting it. Where each goes:",
        *(f"#   {key:<34} {_MESH_PLACES[key]}" for key in snippet),
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(snippet, sort_keys=False, width=100)


def render_envoy_config(cfg: Config, ext_proc: bool = True) -> str:
    picker = cfg.envoy.mode == "endpoint_picker"
    header = "# Generated by `gorgo envoy-config` from the gorgo config; do not edit by hand.\n" + (
        "# Endpoint picker: ext_proc names the endpoint (x-gateway-destination-endpoint,\n"
        "# envoy.lb metadata) inside one override_host cluster; least request otherwise.\n"
        if picker
        else "# Front door: ext_proc picks the backend (x-gorgo-backend -> cluster_header\n"
        "# route), fail-open fallback route, completion reported over the gRPC access log.\n"
    )
    return header + yaml.safe_dump(build_envoy_config(cfg, ext_proc), sort_keys=False, width=100)
