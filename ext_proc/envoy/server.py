"""The gRPC shell: Envoy's ext_proc streams and its access-log stream.

One session per ext_proc stream (ext_proc/envoy/sessions.py), its type chosen from the
stream's first message; the server loop only receives, dispatches and sends. How a
decision is encoded for Envoy is chosen once, at startup. The generated Envoy config runs
two ext_proc filters per request, so the router never sits on the token path:
- routing (blocking): request headers (path, request id, session), then the buffered body;
  the reply names the backend, and the server closes the stream.
- observing (observability mode: Envoy does not wait for us): the stream opens with the
  first response body chunk = TTFT, the request id as an attribute; the server closes the
  stream, so later chunks never reach Python.
Completion (E2E, status) arrives through Envoy's gRPC access log. A single filter that does
both (a mesh's own settings) works too: the stream stays open until the first chunk. A
filter with FULL_DUPLEX_STREAMED bodies (the Gateway API Inference Extension's gateways;
ext_proc/envoy/duplex.py) gets several replies to one message and every chunk back, and
its stream's end closes the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ext_proc.common.names import ACCESS_LOG_SERVICE, EXT_PROC_SERVICE, METADATA_ENVOY_NODE
from ext_proc.core.router import Router
from ext_proc.director.recipe import Director
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import AccessLogService, Forward
from ext_proc.envoy.disagg import send_prefill
from ext_proc.envoy.encoders import DecisionEncoder, decision_encoder
from ext_proc.envoy.holding import Holding
from ext_proc.envoy.prefill import PrefillSender
from ext_proc.envoy.roles import open_session
from ext_proc.envoy.session_base import Reply, Session
from ext_proc.envoy.sessions import RoutingSession
from ext_proc.prompt.engine_tokens import PromptTokenizer

# gRPC metadata keys that carry Envoy's trace context.
TRACE_KEYS = ("traceparent", "tracestate")


class ExtProcService:
    """Envoy's ext_proc gRPC service: one `process` call per stream, whose session
    (ext_proc/envoy/sessions.py) the first message chooses. `draining`: shutting down, so
    a new stream ends at once and Envoy's fallback route takes its request."""

    def __init__(
        self,
        router: Router,
        encoder: DecisionEncoder,
        tokens: PromptTokenizer | None = None,
        forward: Forward | None = None,
    ) -> None:
        self.router = router
        # The request's recipe, shared by every routing session, and where the requests
        # waiting in its gateway queue are held.
        self.director = Director(router)
        self.holding = Holding(self.director.admission, router.clock)
        router.subscribe(self.holding)
        self.encoder = encoder
        self.tokens = tokens
        self.forward = forward
        # A disaggregated decision's prefill leg, which the router sends itself.
        self.prefill_legs = PrefillSender(
            lambda b: r.config if (r := router.backends.get(b)) is not None else None,
            router.cfg.routing.prefill_timeout_s,
            on_kv_sent=lambda rid: router.prefill_done(rid, kv_sent=True),
        )
        self.active_streams = 0
        # Shutting down: new streams are closed at once, and Envoy takes the fallback.
        self.draining = False

    def use_tokenizer(self, tokens: PromptTokenizer) -> None:
        """Tokenize new requests with `tokens` from now on (the engine's tokenizer, found
        after start)."""
        self.tokens = tokens

    async def process(
        self, requests: AsyncIterator[codec.ProcessingRequest], context: Any
    ) -> AsyncIterator[codec.ProcessingResponse]:
        if self.draining:
            return
        session: Session | None = None
        self.active_streams += 1
        try:
            async for req in requests:
                phase = codec.decode(req)
                if session is None:
                    metadata = context.invocation_metadata() or ()
                    carrier = tuple((k, v) for k, v in metadata if k in TRACE_KEYS)
                    envoy = next((v for k, v in metadata if k == METADATA_ENVOY_NODE), "")
                    session = open_session(
                        self.router,
                        self.encoder,
                        req,
                        phase,
                        carrier,
                        self.tokens,
                        self.forward,
                        envoy,
                        self.director,
                    )
                if isinstance(session, RoutingSession) and session.tokenizes_off_loop(phase):
                    await session.tokenize_off_loop(phase)
                reply = session.handle(phase)
                if isinstance(session, RoutingSession) and session.held is not None:
                    # the gateway queue: Envoy waits longer for this reply, which comes
                    # when the request is released or refused
                    w, body, original_id = session.held
                    with self.holding.hold(w) as settled:  # before the first await
                        for r in replies(reply):
                            yield r
                        outcome = await settled
                    session.held = None
                    reply = session.answer(outcome, body, original_id)
                if isinstance(session, RoutingSession) and session.pending_prefill is not None:
                    # a disaggregated decision: the router sends the prefill leg while
                    # Envoy waits (longer: the override just sent), then the decode leg goes
                    for r in replies(reply):
                        yield r
                    reply = await send_prefill(session, self.prefill_legs)
                if session.pace_s:  # dispatch pacing: Envoy sends the request on later
                    await asyncio.sleep(session.pace_s)
                    session.pace_s = 0.0
                for r in replies(reply):
                    yield r
                if session.done:
                    break
        finally:
            self.active_streams -= 1
            if session is not None:
                session.finish()


def replies(reply: Reply) -> list[codec.ProcessingResponse]:
    """A session's answer to one message as the replies to send, in order."""
    if reply is None:
        return []
    return reply if isinstance(reply, list) else [reply]


def add_services(
    server: grpc.aio.Server,
    router: Router,
    on_fallback: Callable[[str], None] | None = None,
    tokens: PromptTokenizer | None = None,
    forward: Forward | None = None,
) -> tuple[ExtProcService, AccessLogService]:
    """`forward`: hands what this router saw of another's request to it (FleetBus)."""
    access_log = AccessLogService(router, on_fallback, forward)
    ext_proc = ExtProcService(router, decision_encoder(router.cfg), tokens, forward)
    server.add_generic_rpc_handlers(rpc_handlers(ext_proc.process, access_log.stream_access_logs))
    return ext_proc, access_log


def rpc_handlers(
    process: Callable[..., Any], stream_access_logs: Callable[..., Any]
) -> tuple[grpc.GenericRpcHandler, ...]:
    """Envoy's two services, as grpc.aio serves them: ext_proc's `Process` (a stream of
    requests and replies) and the access log's `StreamAccessLogs`."""
    return (
        grpc.method_handlers_generic_handler(
            EXT_PROC_SERVICE,
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    process,
                    request_deserializer=codec.ProcessingRequest.FromString,
                    response_serializer=codec.ProcessingResponse.SerializeToString,
                )
            },
        ),
        grpc.method_handlers_generic_handler(
            ACCESS_LOG_SERVICE,
            {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    stream_access_logs,
                    request_deserializer=codec.StreamAccessLogsMessage.FromString,
                    response_serializer=codec.StreamAccessLogsResponse.SerializeToString,
                )
            },
        ),
    )


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Buffered request bodies arrive in one message: allow the largest body Envoy buffers
    # (gRPC's 4 MiB default would reset long prompts), plus headroom for framing.
    limit = max_message_bytes + 1024 * 1024
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]
