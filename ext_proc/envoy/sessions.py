"""One ext_proc stream as a session: its type chosen from the stream's first message
(routing, observing, pass-through, the fleet's model list), one method per phase
(Envoy AI Gateway's processorForPath + passThroughProcessor pattern).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ext_proc.common.names import HEADER_FLOW_REASON, HEADER_REQUEST_ID, HEADER_SESSION
from ext_proc.config.flow import HOLD_SLACK_S
from ext_proc.config.schema import UnreadableBody
from ext_proc.core.pipeline import Director, Outcome, Queued, Refused, Unrouted
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import Forward, first_chunk_event
from ext_proc.envoy.encoders import DecisionEncoder
from ext_proc.flow.classify import read_headers
from ext_proc.flow.queue import Waiting
from ext_proc.prompt.engine_tokens import PromptTokenizer
from ext_proc.prompt.parse import (
    ParseError,
    api_for_path,
    is_error_event,
    parse_body,
    route_path,
    with_model,
)
from ext_proc.vocab.errors import INVALID_BODY, ApiError, retry_headers
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import Decision, RouteRequest, Status

log = logging.getLogger("gorgo.server")


Reply = codec.ProcessingResponse | None
# A request body at least this long is tokenized in a worker thread (~8k tokens of text:
# a few ms to tokenize cold; shorter ones are cheaper than the thread hop).
OFF_LOOP_BODY_BYTES = 32 * 1024
# A client's request id longer than this is shortened (its start and a hash of it).
MAX_REQUEST_ID_CHARS = 200
# The OpenAI API's model list, answered by the router for the whole fleet.
MODELS_PATH = "/v1/models"


# -- one session type per role, chosen from the stream's first message --------------------


class Session:
    """One HTTP request as seen through one ext_proc stream: one method per phase; a
    phase without a method is acknowledged and nothing else happens."""

    def __init__(self, info: codec.StreamInfo) -> None:
        self.info = info
        # True once nothing more is needed from this stream: the server then closes it.
        self.done = False
        # Seconds to wait before sending the reply just handled (dispatch pacing).
        self.hold_s = 0.0

    def handle(self, p: codec.Phase) -> Reply:
        handler = self._handlers.get(p.name)
        if handler is None:
            if p.name not in codec.PHASES:
                raise ValueError(f"unexpected ext_proc message {p.name!r}")
            return self._reply(p.name)
        return handler(self, p)

    def finish(self) -> None:
        """Always runs when the stream ends, however it ends."""

    def _reply(self, phase: str) -> Reply:
        # Observability mode: Envoy neither waits for nor reads our replies.
        return None if self.info.observe_only else codec.bare_continue(phase)

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {}


class PassThroughSession(Session):
    """Not an LLM call (or no request id): Envoy's fallback route serves it; nothing to
    decide or observe, so the stream ends after the first reply."""

    def handle(self, p: codec.Phase) -> Reply:
        self.done = True
        return self._reply(p.name)


class ModelsSession(Session):
    """`GET /v1/models` at the front door: the fleet's models (every name some backend
    serves), answered here in OpenAI's list shape (a backend whose models are not known
    adds none); while no backend's models are known, the fallback route takes it to an
    engine as before."""

    def __init__(self, router: Router, info: codec.StreamInfo) -> None:
        super().__init__(info)
        self.router = router

    def handle(self, p: codec.Phase) -> Reply:
        self.done = True
        models = self.router.served_models()
        if models is None:
            return self._reply(p.name)
        data = [
            {"id": name, "object": "model", "owned_by": "gorgo", "parent": parent}
            for name, parent in models.items()
        ]
        body = json.dumps({"object": "list", "data": data}).encode()
        return codec.immediate_response(200, body, {"content-type": "application/json"})


class _FirstByteWatcher(Session):
    """A stream that may see the response: its first byte is the TTFT; a stream that
    watched for it and ends without it means the request ended without a body (client
    gone, upstream reset), and the request is closed as cancelled."""

    def __init__(
        self,
        router: Router,
        info: codec.StreamInfo,
        request_id: str,
        forward: Forward | None = None,
    ) -> None:
        super().__init__(info)
        self.router = router
        self.request_id = request_id
        self.first_byte_seen = False
        # Several routers behind one Envoy: another router's request goes to it.
        self.forward = forward

    def on_response_headers(self, p: codec.Phase) -> Reply:
        if p.end_of_stream:  # no body will follow: the headers were the first byte
            self._first_byte()
        return self._reply(codec.RESPONSE_HEADERS)

    def on_response_body(self, p: codec.Phase) -> Reply:
        self._first_byte(p.body)
        return self._reply(codec.RESPONSE_BODY)

    def _first_byte(self, chunk: bytes = b"") -> None:
        if not self.first_byte_seen and self.request_id:
            self.first_byte_seen = True
            error = is_error_event(chunk)
            if error:
                # An error inside a 200 stream: not a first token, and the backend's
                # failure (the access log's 200 that follows finds it closed).
                log.info("request %s: error event in the stream", self.request_id)
                mine = self.router.close(self.request_id, Status.ERROR) is not None
            else:
                mine = self.router.first_byte(self.request_id) is not None
            if not mine and self.forward is not None:  # another router's, or a repeat
                self.forward(first_chunk_event(self.request_id, error))
        self.done = True

    def finish(self) -> None:
        # All other requests are closed by their access-log entry (or, if lost, expiry).
        if self.info.sends_response_body and not self.first_byte_seen and self.request_id:
            self.router.close(self.request_id, Status.CANCELLED)


class ObservingSession(_FirstByteWatcher):
    """The observing filter (observability mode: Envoy does not wait): the stream opens
    with the first response chunk, the request id as an attribute (or, in older configs,
    with the request headers)."""

    def on_request_headers(self, p: codec.Phase) -> Reply:
        self.request_id = p.headers.get(HEADER_REQUEST_ID, "")
        return None

    def on_request_body(self, p: codec.Phase) -> Reply:
        self.done = not self.info.sends_response_body
        return None

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: _FirstByteWatcher.on_response_headers,
        codec.RESPONSE_BODY: _FirstByteWatcher.on_response_body,
    }


class RoutingSession(_FirstByteWatcher):
    """The routing filter: request headers (path, request id, session), then the body;
    the reply names the backend. A single filter that also sends the response (a mesh's
    own settings) keeps the stream open until the first chunk."""

    def __init__(
        self,
        director: Director,
        encoder: DecisionEncoder,
        info: codec.StreamInfo,
        trace_context: tuple[tuple[str, str], ...],
        tokens: PromptTokenizer | None = None,
        envoy: str = "",
    ) -> None:
        super().__init__(director.router, info, "")
        # The request's recipe (admit, schedule, record); this session does the wire.
        self.director = director
        # The Envoy that opened the stream (gRPC metadata METADATA_ENVOY_NODE).
        self.envoy = envoy
        self.encoder = encoder
        # The engine's tokenizer and chat template (None: the approximation).
        self.tokens = tokens
        # W3C trace context of Envoy's request span (from the gRPC metadata).
        self.trace_context = trace_context
        self.path = ""
        self.session_header: str | None = None
        self.body = bytearray()
        self.decision: Decision | None = None
        # The request as parsed and tokenized in a worker thread (a long body).
        self._prepared: LlmRequest | None = None
        # Flow control: the objective, tenant and TTFT SLO its headers name; and while it
        # waits in the gateway queue, its ticket, body and the client's request id.
        self.flow: tuple[str, str, float] = ("", "", 0.0)
        self.held: tuple[Waiting, bytes, str] | None = None

    def tokenizes_off_loop(self, p: codec.Phase) -> bool:
        """Whether this phase's body is long enough to tokenize in a worker thread: a
        cold long prompt takes tens of ms to tokenize, which must not hold up every
        other request's decision (the tokenizer releases the GIL on long texts)."""
        return (
            self.tokens is not None
            and p.name == codec.REQUEST_BODY
            and p.end_of_stream
            and len(self.body) + len(p.body) >= OFF_LOOP_BODY_BYTES
        )

    async def tokenize_off_loop(self, p: codec.Phase) -> None:
        """Parse the body here and tokenize it in a thread; `on_request_body` then uses
        the result (a body that does not parse is left for it to answer)."""
        assert self.tokens is not None
        api = api_for_path(self.path)
        assert api is not None
        try:
            llm = parse_body(api, bytes(self.body + p.body) if self.body else p.body)
        except ParseError:
            return
        self._prepared = await asyncio.to_thread(self.tokens.apply, llm, self.request_id)

    def on_request_headers(self, p: codec.Phase) -> Reply:
        self.path = p.headers.get(":path", "")
        self.request_id = p.headers.get(HEADER_REQUEST_ID, "")
        self.session_header = p.headers.get(HEADER_SESSION)
        self.flow = read_headers(self.router.cfg.flow_control, p.headers)
        if p.end_of_stream:
            self.done = True  # no body to route on: the fallback route serves it
        return self._reply(codec.REQUEST_HEADERS)

    def on_request_body(self, p: codec.Phase) -> Reply:
        if not p.end_of_stream:  # only if a config streams the body: gather it
            self.body += p.body
            return self._reply(codec.REQUEST_BODY)
        body = bytes(self.body + p.body) if self.body else p.body
        self.body = bytearray()
        api = api_for_path(self.path)
        assert api is not None  # a routing session is opened for LLM paths only
        try:
            llm = self._prepared or parse_body(api, body)
        except ParseError as e:
            self.done = True
            if self.router.cfg.routing.unreadable_body == UnreadableBody.REJECT:
                log.info("request %s: unreadable body, rejected: %s", self.request_id, e)
                return json_error(INVALID_BODY, f"invalid request body: {e}")
            # Never break the request on a body we cannot read: the fallback route takes it
            # and the backend gives the client its own error.
            log.info("request %s: unreadable body, fallback route: %s", self.request_id, e)
            return self._reply(codec.REQUEST_BODY)
        if self.tokens is not None and self._prepared is None:  # fails open
            llm = self.tokens.apply(llm, self.request_id)  # token ids as the engine's
        original_id = self.request_id
        self.request_id = own_request_id(original_id, self.router.in_flight)
        objective, tenant, slo_ms = self.flow
        request = RouteRequest(
            self.request_id,
            llm,
            self.session_header or llm.user,
            trace_context=self.trace_context,
            envoy=self.envoy,
            objective=objective,
            tenant=tenant,
            ttft_slo_ms=slo_ms,
        )
        outcome = self.director.handle(request, len(body))
        if isinstance(outcome, Queued):  # the gateway queue: the reply waits for room
            w = outcome.ticket
            self.held = (w, body, original_id)
            hold_s = w.expires_s - w.arrival_s + HOLD_SLACK_S
            return codec.override_message_timeout(hold_s)
        return self.answer(outcome, body, original_id)

    def answer(self, outcome: Outcome, body: bytes, original_id: str) -> Reply:
        """The body's reply for the Director's outcome."""
        self.done = True
        if isinstance(outcome, Refused):  # answered here: no engine could serve it now
            refused = outcome.refusal
            log.warning(
                "request %s refused %d: %s", self.request_id, refused.status, refused.message
            )
            retry = refused.retry_after_s
            headers = retry_headers(retry) if retry is not None else {}
            if refused.reason:
                headers[HEADER_FLOW_REASON] = refused.reason
            return json_error(refused.error, refused.message, headers or None)
        if isinstance(outcome, Unrouted):  # the fallback route takes it
            log.warning("request %s: %s: fallback route", self.request_id, outcome.reason)
            return self._reply(codec.REQUEST_BODY)
        self.decision = outcome.decision
        self.done = not self.info.sends_response_body
        self.hold_s = self.decision.hold_ms / 1000
        # an alias: the body names the engine's model
        served = outcome.served_model
        new_body = with_model(body, served) if served is not None else None
        renamed = self.request_id if self.request_id != original_id else None
        return self.encoder.encode(self.decision, new_body, renamed)

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: _FirstByteWatcher.on_response_headers,
        codec.RESPONSE_BODY: _FirstByteWatcher.on_response_body,
    }


def own_request_id(request_id: str, in_flight: Mapping[str, object]) -> str:
    """The id the router tracks a request by, and Envoy then logs it by (the router's reply
    rewrites x-request-id when it differs): the client's own, unless a request with that
    id is still in flight (a client reusing one: each must count, and close, apart) or it
    is absurdly long (kept in the decision log and the page's feed)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()
        request_id = f"{request_id[:64]}~{digest}"
    own, n = request_id, 1
    while own in in_flight:
        n += 1
        own = f"{request_id}~{n}"
    return own


def open_session(
    router: Router,
    encoder: DecisionEncoder,
    first: codec.ProcessingRequest,
    phase: codec.Phase,
    trace_context: tuple[tuple[str, str], ...] = (),
    tokens: PromptTokenizer | None = None,
    forward: Forward | None = None,
    envoy: str = "",
    director: Director | None = None,
) -> Session:
    """The session for a stream, from its first message (`phase`, decoded) (Envoy AI
    Gateway's processorForPath + passThroughProcessor pattern)."""
    info = codec.stream_info(first)
    if info.observe_only:
        return ObservingSession(router, info, codec.request_id_attribute(first), forward)
    headers = phase.headers
    if (
        phase.name == codec.REQUEST_HEADERS
        and headers.get(":method") == "GET"
        and route_path(headers.get(":path", "")) == MODELS_PATH
    ):
        return ModelsSession(router, info)
    if (
        phase.name == codec.REQUEST_HEADERS
        and api_for_path(headers.get(":path", "")) is not None
        and headers.get(HEADER_REQUEST_ID)
    ):
        director = director if director is not None else Director(router)
        return RoutingSession(director, encoder, info, trace_context, tokens, envoy)
    return PassThroughSession(info)


def json_error(
    error: ApiError, message: str, headers: dict[str, str] | None = None
) -> codec.ProcessingResponse:
    """Answer the client directly, in the OpenAI error shape its SDK already parses
    (ext_proc/vocab/errors.py); Envoy logs the code as the response code details."""
    all_headers = {**(headers or {}), "content-type": "application/json"}
    return codec.immediate_response(
        error.status, error.body(message), all_headers, details=f"gorgo_{error.code}"
    )
