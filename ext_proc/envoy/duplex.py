"""FULL_DUPLEX_STREAMED streams (the Gateway API Inference Extension's chart sets both
body modes so): Envoy sends the headers and every body chunk as they come and waits for
nothing, and passes on only what comes back. The routing session holds the headers' reply
until the body is complete (the prompt decides the endpoint), then sends it with the
routing mutation, each chunk as it came and the trailers' reply, in that order; a stream
the policy does not route sends everything back as it came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ext_proc.core.admission import fallback_order
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.answers import no_endpoint
from ext_proc.envoy.encoders import DecisionEncoder
from ext_proc.envoy.session_base import Reply, Session
from ext_proc.envoy.sessions import RoutingSession
from ext_proc.vocab.types import Decision

# A request body the router rewrote (a model alias) goes back to a FULL_DUPLEX_STREAMED
# data plane in chunks of at most this many bytes (some data planes cap a streamed chunk
# at 64 KiB; a body sent back as it came keeps its own chunks).
STREAMED_CHUNK_BYTES = 60 * 1024


class StreamedRoutingSession(RoutingSession):
    """A routing filter whose request body is FULL_DUPLEX_STREAMED (the Gateway API
    Inference Extension's chart): Envoy sends the headers and each body chunk as they come
    and waits for nothing; the headers' reply is held until the body is complete (the
    prompt decides the endpoint), then goes with the routing mutation, followed by every
    chunk sent back as it came (a body not sent back reaches the engine empty) and the
    trailers' reply, in that order, as the mode requires."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The request's trailers came (the body's last chunk then has no end of stream).
        self.trailers = False
        # The request went on: its replies went out (headers, body, trailers).
        self.sent_on = False

    def _completes_body(self, p: codec.Phase) -> bool:
        return not self.sent_on and (
            (p.name == codec.REQUEST_BODY and p.end_of_stream) or p.name == codec.REQUEST_TRAILERS
        )

    def _complete_body(self, p: codec.Phase) -> bytes:
        return b"".join([*self.chunks, p.body])

    def on_request_headers(self, p: codec.Phase) -> Reply:
        self._read_request_headers(p)
        if p.end_of_stream:  # no body to route on: any endpoint serves it
            self.sent_on = True
            return self._fallback()
        return None  # the reply waits for the body

    def on_request_body(self, p: codec.Phase) -> Reply:
        if self.sent_on:
            # a chunk after the request went on (found by fuzzing: a body after headers
            # that ended the stream was kept and never sent back): passed on as it came
            return codec.streamed_body(codec.REQUEST_BODY, p.body, p.end_of_stream)
        self.chunks.append(p.body)
        self.body_bytes += len(p.body)
        if not p.end_of_stream:
            return None
        return self._route(b"".join(self.chunks))

    def on_request_trailers(self, p: codec.Phase) -> Reply:
        self.trailers = True
        if self.sent_on:
            return codec.bare_continue(codec.REQUEST_TRAILERS)
        return self._route(b"".join(self.chunks))

    def _routed(self, d: Decision, new_body: bytes | None, renamed: str | None) -> Reply:
        return self._send_on(
            self.encoder.encode(d, new_body, renamed, codec.REQUEST_HEADERS), new_body
        )

    def _fallback(self) -> Reply:
        self.done = False  # the response still comes through this stream
        named = self.encoder.undecided(lambda: _fallback_order(self.router))
        if named is None:
            self.done = True
            return no_endpoint("no active backend")
        return self._send_on(named)

    def _send_on(
        self, headers_reply: codec.ProcessingResponse, new_body: bytes | None = None
    ) -> list[codec.ProcessingResponse]:
        """The headers' reply, then the body (as it came, or the new one in chunks), then
        the trailers' reply."""
        self.sent_on = True
        chunks = self.chunks if new_body is None else _split(new_body, STREAMED_CHUNK_BYTES)
        self.chunks = []
        out = [headers_reply]
        last = len(chunks) - 1
        for i, chunk in enumerate(chunks):
            out.append(
                codec.streamed_body(codec.REQUEST_BODY, chunk, i == last and not self.trailers)
            )
        if self.trailers:
            out.append(codec.bare_continue(codec.REQUEST_TRAILERS))
        return out

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {
        **RoutingSession._handlers,
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.REQUEST_TRAILERS: on_request_trailers,
    }


class StreamedPassThroughSession(Session):
    """A FULL_DUPLEX_STREAMED stream for a request the policy does not route (not an LLM
    call, no request id): everything goes back as it came; an endpoint picker names an
    endpoint still (any active backend, the least loaded first), since the pool's Envoy
    has no route of its own; none: 503."""

    def __init__(self, router: Router, encoder: DecisionEncoder, info: codec.StreamInfo) -> None:
        super().__init__(info)
        self.router = router
        self.encoder = encoder

    def on_request_headers(self, p: codec.Phase) -> Reply:
        named = self.encoder.undecided(lambda: _fallback_order(self.router))
        if named is None:
            self.done = True
            return no_endpoint("no active backend")
        return named

    def on_request_body(self, p: codec.Phase) -> Reply:
        if self.info.request_streamed:
            return codec.streamed_body(codec.REQUEST_BODY, p.body, p.end_of_stream)
        return self._reply(codec.REQUEST_BODY)

    def on_response_body(self, p: codec.Phase) -> Reply:
        if p.end_of_stream:
            self.done = True
        if self.info.response_streamed:
            return codec.streamed_body(codec.RESPONSE_BODY, p.body, p.end_of_stream)
        return self._reply(codec.RESPONSE_BODY)

    def on_response_headers(self, p: codec.Phase) -> Reply:
        self.done = p.end_of_stream
        return self._reply(codec.RESPONSE_HEADERS)

    def on_response_trailers(self, p: codec.Phase) -> Reply:
        self.done = True
        return self._reply(codec.RESPONSE_TRAILERS)

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: on_response_headers,
        codec.RESPONSE_BODY: on_response_body,
        codec.RESPONSE_TRAILERS: on_response_trailers,
    }


def _fallback_order(router: Router) -> list[str]:
    """The backends a request the policy does not decide on may go to, best first."""
    return fallback_order(router.fleet.state, router.clock())


def _split(body: bytes, size: int) -> list[bytes]:
    """`body` in chunks of at most `size` bytes (one empty chunk for an empty body)."""
    return [body[i : i + size] for i in range(0, len(body), size)] or [b""]
