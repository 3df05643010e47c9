import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HeaderValue(_message.Message):
    __slots__ = ("key", "value", "raw_value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RAW_VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    raw_value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ..., raw_value: _Optional[bytes] = ...) -> None: ...

class HeaderValueOption(_message.Message):
    __slots__ = ("header", "append_action")
    class HeaderAppendAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        APPEND_IF_EXISTS_OR_ADD: _ClassVar[HeaderValueOption.HeaderAppendAction]
        ADD_IF_ABSENT: _ClassVar[HeaderValueOption.HeaderAppendAction]
        OVERWRITE_IF_EXISTS_OR_ADD: _ClassVar[HeaderValueOption.HeaderAppendAction]
        OVERWRITE_IF_EXISTS: _ClassVar[HeaderValueOption.HeaderAppendAction]
    APPEND_IF_EXISTS_OR_ADD: HeaderValueOption.HeaderAppendAction
    ADD_IF_ABSENT: HeaderValueOption.HeaderAppendAction
    OVERWRITE_IF_EXISTS_OR_ADD: HeaderValueOption.HeaderAppendAction
    OVERWRITE_IF_EXISTS: HeaderValueOption.HeaderAppendAction
    HEADER_FIELD_NUMBER: _ClassVar[int]
    APPEND_ACTION_FIELD_NUMBER: _ClassVar[int]
    header: HeaderValue
    append_action: HeaderValueOption.HeaderAppendAction
    def __init__(self, header: _Optional[_Union[HeaderValue, _Mapping]] = ..., append_action: _Optional[_Union[HeaderValueOption.HeaderAppendAction, str]] = ...) -> None: ...

class HeaderMap(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[HeaderValue]
    def __init__(self, headers: _Optional[_Iterable[_Union[HeaderValue, _Mapping]]] = ...) -> None: ...

class Metadata(_message.Message):
    __slots__ = ("filter_metadata",)
    class FilterMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Struct
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
    FILTER_METADATA_FIELD_NUMBER: _ClassVar[int]
    filter_metadata: _containers.MessageMap[str, _struct_pb2.Struct]
    def __init__(self, filter_metadata: _Optional[_Mapping[str, _struct_pb2.Struct]] = ...) -> None: ...

class ProcessingMode(_message.Message):
    __slots__ = ("request_header_mode", "response_header_mode", "request_body_mode", "response_body_mode", "request_trailer_mode", "response_trailer_mode")
    class HeaderSendMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DEFAULT: _ClassVar[ProcessingMode.HeaderSendMode]
        SEND: _ClassVar[ProcessingMode.HeaderSendMode]
        SKIP: _ClassVar[ProcessingMode.HeaderSendMode]
    DEFAULT: ProcessingMode.HeaderSendMode
    SEND: ProcessingMode.HeaderSendMode
    SKIP: ProcessingMode.HeaderSendMode
    class BodySendMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[ProcessingMode.BodySendMode]
        STREAMED: _ClassVar[ProcessingMode.BodySendMode]
        BUFFERED: _ClassVar[ProcessingMode.BodySendMode]
        BUFFERED_PARTIAL: _ClassVar[ProcessingMode.BodySendMode]
        FULL_DUPLEX_STREAMED: _ClassVar[ProcessingMode.BodySendMode]
    NONE: ProcessingMode.BodySendMode
    STREAMED: ProcessingMode.BodySendMode
    BUFFERED: ProcessingMode.BodySendMode
    BUFFERED_PARTIAL: ProcessingMode.BodySendMode
    FULL_DUPLEX_STREAMED: ProcessingMode.BodySendMode
    REQUEST_HEADER_MODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADER_MODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_MODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_MODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TRAILER_MODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TRAILER_MODE_FIELD_NUMBER: _ClassVar[int]
    request_header_mode: ProcessingMode.HeaderSendMode
    response_header_mode: ProcessingMode.HeaderSendMode
    request_body_mode: ProcessingMode.BodySendMode
    response_body_mode: ProcessingMode.BodySendMode
    request_trailer_mode: ProcessingMode.HeaderSendMode
    response_trailer_mode: ProcessingMode.HeaderSendMode
    def __init__(self, request_header_mode: _Optional[_Union[ProcessingMode.HeaderSendMode, str]] = ..., response_header_mode: _Optional[_Union[ProcessingMode.HeaderSendMode, str]] = ..., request_body_mode: _Optional[_Union[ProcessingMode.BodySendMode, str]] = ..., response_body_mode: _Optional[_Union[ProcessingMode.BodySendMode, str]] = ..., request_trailer_mode: _Optional[_Union[ProcessingMode.HeaderSendMode, str]] = ..., response_trailer_mode: _Optional[_Union[ProcessingMode.HeaderSendMode, str]] = ...) -> None: ...

class HttpHeaders(_message.Message):
    __slots__ = ("headers", "end_of_stream")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    headers: HeaderMap
    end_of_stream: bool
    def __init__(self, headers: _Optional[_Union[HeaderMap, _Mapping]] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

class HttpBody(_message.Message):
    __slots__ = ("body", "end_of_stream")
    BODY_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    end_of_stream: bool
    def __init__(self, body: _Optional[bytes] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

class HttpTrailers(_message.Message):
    __slots__ = ("trailers",)
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    trailers: HeaderMap
    def __init__(self, trailers: _Optional[_Union[HeaderMap, _Mapping]] = ...) -> None: ...

class ProtocolConfiguration(_message.Message):
    __slots__ = ("request_body_mode", "response_body_mode", "send_body_without_waiting_for_header_response")
    REQUEST_BODY_MODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_MODE_FIELD_NUMBER: _ClassVar[int]
    SEND_BODY_WITHOUT_WAITING_FOR_HEADER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request_body_mode: ProcessingMode.BodySendMode
    response_body_mode: ProcessingMode.BodySendMode
    send_body_without_waiting_for_header_response: bool
    def __init__(self, request_body_mode: _Optional[_Union[ProcessingMode.BodySendMode, str]] = ..., response_body_mode: _Optional[_Union[ProcessingMode.BodySendMode, str]] = ..., send_body_without_waiting_for_header_response: _Optional[bool] = ...) -> None: ...

class ProcessingRequest(_message.Message):
    __slots__ = ("request_headers", "response_headers", "request_body", "response_body", "request_trailers", "response_trailers", "metadata_context", "attributes", "observability_mode", "protocol_config")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Struct
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    METADATA_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    OBSERVABILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    request_headers: HttpHeaders
    response_headers: HttpHeaders
    request_body: HttpBody
    response_body: HttpBody
    request_trailers: HttpTrailers
    response_trailers: HttpTrailers
    metadata_context: Metadata
    attributes: _containers.MessageMap[str, _struct_pb2.Struct]
    observability_mode: bool
    protocol_config: ProtocolConfiguration
    def __init__(self, request_headers: _Optional[_Union[HttpHeaders, _Mapping]] = ..., response_headers: _Optional[_Union[HttpHeaders, _Mapping]] = ..., request_body: _Optional[_Union[HttpBody, _Mapping]] = ..., response_body: _Optional[_Union[HttpBody, _Mapping]] = ..., request_trailers: _Optional[_Union[HttpTrailers, _Mapping]] = ..., response_trailers: _Optional[_Union[HttpTrailers, _Mapping]] = ..., metadata_context: _Optional[_Union[Metadata, _Mapping]] = ..., attributes: _Optional[_Mapping[str, _struct_pb2.Struct]] = ..., observability_mode: _Optional[bool] = ..., protocol_config: _Optional[_Union[ProtocolConfiguration, _Mapping]] = ...) -> None: ...

class HeaderMutation(_message.Message):
    __slots__ = ("set_headers", "remove_headers")
    SET_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    set_headers: _containers.RepeatedCompositeFieldContainer[HeaderValueOption]
    remove_headers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, set_headers: _Optional[_Iterable[_Union[HeaderValueOption, _Mapping]]] = ..., remove_headers: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamedBodyResponse(_message.Message):
    __slots__ = ("body", "end_of_stream")
    BODY_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    end_of_stream: bool
    def __init__(self, body: _Optional[bytes] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

class BodyMutation(_message.Message):
    __slots__ = ("body", "clear_body", "streamed_response")
    BODY_FIELD_NUMBER: _ClassVar[int]
    CLEAR_BODY_FIELD_NUMBER: _ClassVar[int]
    STREAMED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    clear_body: bool
    streamed_response: StreamedBodyResponse
    def __init__(self, body: _Optional[bytes] = ..., clear_body: _Optional[bool] = ..., streamed_response: _Optional[_Union[StreamedBodyResponse, _Mapping]] = ...) -> None: ...

class CommonResponse(_message.Message):
    __slots__ = ("status", "header_mutation", "body_mutation", "trailers", "clear_route_cache")
    class ResponseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CONTINUE: _ClassVar[CommonResponse.ResponseStatus]
        CONTINUE_AND_REPLACE: _ClassVar[CommonResponse.ResponseStatus]
    CONTINUE: CommonResponse.ResponseStatus
    CONTINUE_AND_REPLACE: CommonResponse.ResponseStatus
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_MUTATION_FIELD_NUMBER: _ClassVar[int]
    BODY_MUTATION_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_ROUTE_CACHE_FIELD_NUMBER: _ClassVar[int]
    status: CommonResponse.ResponseStatus
    header_mutation: HeaderMutation
    body_mutation: BodyMutation
    trailers: HeaderMap
    clear_route_cache: bool
    def __init__(self, status: _Optional[_Union[CommonResponse.ResponseStatus, str]] = ..., header_mutation: _Optional[_Union[HeaderMutation, _Mapping]] = ..., body_mutation: _Optional[_Union[BodyMutation, _Mapping]] = ..., trailers: _Optional[_Union[HeaderMap, _Mapping]] = ..., clear_route_cache: _Optional[bool] = ...) -> None: ...

class HeadersResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: CommonResponse
    def __init__(self, response: _Optional[_Union[CommonResponse, _Mapping]] = ...) -> None: ...

class BodyResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: CommonResponse
    def __init__(self, response: _Optional[_Union[CommonResponse, _Mapping]] = ...) -> None: ...

class TrailersResponse(_message.Message):
    __slots__ = ("header_mutation",)
    HEADER_MUTATION_FIELD_NUMBER: _ClassVar[int]
    header_mutation: HeaderMutation
    def __init__(self, header_mutation: _Optional[_Union[HeaderMutation, _Mapping]] = ...) -> None: ...

class HttpStatus(_message.Message):
    __slots__ = ("code",)
    CODE_FIELD_NUMBER: _ClassVar[int]
    code: int
    def __init__(self, code: _Optional[int] = ...) -> None: ...

class ImmediateResponse(_message.Message):
    __slots__ = ("status", "headers", "body", "details")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    status: HttpStatus
    headers: HeaderMutation
    body: bytes
    details: str
    def __init__(self, status: _Optional[_Union[HttpStatus, _Mapping]] = ..., headers: _Optional[_Union[HeaderMutation, _Mapping]] = ..., body: _Optional[bytes] = ..., details: _Optional[str] = ...) -> None: ...

class ProcessingResponse(_message.Message):
    __slots__ = ("request_headers", "response_headers", "request_body", "response_body", "request_trailers", "response_trailers", "immediate_response", "dynamic_metadata", "mode_override", "override_message_timeout")
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    IMMEDIATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_METADATA_FIELD_NUMBER: _ClassVar[int]
    MODE_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_MESSAGE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    request_headers: HeadersResponse
    response_headers: HeadersResponse
    request_body: BodyResponse
    response_body: BodyResponse
    request_trailers: TrailersResponse
    response_trailers: TrailersResponse
    immediate_response: ImmediateResponse
    dynamic_metadata: _struct_pb2.Struct
    mode_override: ProcessingMode
    override_message_timeout: _duration_pb2.Duration
    def __init__(self, request_headers: _Optional[_Union[HeadersResponse, _Mapping]] = ..., response_headers: _Optional[_Union[HeadersResponse, _Mapping]] = ..., request_body: _Optional[_Union[BodyResponse, _Mapping]] = ..., response_body: _Optional[_Union[BodyResponse, _Mapping]] = ..., request_trailers: _Optional[_Union[TrailersResponse, _Mapping]] = ..., response_trailers: _Optional[_Union[TrailersResponse, _Mapping]] = ..., immediate_response: _Optional[_Union[ImmediateResponse, _Mapping]] = ..., dynamic_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., mode_override: _Optional[_Union[ProcessingMode, _Mapping]] = ..., override_message_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ResponseFlags(_message.Message):
    __slots__ = ("failed_local_healthcheck", "no_healthy_upstream", "upstream_request_timeout", "local_reset", "upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination", "upstream_overflow", "no_route_found", "delay_injected", "fault_injected", "rate_limited", "rate_limit_service_error", "downstream_connection_termination", "upstream_retry_limit_exceeded", "stream_idle_timeout", "invalid_envoy_request_headers", "downstream_protocol_error", "upstream_max_stream_duration_reached", "response_from_cache_filter", "no_filter_config_found", "duration_timeout", "upstream_protocol_error", "no_cluster_found", "overload_manager", "dns_resolution_failure", "downstream_remote_reset")
    FAILED_LOCAL_HEALTHCHECK_FIELD_NUMBER: _ClassVar[int]
    NO_HEALTHY_UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    NO_ROUTE_FOUND_FIELD_NUMBER: _ClassVar[int]
    DELAY_INJECTED_FIELD_NUMBER: _ClassVar[int]
    FAULT_INJECTED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_SERVICE_ERROR_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_RETRY_LIMIT_EXCEEDED_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    INVALID_ENVOY_REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_MAX_STREAM_DURATION_REACHED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FROM_CACHE_FILTER_FIELD_NUMBER: _ClassVar[int]
    NO_FILTER_CONFIG_FOUND_FIELD_NUMBER: _ClassVar[int]
    DURATION_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    NO_CLUSTER_FOUND_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_MANAGER_FIELD_NUMBER: _ClassVar[int]
    DNS_RESOLUTION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    failed_local_healthcheck: bool
    no_healthy_upstream: bool
    upstream_request_timeout: bool
    local_reset: bool
    upstream_remote_reset: bool
    upstream_connection_failure: bool
    upstream_connection_termination: bool
    upstream_overflow: bool
    no_route_found: bool
    delay_injected: bool
    fault_injected: bool
    rate_limited: bool
    rate_limit_service_error: bool
    downstream_connection_termination: bool
    upstream_retry_limit_exceeded: bool
    stream_idle_timeout: bool
    invalid_envoy_request_headers: bool
    downstream_protocol_error: bool
    upstream_max_stream_duration_reached: bool
    response_from_cache_filter: bool
    no_filter_config_found: bool
    duration_timeout: bool
    upstream_protocol_error: bool
    no_cluster_found: bool
    overload_manager: bool
    dns_resolution_failure: bool
    downstream_remote_reset: bool
    def __init__(self, failed_local_healthcheck: _Optional[bool] = ..., no_healthy_upstream: _Optional[bool] = ..., upstream_request_timeout: _Optional[bool] = ..., local_reset: _Optional[bool] = ..., upstream_remote_reset: _Optional[bool] = ..., upstream_connection_failure: _Optional[bool] = ..., upstream_connection_termination: _Optional[bool] = ..., upstream_overflow: _Optional[bool] = ..., no_route_found: _Optional[bool] = ..., delay_injected: _Optional[bool] = ..., fault_injected: _Optional[bool] = ..., rate_limited: _Optional[bool] = ..., rate_limit_service_error: _Optional[bool] = ..., downstream_connection_termination: _Optional[bool] = ..., upstream_retry_limit_exceeded: _Optional[bool] = ..., stream_idle_timeout: _Optional[bool] = ..., invalid_envoy_request_headers: _Optional[bool] = ..., downstream_protocol_error: _Optional[bool] = ..., upstream_max_stream_duration_reached: _Optional[bool] = ..., response_from_cache_filter: _Optional[bool] = ..., no_filter_config_found: _Optional[bool] = ..., duration_timeout: _Optional[bool] = ..., upstream_protocol_error: _Optional[bool] = ..., no_cluster_found: _Optional[bool] = ..., overload_manager: _Optional[bool] = ..., dns_resolution_failure: _Optional[bool] = ..., downstream_remote_reset: _Optional[bool] = ...) -> None: ...

class AccessLogCommon(_message.Message):
    __slots__ = ("start_time", "time_to_last_rx_byte", "time_to_first_upstream_rx_byte", "time_to_last_upstream_rx_byte", "time_to_first_downstream_tx_byte", "time_to_last_downstream_tx_byte", "upstream_cluster", "response_flags", "route_name", "duration", "upstream_request_attempt_count")
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_UPSTREAM_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_UPSTREAM_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_DOWNSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_DOWNSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_NAME_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REQUEST_ATTEMPT_COUNT_FIELD_NUMBER: _ClassVar[int]
    start_time: _timestamp_pb2.Timestamp
    time_to_last_rx_byte: _duration_pb2.Duration
    time_to_first_upstream_rx_byte: _duration_pb2.Duration
    time_to_last_upstream_rx_byte: _duration_pb2.Duration
    time_to_first_downstream_tx_byte: _duration_pb2.Duration
    time_to_last_downstream_tx_byte: _duration_pb2.Duration
    upstream_cluster: str
    response_flags: ResponseFlags
    route_name: str
    duration: _duration_pb2.Duration
    upstream_request_attempt_count: int
    def __init__(self, start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., time_to_last_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_upstream_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_upstream_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_downstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_downstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., upstream_cluster: _Optional[str] = ..., response_flags: _Optional[_Union[ResponseFlags, _Mapping]] = ..., route_name: _Optional[str] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., upstream_request_attempt_count: _Optional[int] = ...) -> None: ...

class HTTPRequestProperties(_message.Message):
    __slots__ = ("path", "request_id", "request_body_bytes", "request_headers")
    class RequestHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    request_id: str
    request_body_bytes: int
    request_headers: _containers.ScalarMap[str, str]
    def __init__(self, path: _Optional[str] = ..., request_id: _Optional[str] = ..., request_body_bytes: _Optional[int] = ..., request_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HTTPResponseProperties(_message.Message):
    __slots__ = ("response_code", "response_body_bytes", "response_headers", "response_trailers", "response_code_details")
    class ResponseHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ResponseTrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESPONSE_CODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TRAILERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    response_code: _wrappers_pb2.UInt32Value
    response_body_bytes: int
    response_headers: _containers.ScalarMap[str, str]
    response_trailers: _containers.ScalarMap[str, str]
    response_code_details: str
    def __init__(self, response_code: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., response_body_bytes: _Optional[int] = ..., response_headers: _Optional[_Mapping[str, str]] = ..., response_trailers: _Optional[_Mapping[str, str]] = ..., response_code_details: _Optional[str] = ...) -> None: ...

class HTTPAccessLogEntry(_message.Message):
    __slots__ = ("common_properties", "request", "response")
    COMMON_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    common_properties: AccessLogCommon
    request: HTTPRequestProperties
    response: HTTPResponseProperties
    def __init__(self, common_properties: _Optional[_Union[AccessLogCommon, _Mapping]] = ..., request: _Optional[_Union[HTTPRequestProperties, _Mapping]] = ..., response: _Optional[_Union[HTTPResponseProperties, _Mapping]] = ...) -> None: ...

class StreamAccessLogsMessage(_message.Message):
    __slots__ = ("identifier", "http_logs")
    class Node(_message.Message):
        __slots__ = ("id", "cluster")
        ID_FIELD_NUMBER: _ClassVar[int]
        CLUSTER_FIELD_NUMBER: _ClassVar[int]
        id: str
        cluster: str
        def __init__(self, id: _Optional[str] = ..., cluster: _Optional[str] = ...) -> None: ...
    class Identifier(_message.Message):
        __slots__ = ("node", "log_name")
        NODE_FIELD_NUMBER: _ClassVar[int]
        LOG_NAME_FIELD_NUMBER: _ClassVar[int]
        node: StreamAccessLogsMessage.Node
        log_name: str
        def __init__(self, node: _Optional[_Union[StreamAccessLogsMessage.Node, _Mapping]] = ..., log_name: _Optional[str] = ...) -> None: ...
    class HTTPAccessLogEntries(_message.Message):
        __slots__ = ("log_entry",)
        LOG_ENTRY_FIELD_NUMBER: _ClassVar[int]
        log_entry: _containers.RepeatedCompositeFieldContainer[HTTPAccessLogEntry]
        def __init__(self, log_entry: _Optional[_Iterable[_Union[HTTPAccessLogEntry, _Mapping]]] = ...) -> None: ...
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    HTTP_LOGS_FIELD_NUMBER: _ClassVar[int]
    identifier: StreamAccessLogsMessage.Identifier
    http_logs: StreamAccessLogsMessage.HTTPAccessLogEntries
    def __init__(self, identifier: _Optional[_Union[StreamAccessLogsMessage.Identifier, _Mapping]] = ..., http_logs: _Optional[_Union[StreamAccessLogsMessage.HTTPAccessLogEntries, _Mapping]] = ...) -> None: ...

class StreamAccessLogsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
