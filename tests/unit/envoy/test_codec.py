"""Our minimal proto against envoy-data-plane's complete Envoy schema, both directions."""

import dataclasses
from pathlib import Path

import pytest
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata, Node
from envoy_data_plane.envoy.data.accesslog.v3 import (
    AccessLogCommon,
    HttpAccessLogEntry,
    HttpRequestProperties,
    HttpResponseProperties,
    ResponseFlags,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ProcessingModeBodySendMode,
)
from envoy_data_plane.envoy.service.accesslog.v3 import (
    StreamAccessLogsMessage,
    StreamAccessLogsMessageHttpAccessLogEntries,
    StreamAccessLogsMessageIdentifier,
)
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import ListValue, Struct, Value

from ext_proc.envoy import codec
from tests.fuzz.runner import findings


def test_envoy_request_headers_decode() -> None:
    theirs = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(
                headers=[
                    HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                    HeaderValue(key="x-request-id", raw_value=b"r1"),
                    HeaderValue(key="legacy", value="v"),
                ]
            ),
            end_of_stream=False,
        ),
        observability_mode=False,
    )
    p = codec.decode(codec.ProcessingRequest.FromString(bytes(theirs)))
    assert p.name == codec.REQUEST_HEADERS
    assert p.headers == {":path": "/v1/chat/completions", "x-request-id": "r1", "legacy": "v"}
    assert not p.end_of_stream


def test_envoy_bodies_decode() -> None:
    for field, name in (
        ("request_body", codec.REQUEST_BODY),
        ("response_body", codec.RESPONSE_BODY),
    ):
        theirs = ProcessingRequest(**{field: HttpBody(body=b'{"a": 1}', end_of_stream=True)})
        p = codec.decode(codec.ProcessingRequest.FromString(bytes(theirs)))
        assert (p.name, p.body, p.end_of_stream) == (name, b'{"a": 1}', True)


def test_routing_response_reads_back_in_envoys_schema() -> None:
    ours = codec.continue_response(
        codec.REQUEST_BODY,
        set_headers={"x-gorgo-backend": "eu-frankfurt"},
        remove_headers=["x-drop"],
        clear_route_cache=True,
    )
    theirs = ProcessingResponse.parse(ours.SerializeToString())
    common = theirs.request_body.response
    assert common.clear_route_cache is True
    (opt,) = common.header_mutation.set_headers
    assert (opt.header.key, opt.header.raw_value, opt.header.value) == (
        "x-gorgo-backend",
        b"eu-frankfurt",
        "",
    )
    assert opt.append_action.name == "OVERWRITE_IF_EXISTS_OR_ADD"
    assert common.header_mutation.remove_headers == ["x-drop"]


def test_every_phase_gets_its_own_response_field() -> None:
    for phase in (codec.REQUEST_HEADERS, codec.RESPONSE_HEADERS, codec.RESPONSE_BODY):
        theirs = ProcessingResponse.parse(codec.continue_response(phase).SerializeToString())
        assert getattr(theirs, phase) is not None
        assert theirs.is_set(phase)


def test_immediate_response_reads_back() -> None:
    ours = codec.immediate_response(429, b'{"error": 1}', {"retry-after": "1"}, details="shed")
    theirs = ProcessingResponse.parse(ours.SerializeToString())
    ir = theirs.immediate_response
    assert (int(ir.status.code), ir.body, ir.details) == (429, b'{"error": 1}', "shed")
    assert ir.headers.set_headers[0].header.raw_value == b"1"


def test_access_log_entries_decode() -> None:
    from datetime import timedelta

    entry = HttpAccessLogEntry(
        common_properties=AccessLogCommon(
            upstream_cluster="gorgo_fallback",
            route_name="fallback",
            time_to_last_downstream_tx_byte=timedelta(milliseconds=1234, microseconds=500),
            time_to_first_downstream_tx_byte=timedelta(milliseconds=100),
        ),
        request=HttpRequestProperties(request_id="r9", path="/v1/chat/completions"),
        response=HttpResponseProperties(
            response_code=503, response_headers={"x-gorgo-backend": "ap-seoul"}
        ),
    )
    msg = StreamAccessLogsMessage(
        http_logs=StreamAccessLogsMessageHttpAccessLogEntries(log_entry=[entry])
    )
    (e,) = codec.access_log_entries(codec.StreamAccessLogsMessage.FromString(bytes(msg)))
    assert (e.request_id, e.route_name, e.backend, e.response_code) == (
        "r9",
        "fallback",
        "ap-seoul",
        503,
    )
    assert e.e2e_ms == 1234.5
    assert (e.flags, e.details) == (frozenset(), "")


def test_response_flags_details_and_the_envoy_node_decode() -> None:
    """Every boolean of Envoy's ResponseFlags reads as its short code; the stream's
    identifier names the Envoy."""
    booleans = [f.name for f in dataclasses.fields(ResponseFlags) if f.name in codec.FLAG_CODES]
    assert len(booleans) == 27  # all but unauthorized_details (a message)
    for name in booleans:
        entry = HttpAccessLogEntry(
            common_properties=AccessLogCommon(response_flags=ResponseFlags(**{name: True})),
            response=HttpResponseProperties(
                response_code=503,
                response_code_details="upstream_reset_before_response_started{connection_failure}",
            ),
        )
        msg = StreamAccessLogsMessage(
            identifier=StreamAccessLogsMessageIdentifier(node=Node(id="edge-1"), log_name="g"),
            http_logs=StreamAccessLogsMessageHttpAccessLogEntries(log_entry=[entry]),
        )
        ours = codec.StreamAccessLogsMessage.FromString(bytes(msg))
        (e,) = codec.access_log_entries(ours)
        assert e.flags == {codec.FLAG_CODES[name]}
        assert e.details.startswith("upstream_reset_before_response_started")
        assert codec.access_log_node(ours) == "edge-1"


def test_request_id_attribute_from_the_observer_first_message() -> None:
    """The observer's stream opens with the first response chunk and the request id as a
    response attribute (field 9, a map of Struct)."""
    theirs = ProcessingRequest(
        response_body=HttpBody(body=b"data: {}", end_of_stream=False),
        attributes={
            "envoy.filters.http.ext_proc": Struct(
                fields={"request.id": Value(string_value="abc-1")}
            )
        },
        observability_mode=True,
    )
    ours = codec.ProcessingRequest.FromString(bytes(theirs))
    assert codec.request_id_attribute(ours) == "abc-1"
    assert codec.request_id_attribute(codec.ProcessingRequest()) == ""
    assert codec.response_status_attributes(ours) == (0, "")


@pytest.mark.parametrize("code", [Value(number_value=500), Value(string_value="500")])
def test_the_response_code_attributes_decode_as_a_number_or_a_string(code: Value) -> None:
    """Envoy 1.3x sends `response.code` as a number (seen from the real Envoy here); a
    string is read too."""
    theirs = ProcessingRequest(
        response_body=HttpBody(body=b"{}", end_of_stream=True),
        attributes={
            "envoy.filters.http.ext_proc": Struct(
                fields={
                    "response.code": code,
                    "response.code_details": Value(string_value="via_upstream"),
                }
            )
        },
    )
    ours = codec.ProcessingRequest.FromString(bytes(theirs))
    assert codec.response_status_attributes(ours) == (500, "via_upstream")


def test_the_subset_hint_and_the_served_endpoint_decode_from_envoys_metadata() -> None:
    """ProcessingRequest.metadata_context (field 8, envoy.config.core.v3.Metadata): the
    endpoint-picker protocol's subset hint (a list) and served endpoint (a string)."""
    subset = Value(
        list_value=ListValue(
            values=[Value(string_value="10.0.0.1:8000"), Value(string_value=" 10.0.0.2:8000")]
        )
    )
    theirs = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=[])),
        metadata_context=Metadata(
            filter_metadata={
                "envoy.lb.subset_hint": Struct(
                    fields={"x-gateway-destination-endpoint-subset": subset}
                ),
                "envoy.lb": Struct(
                    fields={
                        "x-gateway-destination-endpoint-served": Value(string_value="10.0.0.2:8000")
                    }
                ),
            }
        ),
        protocol_config=ProtocolConfiguration(
            request_body_mode=ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED,
            response_body_mode=ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED,
        ),
    )
    ours = codec.ProcessingRequest.FromString(bytes(theirs))
    p = codec.decode(ours)
    assert (p.subset, p.served) == (("10.0.0.1:8000", "10.0.0.2:8000"), "10.0.0.2:8000")
    info = codec.stream_info(ours)
    assert (info.request_streamed, info.response_streamed) == (True, True)
    # no metadata: no hint (None), not an empty one (which allows no endpoint)
    bare = codec.decode(
        codec.ProcessingRequest.FromString(
            bytes(ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[]))))
        )
    )
    assert (bare.subset, bare.served) == (None, "")
    empty = Struct(fields={"x-gateway-destination-endpoint-subset": Value(list_value=ListValue())})
    theirs.metadata_context = Metadata(filter_metadata={"envoy.lb.subset_hint": empty})
    assert codec.decode(codec.ProcessingRequest.FromString(bytes(theirs))).subset == ()


def test_streamed_body_chunks_read_back_as_streamed_responses() -> None:
    for phase in (codec.REQUEST_BODY, codec.RESPONSE_BODY):
        ours = codec.streamed_body(phase, b"chunk", True)
        theirs = ProcessingResponse.parse(ours.SerializeToString())
        streamed = getattr(theirs, phase).response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (b"chunk", True)
    # an empty last chunk still says the end of the stream
    ours = codec.streamed_body(codec.RESPONSE_BODY, b"", True)
    theirs = ProcessingResponse.parse(ours.SerializeToString())
    assert theirs.response_body.response.body_mutation.is_set("streamed_response")
    assert theirs.response_body.response.body_mutation.streamed_response.end_of_stream


@pytest.mark.parametrize("found", findings("codec"), ids=lambda p: p.name)
def test_a_response_code_attribute_that_is_no_status_code_reads_as_absent(found: Path) -> None:
    """Found by fuzzing (tests/fuzz/codec.py): a `response.code` of NaN, infinity, a
    negative number or a non-ASCII digit ("²") raised or came through as a negative code;
    any value that is no status code (100-599) reads as absent, its details kept."""
    req = codec.ProcessingRequest.FromString(found.read_bytes())
    code, details = codec.response_status_attributes(req)
    assert code == 0
    assert details == "via_upstream" or found.name == "finding-negative-status-code"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (Value(number_value=float("inf")), 0),
        (Value(number_value=503.5), 0),
        (Value(number_value=99), 0),
        (Value(string_value=" 502"), 502),
        (Value(string_value="\uff15\uff10\uff10"), 0),
        (Value(number_value=599), 599),
    ],
)
def test_only_a_status_code_reads_as_a_response_code(value: Value, expected: int) -> None:
    theirs = ProcessingRequest(
        attributes={"envoy.filters.http.ext_proc": Struct(fields={"response.code": value})}
    )
    ours = codec.ProcessingRequest.FromString(bytes(theirs))
    assert codec.response_status_attributes(ours) == (expected, "")
