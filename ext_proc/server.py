"""The gRPC shell: Envoy's ext_proc stream and its access-log stream.

One `StreamSession` per ext_proc stream (= one HTTP request), one method per phase. The
server loop only receives, dispatches and sends. With the generated Envoy config a request
costs three messages: request headers (path, request id, session), the buffered request
body (routing), and the first response body chunk (TTFT). The session then ends the
stream: Envoy treats a stream the server closed as "processing complete", so later chunks
flow without touching Python. Completion (E2E, status) arrives through Envoy's gRPC access
log. Configs that also send response headers or trailers work too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ext_proc import codec
from ext_proc.names import (
    ACCESS_LOG_SERVICE,
    EXT_PROC_SERVICE,
    HEADER_BACKEND,
    HEADER_REQUEST_ID,
    HEADER_SESSION,
    ROUTE_FALLBACK,
)
from ext_proc.parse import ParseError, api_for_path, parse_body
from ext_proc.policy import RouteRequest
from ext_proc.router import Decision, Router
from ext_proc.state import CANCELLED, ERROR, OK

log = logging.getLogger("gorgo.server")


class StreamSession:
    """The life of one HTTP request as seen through its ext_proc stream."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.path = ""
        self.request_id = ""
        self.session_header: str | None = None
        self.body = bytearray()
        self.decision: Decision | None = None
        self.status_code = 0
        self.first_byte_seen = False
        # True once nothing more is needed from this stream: the server then closes it.
        self.done = False

    # -- phases -------------------------------------------------------------------------

    def on_request_headers(self, p: codec.Phase) -> codec.ProcessingResponse:
        self.path = p.headers.get(":path", "")
        self.request_id = p.headers.get(HEADER_REQUEST_ID, "")
        self.session_header = p.headers.get(HEADER_SESSION)
        if api_for_path(self.path) is None or p.end_of_stream or not self.request_id:
            # Not an LLM call (or nothing to read): Envoy's fallback route serves it.
            self.done = True
        return codec.continue_response(codec.REQUEST_HEADERS)

    def on_request_body(self, p: codec.Phase) -> codec.ProcessingResponse:
        if not p.end_of_stream:  # only if a config streams the body: gather it
            self.body += p.body
            return codec.continue_response(codec.REQUEST_BODY)
        body = bytes(self.body + p.body) if self.body else p.body
        self.body = bytearray()
        api = api_for_path(self.path)
        if api is None:  # a config that skips request headers: we cannot route
            self.done = True
            return codec.continue_response(codec.REQUEST_BODY)
        try:
            llm = parse_body(api, body)
        except ParseError as e:
            # Never break the request on a body we cannot read: the fallback route takes it
            # and the backend gives the client its own error.
            log.info("request %s: unparseable body, fallback route: %s", self.request_id, e)
            self.done = True
            return codec.continue_response(codec.REQUEST_BODY)
        session_key = self.session_header or llm.user
        self.decision = self.router.decide(RouteRequest(self.request_id, llm, session_key))
        return codec.continue_response(
            codec.REQUEST_BODY,
            set_headers={HEADER_BACKEND: self.decision.backend},
            clear_route_cache=True,
        )

    def on_response_headers(self, p: codec.Phase) -> codec.ProcessingResponse:
        status = p.headers.get(":status", "0")
        self.status_code = int(status) if status.isdigit() else 0
        if p.end_of_stream:  # no body will follow: the headers were the first byte
            self._first_byte()
        return codec.continue_response(codec.RESPONSE_HEADERS)

    def on_response_body(self, p: codec.Phase) -> codec.ProcessingResponse:
        self._first_byte()
        return codec.continue_response(codec.RESPONSE_BODY)

    def on_trailers(self, p: codec.Phase) -> codec.ProcessingResponse:
        return codec.continue_response(p.name)

    def finish(self, cancelled: bool) -> None:
        """Always runs when the stream ends. A request that never saw its first byte is
        closed here; one that did is closed by its access-log entry (or expiry)."""
        if self.decision is None or self.first_byte_seen:
            return
        self.router.complete(self.request_id, CANCELLED if cancelled else ERROR)

    # -- helpers ------------------------------------------------------------------------

    def _first_byte(self) -> None:
        if self.decision is not None and not self.first_byte_seen:
            self.first_byte_seen = True
            self.router.first_byte(self.request_id)
        self.done = True

    def handle(self, req: codec.ProcessingRequest) -> codec.ProcessingResponse:
        p = codec.decode(req)
        handler = self._handlers.get(p.name)
        if handler is None:
            raise ValueError(f"unexpected ext_proc message {p.name!r}")
        return handler(self, p)

    _handlers: dict[str, Callable[[StreamSession, codec.Phase], codec.ProcessingResponse]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: on_response_headers,
        codec.RESPONSE_BODY: on_response_body,
        codec.REQUEST_TRAILERS: on_trailers,
        codec.RESPONSE_TRAILERS: on_trailers,
    }


class ExtProcService:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.active_streams = 0

    async def process(
        self, requests: AsyncIterator[codec.ProcessingRequest], context: Any
    ) -> AsyncIterator[codec.ProcessingResponse]:
        session = StreamSession(self.router)
        self.active_streams += 1
        cancelled = True
        try:
            async for req in requests:
                yield session.handle(req)
                if session.done:
                    break
            cancelled = False
        finally:
            self.active_streams -= 1
            session.finish(cancelled)


class AccessLogService:
    """Receives Envoy's access-log entries: the completion of every request."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def stream_access_logs(
        self, requests: AsyncIterator[codec.StreamAccessLogsMessage], context: Any
    ) -> codec.StreamAccessLogsResponse:
        async for msg in requests:
            for e in codec.access_log_entries(msg):
                self.observe(e)
        return codec.StreamAccessLogsResponse()

    def observe(self, e: codec.AccessLogEntry) -> None:
        status = OK if 200 <= e.response_code < 300 else ERROR
        done = self.router.complete(e.request_id, status, e.e2e_ms)
        if done is None and e.route_name == ROUTE_FALLBACK:
            self.router.record_fallback(e.backend)


def add_services(server: grpc.aio.Server, router: Router) -> ExtProcService:
    ext_proc = ExtProcService(router)
    access_log = AccessLogService(router)
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
