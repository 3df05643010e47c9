"""The router's own filters in an Envoy HTTP connection manager: the two ext_proc filters
(routing, observing) and the gRPC access logs (failures at once, the rest batched), all
to the router's cluster.
"""

from __future__ import annotations

from typing import Any

from ext_proc.common.names import (
    ACCESS_LOG_NAME,
    ACCESS_LOG_STARTS,
    HEADER_BACKEND,
    LB_METADATA_NAMESPACE,
    METADATA_ENVOY_NODE,
    REQUEST_ID_ATTRIBUTE,
    RESPONSE_CODE_ATTRIBUTE,
    RESPONSE_DETAILS_ATTRIBUTE,
)
from ext_proc.config.flow import HOLD_SLACK_S, max_hold_s
from ext_proc.config.schema import Config
from ext_proc.envoy_config.clusters import API, EXT_PROC_CLUSTER, OBSERVE_STAT_PREFIX, TYPE
from ext_proc.vocab.backend import BackendRole


def node_id(cfg: Config) -> str:
    """The front door's node id: one per listen address, so that several front doors
    sharing a router are told apart."""
    return f"gorgo-front-door@{cfg.envoy.listen}"


def max_reply_hold_s(cfg: Config) -> float:
    """The longest the router may hold a routing reply: a request in the gateway queue,
    or (a fleet with prefill engines) one whose prefill leg the router sends first."""
    hold_s = max_hold_s(cfg.flow_control)
    if any(b.role == BackendRole.PREFILL for b in cfg.backends):
        hold_s = max(hold_s, cfg.routing.prefill_timeout_s + HOLD_SLACK_S)
    return hold_s


def ext_proc_filters(cfg: Config) -> list[dict[str, Any]]:
    """Two ext_proc filters to the same service: one routes (Envoy waits for it), one
    observes the first response chunk without holding it (observability mode)."""
    typed = f"{API}.extensions.filters.http.ext_proc.v3.ExternalProcessor"
    grpc_service = {
        "envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER},
        # Names this Envoy on every stream, as its access-log streams name it: the router
        # closes the requests of an Envoy whose log streams all ended (it went away).
        "initial_metadata": [{"key": METADATA_ENVOY_NODE, "value": node_id(cfg)}],
    }
    route = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            TYPE: typed,
            "grpc_service": grpc_service,
            # Fail open: if the router is down or slow, Envoy forwards the request without
            # the routing header and the fallback route serves it.
            "failure_mode_allow": True,
            "message_timeout": f"{cfg.envoy.message_timeout_ms / 1000}s",
            # A request held in the gateway queue (flow control): the router extends the
            # timer for that one reply (override_message_timeout), up to this, as for a
            # disaggregated request's prefill leg; a hung router still fails open after
            # message_timeout.
            "max_message_timeout": f"{max_reply_hold_s(cfg):g}s",
            # The first-byte deadline is Envoy's per-try timeout header, an x-envoy-*
            # header, which ext_proc may set only when allowed (silently dropped else).
            "mutation_rules": {"allow_envoy": True},
            # endpoint_picker: accept the envoy.lb dynamic metadata override_host reads.
            **(
                {"metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}}}
                if cfg.envoy.mode == "endpoint_picker"
                else {}
            ),
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
            TYPE: typed,
            "grpc_service": grpc_service,
            "failure_mode_allow": True,
            # Envoy sends and does not wait: timing the first token never delays it.
            "observability_mode": True,
            # Its own stats (http.<prefix>.ext_proc.gorgo_observe.*), so the routing
            # filter's failure_mode_allowed counts each request that failed open once.
            "stat_prefix": OBSERVE_STAT_PREFIX,
            # No request phase: the stream opens with the first response chunk, which
            # carries the request id as an attribute, so nothing of this filter competes
            # with the routing stream while Envoy waits for the decision; and the status,
            # so a backend's 5xx counts against it before the client reads it.
            "response_attributes": [
                REQUEST_ID_ATTRIBUTE,
                RESPONSE_CODE_ATTRIBUTE,
                RESPONSE_DETAILS_ATTRIBUTE,
            ],
            "processing_mode": {
                "request_header_mode": "SKIP",
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


def access_logs() -> list[dict[str, Any]]:
    """Three gRPC access logs to the router. The completions, one entry each per request:
    failures (status 400 and up) sent at once (a backend's 5xx is counted sooner still,
    from the observer's first chunk and its response.code attribute); the rest in
    batches, every 50 ms or 16 KB (~30 entries), whichever comes first: one gRPC message
    per entry cost the router ~0.3 ms of CPU per request (gorgo bench overhead), and a
    completion learned at most 50 ms late is a few percent of an LLM request's life (the
    first token, which the load model waits on, comes over the observing stream).

    And each request's start (the HCM's `access_log_options`,
    ACCESS_LOG_OPTIONS), batched the same way under its own log name, which the router
    does not read: Envoy opens an access-log stream only when it first has an entry to
    send, and the router learns that an Envoy went away (killed) from its access-log
    streams ending. Without the start entries, an Envoy none of whose requests had ended
    yet had no stream, and its requests stayed counted in flight until they expired."""
    return [
        _access_log(_completed(_status("GE", 400, "failures")), buffer_size_bytes=0),
        _access_log(_completed(_status("LE", 399, "others")), buffer_size_bytes=16384),
        _access_log(_STARTS, buffer_size_bytes=16384, name=ACCESS_LOG_STARTS),
    ]


# Set on the HTTP connection manager: an access-log entry as each request starts (only
# the log of starts takes it: `_completed`).
ACCESS_LOG_OPTIONS = {"flush_access_log_on_new_request": True}
# Envoy's access-log type of a request's start entry.
_START_TYPE = "DownstreamStart"
_STARTS = {"log_type_filter": {"types": [_START_TYPE]}}


def _status(op: str, code: int, name: str) -> dict[str, Any]:
    """An access-log filter on the response code (`op`: Envoy's GE, LE)."""
    value = {"default_value": code, "runtime_key": f"gorgo.access_log.{name}"}
    return {"status_code_filter": {"comparison": {"op": op, "value": value}}}


def _completed(only: dict[str, Any]) -> dict[str, Any]:
    """`only`, and not a request's start entry (a start has no response code yet)."""
    not_start = {"log_type_filter": {"types": [_START_TYPE], "exclude": True}}
    return {"and_filter": {"filters": [only, not_start]}}


def _access_log(
    only: dict[str, Any], buffer_size_bytes: int, name: str = ACCESS_LOG_NAME
) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": only,
        "typed_config": {
            TYPE: f"{API}.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": name,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
                "buffer_size_bytes": buffer_size_bytes,
                "buffer_flush_interval": "0.05s",
            },
            "additional_response_headers_to_log": [HEADER_BACKEND],
        },
    }
