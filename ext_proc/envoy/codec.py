"""The only module that touches protobuf: Envoy wire messages <-> plain Python values."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from ext_proc.common.names import (
    EXT_PROC_ATTRIBUTES,
    HEADER_BACKEND,
    HEADER_GATEWAY_ENDPOINT_SERVED,
    LB_METADATA_NAMESPACE,
    REQUEST_ID_ATTRIBUTE,
    RESPONSE_CODE_ATTRIBUTE,
    RESPONSE_DETAILS_ATTRIBUTE,
    SUBSET_METADATA_KEY,
    SUBSET_METADATA_NAMESPACE,
)
from ext_proc.envoy.proto import envoy_wire_pb2 as pb

REQUEST_HEADERS = "request_headers"
REQUEST_BODY = "request_body"
RESPONSE_HEADERS = "response_headers"
RESPONSE_BODY = "response_body"
REQUEST_TRAILERS = "request_trailers"
RESPONSE_TRAILERS = "response_trailers"
PHASES = (
    REQUEST_HEADERS,
    REQUEST_BODY,
    RESPONSE_HEADERS,
    RESPONSE_BODY,
    REQUEST_TRAILERS,
    RESPONSE_TRAILERS,
)
# What a stream carries at most once (Envoy's protocol; the bodies come in chunks).
ONCE_PER_STREAM = frozenset(
    (REQUEST_HEADERS, RESPONSE_HEADERS, REQUEST_TRAILERS, RESPONSE_TRAILERS)
)

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse
StreamAccessLogsMessage = pb.StreamAccessLogsMessage
StreamAccessLogsResponse = pb.StreamAccessLogsResponse


@dataclass(frozen=True)
class Phase:
    """One ext_proc message, decoded: which phase, its headers or body, and what the
    endpoint-picker protocol puts in its metadata: the endpoints the request may go to
    (None: no subset hint) and the endpoint that served it ("": not said)."""

    name: str
    headers: dict[str, str]
    body: bytes
    end_of_stream: bool
    subset: tuple[str, ...] | None = None
    served: str = ""


@dataclass(frozen=True)
class StreamInfo:
    """What a stream's first message says about the filter that opened it."""

    # Observability mode: Envoy does not wait for (and ignores) our replies.
    observe_only: bool
    # The filter will send response body chunks (the stream can time the first token).
    sends_response_body: bool
    # FULL_DUPLEX_STREAMED bodies (the Gateway API Inference Extension's setting): each
    # chunk comes as it arrives and must be sent back (streamed_response), or it is lost.
    request_streamed: bool = False
    response_streamed: bool = False


def stream_info(first: pb.ProcessingRequest) -> StreamInfo:
    config = first.protocol_config
    duplex = pb.ProcessingMode.FULL_DUPLEX_STREAMED
    return StreamInfo(
        first.observability_mode,
        config.response_body_mode != pb.ProcessingMode.NONE,
        config.request_body_mode == duplex,
        config.response_body_mode == duplex,
    )


def request_id_attribute(req: pb.ProcessingRequest) -> str:
    """The request id Envoy sent as an attribute ("" if absent)."""
    attrs = req.attributes.get(EXT_PROC_ATTRIBUTES)
    if attrs is None:
        return ""
    value = attrs.fields.get(REQUEST_ID_ATTRIBUTE)
    return value.string_value if value is not None else ""


def response_status_attributes(req: pb.ProcessingRequest) -> tuple[int, str]:
    """The response code and code details Envoy sent as attributes ((0, "") if absent).
    Envoy turns an integer attribute into a number or, in some versions, a string."""
    attrs = req.attributes.get(EXT_PROC_ATTRIBUTES)
    if attrs is None:
        return 0, ""
    code = attrs.fields.get(RESPONSE_CODE_ATTRIBUTE)
    details = attrs.fields.get(RESPONSE_DETAILS_ATTRIBUTE)
    number = 0
    if code is not None:
        kind = code.WhichOneof("kind")
        if kind == "number_value":
            number = _status_code(code.number_value)
        elif kind == "string_value" and code.string_value.isascii():
            number = _status_code(code.string_value)
    return number, details.string_value if details is not None else ""


def _status_code(value: float | str) -> int:
    """An HTTP status code (100-599) from an attribute, or 0 for anything else: a
    negative, fractional, non-finite or non-numeric value reads as absent (found by
    fuzzing: NaN and infinity raised, a negative number passed through)."""
    try:
        number = float(value)
    except ValueError:
        return 0
    return int(number) if number.is_integer() and 100 <= number <= 599 else 0


def _header_map(m: pb.HeaderMap) -> dict[str, str]:
    # Envoy sends raw_value (bytes); `value` only for old configs. Repeated keys: last wins,
    # which is all routing needs (we read single-valued headers).
    out: dict[str, str] = {}
    for h in m.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _subset(hint: Struct) -> tuple[str, ...] | None:
    """The subset hint's endpoints: a list of "ip:port" (a comma-separated string is read
    too); None when the key is absent."""
    value = hint.fields.get(SUBSET_METADATA_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value.strip() for v in value.list_value.values]
    elif kind == "string_value":
        items = [x.strip() for x in value.string_value.split(",")]
    else:
        items = []
    return tuple(x for x in items if x)


def _picker_metadata(req: pb.ProcessingRequest) -> tuple[tuple[str, ...] | None, str]:
    """The subset hint and the served endpoint in the message's metadata (most messages
    carry none: one field check)."""
    if not req.HasField("metadata_context"):
        return None, ""
    namespaces = req.metadata_context.filter_metadata
    hint = namespaces.get(SUBSET_METADATA_NAMESPACE)
    lb = namespaces.get(LB_METADATA_NAMESPACE)
    served = lb.fields.get(HEADER_GATEWAY_ENDPOINT_SERVED) if lb is not None else None
    return (
        _subset(hint) if hint is not None else None,
        served.string_value.strip() if served is not None else "",
    )


def decode(req: pb.ProcessingRequest) -> Phase:
    name = req.WhichOneof("request") or ""
    if name in (REQUEST_HEADERS, RESPONSE_HEADERS):
        h = getattr(req, name)
        headers = _header_map(h.headers)
        subset, served = _picker_metadata(req)
        # a gateway that reports the served endpoint as a response header
        served = served or headers.get(HEADER_GATEWAY_ENDPOINT_SERVED, "").strip()
        return Phase(name, headers, b"", h.end_of_stream, subset, served)
    if name in (REQUEST_BODY, RESPONSE_BODY):
        b = getattr(req, name)
        return Phase(name, {}, b.body, b.end_of_stream)
    if name in (REQUEST_TRAILERS, RESPONSE_TRAILERS):
        return Phase(name, _header_map(getattr(req, name).trailers), b"", True)
    return Phase(name, {}, b"", False)


def _mutation(set_headers: Mapping[str, str], remove: Iterable[str]) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            pb.HeaderValueOption(
                # raw_value, not value: Envoy 1.40 reads a `value` here as an empty header.
                header=pb.HeaderValue(key=k, raw_value=v.encode()),
                append_action=pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def continue_response(
    phase: str,
    set_headers: Mapping[str, str] | None = None,
    remove_headers: Iterable[str] = (),
    clear_route_cache: bool = False,
    dynamic_metadata: Mapping[str, Mapping[str, str]] | None = None,
    body: bytes | None = None,
) -> pb.ProcessingResponse:
    """CONTINUE for `phase`, optionally mutating headers, re-selecting the route,
    setting dynamic metadata ({namespace: {key: value}}) and replacing the body."""
    common = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if body is not None:
        common.body_mutation.body = body
    if set_headers or remove_headers:
        common.header_mutation.CopyFrom(_mutation(set_headers or {}, remove_headers))
    resp = pb.ProcessingResponse()
    if phase in (REQUEST_HEADERS, RESPONSE_HEADERS, REQUEST_BODY, RESPONSE_BODY):
        getattr(resp, phase).response.CopyFrom(common)
    elif phase in (REQUEST_TRAILERS, RESPONSE_TRAILERS):
        getattr(resp, phase).SetInParent()
    else:
        raise ValueError(f"no response for phase {phase!r}")
    if dynamic_metadata:
        resp.dynamic_metadata.update({ns: dict(kv) for ns, kv in dynamic_metadata.items()})
    return resp


def add_headers(
    resp: pb.ProcessingResponse, phase: str, set_headers: Mapping[str, str]
) -> pb.ProcessingResponse:
    """`resp` (a CONTINUE for a headers or body phase, built here) with these headers set
    too."""
    mutation = getattr(resp, phase).response.header_mutation
    mutation.set_headers.extend(_mutation(set_headers, ()).set_headers)
    return resp


# A bare CONTINUE per phase, built once (most replies are one): a reply is serialized by
# gRPC and never changed after, so one message serves every stream.
_BARE = {phase: continue_response(phase) for phase in PHASES}


def bare_continue(phase: str) -> pb.ProcessingResponse:
    """CONTINUE for `phase`, nothing changed (shared: do not modify it)."""
    reply = _BARE.get(phase)
    if reply is None:
        raise ValueError(f"no response for phase {phase!r}")
    return reply


def streamed_body(phase: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """A body chunk sent back in FULL_DUPLEX_STREAMED mode (`phase`: request_body or
    response_body): the data plane passes on what comes back this way, nothing else."""
    if phase not in (REQUEST_BODY, RESPONSE_BODY):
        raise ValueError(f"no streamed body for phase {phase!r}")
    resp = pb.ProcessingResponse()
    streamed = getattr(resp, phase).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    return resp


def override_message_timeout(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait this long for the reply to the message it sent last (the body
    held in the gateway queue): Envoy ignores the rest of this response, restarts its
    message timer with the value (at most the filter's max_message_timeout) and waits for
    the real reply; once per message (ext_proc.proto, ProcessingResponse field 10)."""
    resp = pb.ProcessingResponse()
    ms = max(1, round(seconds * 1000))
    resp.override_message_timeout.seconds = ms // 1000
    resp.override_message_timeout.nanos = (ms % 1000) * 1_000_000
    return resp


def immediate_response(
    status_code: int, body: bytes, headers: Mapping[str, str] | None = None, details: str = ""
) -> pb.ProcessingResponse:
    """Answer the client directly (the request never reaches a backend)."""
    resp = pb.ProcessingResponse()
    ir = resp.immediate_response
    ir.status.code = status_code
    ir.body = body
    ir.details = details
    if headers:
        ir.headers.CopyFrom(_mutation(headers, ()))
    return resp


# The ResponseFlags message's fields (api/envoy/data/accesslog/v3/accesslog.proto) by the
# short code Envoy prints for each.
FLAG_CODES = {
    "failed_local_healthcheck": "LH",
    "no_healthy_upstream": "UH",
    "upstream_request_timeout": "UT",
    "local_reset": "LR",
    "upstream_remote_reset": "UR",
    "upstream_connection_failure": "UF",
    "upstream_connection_termination": "UC",
    "upstream_overflow": "UO",
    "no_route_found": "NR",
    "delay_injected": "DI",
    "fault_injected": "FI",
    "rate_limited": "RL",
    "rate_limit_service_error": "RLSE",
    "downstream_connection_termination": "DC",
    "upstream_retry_limit_exceeded": "URX",
    "stream_idle_timeout": "SI",
    "invalid_envoy_request_headers": "IH",
    "downstream_protocol_error": "DPE",
    "upstream_max_stream_duration_reached": "UMSDR",
    "response_from_cache_filter": "RFCF",
    "no_filter_config_found": "NFCF",
    "duration_timeout": "DT",
    "upstream_protocol_error": "UPE",
    "no_cluster_found": "NC",
    "overload_manager": "OM",
    "dns_resolution_failure": "DF",
    "downstream_remote_reset": "DR",
}


@dataclass(frozen=True)
class AccessLogEntry:
    """What we learn from Envoy's gRPC access log at the end of a request."""

    request_id: str
    # The backend id Envoy echoed in the response (set for fallback-routed requests too).
    backend: str
    route_name: str
    response_code: int
    # Request start (downstream first byte) to last byte sent downstream.
    e2e_ms: float | None
    # Upstream attempts: more than 1 when Envoy retried (a connect failure).
    attempts: int = 1
    # Envoy's response flags (short codes: UF, DC, ...) and response code details.
    flags: frozenset[str] = frozenset()
    details: str = ""
    # The response body's size as sent to the client (its generated tokens are counted
    # from it: prompt/parse.py streamed_tokens).
    response_body_bytes: int = 0


def _ms(d: Duration) -> float:
    return float(d.seconds * 1e3 + d.nanos / 1e6)


def response_flags(f: pb.ResponseFlags) -> frozenset[str]:
    """The flags set, by Envoy's short codes."""
    return frozenset(FLAG_CODES[d.name] for d, v in f.ListFields() if v is True)


def access_log_node(msg: pb.StreamAccessLogsMessage) -> str:
    """The node id of the Envoy sending this stream ("" when its bootstrap sets none)."""
    return str(msg.identifier.node.id)


def access_log_name(msg: pb.StreamAccessLogsMessage) -> str:
    """The log this stream carries (the access log's `log_name`)."""
    return str(msg.identifier.log_name)


def access_log_entries(msg: pb.StreamAccessLogsMessage) -> list[AccessLogEntry]:
    out: list[AccessLogEntry] = []
    for e in msg.http_logs.log_entry:
        c = e.common_properties
        out.append(
            AccessLogEntry(
                request_id=e.request.request_id,
                backend=e.response.response_headers.get(HEADER_BACKEND, ""),
                route_name=c.route_name,
                response_code=e.response.response_code.value,
                e2e_ms=_ms(c.time_to_last_downstream_tx_byte)
                if c.HasField("time_to_last_downstream_tx_byte")
                else None,
                attempts=c.upstream_request_attempt_count or 1,
                flags=response_flags(c.response_flags),
                details=e.response.response_code_details,
                response_body_bytes=e.response.response_body_bytes,
            )
        )
    return out
