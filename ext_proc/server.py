"""The gRPC shell: Envoy's ext_proc streams and its access-log stream.

One `StreamSession` per ext_proc stream, one method per phase; the server loop only
receives, dispatches and sends. The generated Envoy config runs two ext_proc filters per
request, so the router never sits on the token path:
- routing (blocking): request headers (path, request id, session), then the buffered body;
  the reply names the backend, and the server closes the stream.
- observing (observability mode: Envoy does not wait for us): the stream opens with the
  first response body chunk = TTFT, the request id as an attribute; the server closes the
  stream, so later chunks never reach Python.
Completion (E2E, status) arrives through Envoy's gRPC access log. A single filter that does
both (a mesh's own settings) works too: the stream stays open until the first chunk.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ext_proc import codec
from ext_proc.names import (
    ACCESS_LOG_SERVICE,
    EXT_PROC_SERVICE,
    HEADER_BACKEND,
    HEADER_GATEWAY_ENDPOINT,
    HEADER_REQUEST_ID,
    HEADER_SESSION,
    LB_METADATA_NAMESPACE,
    ROUTE_FALLBACK,
)
from ext_proc.parse import ParseError, api_for_path, parse_body
from ext_proc.policy import RouteRequest
from ext_proc.router import Decision, Router
from ext_proc.state import CANCELLED, CLIENT_ERROR, ERROR, OK
from ext_proc.telemetry import Telemetry

log = logging.getLogger("gorgo.server")

Reply = codec.ProcessingResponse | None


class StreamSession:
    """One HTTP request as seen through one ext_proc stream."""

    def __init__(
        self,
        router: Router,
        telemetry: Telemetry,
        info: codec.StreamInfo,
        trace_carrier: dict[str, str],
    ) -> None:
        self.router = router
        self.telemetry = telemetry
        self.info = info
        # W3C trace context of Envoy's request span (from the gRPC metadata).
        self.trace_carrier = trace_carrier
        self.path = ""
        self.request_id = ""
        self.session_header: str | None = None
        self.body = bytearray()
        self.decision: Decision | None = None
        self.first_byte_seen = False
        # True once nothing more is needed from this stream: the server then closes it.
        self.done = False

    # -- phases -------------------------------------------------------------------------

    def on_request_headers(self, p: codec.Phase) -> Reply:
        self.path = p.headers.get(":path", "")
        self.request_id = p.headers.get(HEADER_REQUEST_ID, "")
        self.session_header = p.headers.get(HEADER_SESSION)
        if api_for_path(self.path) is None or not self.request_id:
            # Not an LLM call: Envoy's fallback route serves it, nothing to observe.
            self.done = True
        elif p.end_of_stream and not self.info.observe_only:
            self.done = True  # no body to route on: the fallback route serves it
        return self._reply(codec.REQUEST_HEADERS)

    def on_request_body(self, p: codec.Phase) -> Reply:
        if not p.end_of_stream:  # only if a config streams the body: gather it
            self.body += p.body
            return self._reply(codec.REQUEST_BODY)
        body = bytes(self.body + p.body) if self.body else p.body
        self.body = bytearray()
        api = api_for_path(self.path)
        if self.info.observe_only or api is None:  # no headers seen: we cannot route
            self.done = not self.info.sends_response_body
            return self._reply(codec.REQUEST_BODY)
        try:
            llm = parse_body(api, body)
        except ParseError as e:
            self.done = True
            if self.router.cfg.routing.unreadable_body == "reject":
                log.info("request %s: unreadable body, rejected: %s", self.request_id, e)
                return json_error(400, "invalid_request_error", f"invalid request body: {e}")
            # Never break the request on a body we cannot read: the fallback route takes it
            # and the backend gives the client its own error.
            log.info("request %s: unreadable body, fallback route: %s", self.request_id, e)
            return self._reply(codec.REQUEST_BODY)
        session_key = self.session_header or llm.user
        route_request = RouteRequest(self.request_id, llm, session_key)
        retry_s = self.router.should_shed(route_request)
        if retry_s is not None:  # every backend is past the queue bound: shed, honestly
            self.done = True
            log.warning("request %s shed: every queue past the bound", self.request_id)
            retry_after = {"retry-after": str(max(1, math.ceil(retry_s)))}
            return json_error(
                429, "overloaded", "all backends overloaded, retry later", retry_after
            )
        self.decision = self.router.decide(route_request)
        self.telemetry.decided(self.decision, session_key, self.trace_carrier)
        self.done = not self.info.sends_response_body
        if self.router.cfg.envoy.mode == "endpoint_picker":
            # Gateway API Inference Extension: the endpoint for override_host, then the
            # next best ones, which Envoy tries in order if a connect attempt fails.
            ranked = self.decision.ranked()[: 1 + self.router.cfg.envoy.connect_retries]
            endpoint = ",".join(self.router.addresses[b] for b in ranked)
            return codec.continue_response(
                codec.REQUEST_BODY,
                set_headers={HEADER_GATEWAY_ENDPOINT: endpoint},
                dynamic_metadata={LB_METADATA_NAMESPACE: {HEADER_GATEWAY_ENDPOINT: endpoint}},
            )
        return codec.continue_response(
            codec.REQUEST_BODY,
            set_headers={HEADER_BACKEND: self.decision.backend},
            clear_route_cache=True,
        )

    def on_response_headers(self, p: codec.Phase) -> Reply:
        if p.end_of_stream:  # no body will follow: the headers were the first byte
            self._first_byte()
        return self._reply(codec.RESPONSE_HEADERS)

    def on_response_body(self, p: codec.Phase) -> Reply:
        self._first_byte()
        return self._reply(codec.RESPONSE_BODY)

    def on_trailers(self, p: codec.Phase) -> Reply:
        return self._reply(p.name)

    def finish(self) -> None:
        """Always runs when the stream ends, however it ends. A stream that watched for the
        first response byte and ends without it means the request ended without a body
        (client gone, upstream reset): it is closed here. All others are closed by their
        access-log entry (or, if that is lost, by expiry)."""
        if self.info.sends_response_body and not self.first_byte_seen and self.request_id:
            self.telemetry.completed(self.router.complete(self.request_id, CANCELLED))

    # -- helpers ------------------------------------------------------------------------

    def _first_byte(self) -> None:
        if not self.first_byte_seen and self.request_id:
            self.first_byte_seen = True
            self.telemetry.first_byte(self.request_id, self.router.first_byte(self.request_id))
        self.done = True

    def _reply(self, phase: str) -> Reply:
        return None if self.info.observe_only else codec.continue_response(phase)

    def handle(self, req: codec.ProcessingRequest) -> Reply:
        if not self.request_id and req.attributes:  # the observer: no request headers
            self.request_id = codec.request_id_attribute(req)
        p = codec.decode(req)
        handler = self._handlers.get(p.name)
        if handler is None:
            raise ValueError(f"unexpected ext_proc message {p.name!r}")
        return handler(self, p)

    _handlers: dict[str, Callable[[StreamSession, codec.Phase], Reply]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: on_response_headers,
        codec.RESPONSE_BODY: on_response_body,
        codec.REQUEST_TRAILERS: on_trailers,
        codec.RESPONSE_TRAILERS: on_trailers,
    }


def json_error(
    status: int, kind: str, message: str, headers: dict[str, str] | None = None
) -> codec.ProcessingResponse:
    """Answer the client directly, in the OpenAI error shape its SDK already parses."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    all_headers = {**(headers or {}), "content-type": "application/json"}
    return codec.immediate_response(status, body, all_headers, details=f"gorgo_{kind}")


# gRPC metadata keys that carry Envoy's trace context.
TRACE_KEYS = ("traceparent", "tracestate")


class ExtProcService:
    def __init__(self, router: Router, telemetry: Telemetry) -> None:
        self.router = router
        self.telemetry = telemetry
        self.active_streams = 0
        # Shutting down: new streams are closed at once, and Envoy takes the fallback.
        self.draining = False

    async def process(
        self, requests: AsyncIterator[codec.ProcessingRequest], context: Any
    ) -> AsyncIterator[codec.ProcessingResponse]:
        if self.draining:
            return
        session: StreamSession | None = None
        self.active_streams += 1
        try:
            async for req in requests:
                if session is None:
                    metadata = context.invocation_metadata() or ()
                    carrier = {k: v for k, v in metadata if k in TRACE_KEYS}
                    session = StreamSession(
                        self.router, self.telemetry, codec.stream_info(req), carrier
                    )
                reply = session.handle(req)
                if reply is not None:
                    yield reply
                if session.done:
                    break
        finally:
            self.active_streams -= 1
            if session is not None:
                session.finish()


class AccessLogService:
    """Receives Envoy's access-log entries: the completion of every request."""

    def __init__(self, router: Router, telemetry: Telemetry) -> None:
        self.router = router
        self.telemetry = telemetry

    async def stream_access_logs(
        self, requests: AsyncIterator[codec.StreamAccessLogsMessage], context: Any
    ) -> codec.StreamAccessLogsResponse:
        async for msg in requests:
            for e in codec.access_log_entries(msg):
                self.observe(e)
        return codec.StreamAccessLogsResponse()

    def observe(self, e: codec.AccessLogEntry) -> None:
        status = status_for(e.response_code)
        # Another backend than the one decided can answer because Envoy retried a connect
        # failure (a failover), or because the router answered too late and Envoy failed
        # open (not the backend's fault): only the first takes several attempts.
        served_by = e.backend if e.attempts > 1 else None
        done = self.router.complete(e.request_id, status, e.e2e_ms, served_by=served_by)
        self.telemetry.completed(done)
        if done is None and e.route_name == ROUTE_FALLBACK:
            self.router.record_fallback(e.backend)
            self.telemetry.fallback(e.backend)


def status_for(code: int) -> str:
    if 200 <= code < 300:
        return OK
    if 400 <= code < 500:
        return CLIENT_ERROR
    # 0: nothing was sent to the client, which went away first (an upstream failure gets
    # Envoy's own 5xx). A cancellation says nothing about the backend.
    return CANCELLED if code == 0 else ERROR


def add_services(server: grpc.aio.Server, router: Router, telemetry: Telemetry) -> ExtProcService:
    ext_proc = ExtProcService(router, telemetry)
    access_log = AccessLogService(router, telemetry)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                EXT_PROC_SERVICE,
                {
                    "Process": grpc.stream_stream_rpc_method_handler(
                        ext_proc.process,
                        request_deserializer=codec.ProcessingRequest.FromString,
                        response_serializer=codec.ProcessingResponse.SerializeToString,
                    )
                },
            ),
            grpc.method_handlers_generic_handler(
                ACCESS_LOG_SERVICE,
                {
                    "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                        access_log.stream_access_logs,
                        request_deserializer=codec.StreamAccessLogsMessage.FromString,
                        response_serializer=codec.StreamAccessLogsResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    return ext_proc


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Buffered request bodies arrive in one message: allow the largest body Envoy buffers
    # (gRPC's 4 MiB default would reset long prompts), plus headroom for framing.
    limit = max_message_bytes + 1024 * 1024
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]
