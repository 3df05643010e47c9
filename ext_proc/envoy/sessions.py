"""The routing session: one ext_proc stream of the routing filter, one method per phase
(Envoy AI Gateway's processorForPath pattern): the request's headers and body read, the
request parsed, tokenized and handed to the Director, its outcome answered (the backend
named, the router's own answer, the fallback route), the response watched. What every
session shares (the phase dispatch, the first byte, the observing session):
session_base.py; a stream's session is chosen from its first message (roles.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

from ext_proc.common.names import (
    HEADER_BACKEND,
    HEADER_FLOW_REASON,
    HEADER_PREFILL_BACKEND,
    HEADER_REQUEST_ID,
    HEADER_SESSION,
)
from ext_proc.config.flow import HOLD_SLACK_S
from ext_proc.config.schema import UnreadableBody
from ext_proc.director.outcomes import Outcome, Queued, Refused, Unrouted
from ext_proc.director.recipe import Director
from ext_proc.envoy import codec
from ext_proc.envoy.answers import json_error, own_request_id
from ext_proc.envoy.disagg import PendingPrefill, hold_for_prefill_s
from ext_proc.envoy.encoders import DecisionEncoder
from ext_proc.envoy.outcome import VIA_UPSTREAM, outcome_of
from ext_proc.envoy.session_base import FirstByteWatcher, Reply
from ext_proc.flow.classify import read_headers
from ext_proc.flow.queue import Waiting
from ext_proc.prompt.engine_tokens import PromptTokenizer
from ext_proc.prompt.parse import (
    ParseError,
    api_for_path,
    ends_event_stream,
    parse_body,
    rewritten,
)
from ext_proc.vocab.errors import INVALID_BODY, retry_headers
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import Decision, RouteRequest, Status

log = logging.getLogger("gorgo.server")


# A request body at least this long is tokenized in a worker thread (~8k tokens of text:
# a few ms to tokenize cold; shorter ones are cheaper than the thread hop).
OFF_LOOP_BODY_BYTES = 32 * 1024


class RoutingSession(FirstByteWatcher):
    """The routing filter: request headers (path, request id, session), then the body;
    the reply names the backend. A single filter that also sends the response (a mesh's
    own settings) keeps the stream open until the first chunk; one that streams the
    response FULL_DUPLEX (the Gateway API Inference Extension's) gets every chunk back,
    and the stream's end closes the request."""

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
        # The request body's chunks as they came (one, when Envoy buffers it).
        self.chunks: list[bytes] = []
        self.body_bytes = 0
        self.decision: Decision | None = None
        # The complete body came and was routed on (once per stream).
        self.routed = False
        # The request as parsed and tokenized in a worker thread (a long body).
        self._prepared: LlmRequest | None = None
        # Flow control: the objective, tenant and TTFT SLO its headers name; and while it
        # waits in the gateway queue, its ticket, body and the client's request id.
        self.flow: tuple[str, str, float] = ("", "", 0.0)
        self.held: tuple[Waiting, bytes, str] | None = None
        # Envoy was asked to wait longer for this stream's routing reply (once per message);
        # a disaggregated decision whose prefill leg the router is yet to send.
        self.reply_extended = False
        self.pending_prefill: PendingPrefill | None = None
        # The engine that prefilled it, once its leg went (echoed with the decode engine).
        self.prefilled_by: str | None = None
        # The backends the data plane lets it go to (its subset hint; None: any).
        self.subset: frozenset[str] | None = None
        # The response as the stream sees it: its status, the backend that answered (when
        # the data plane says another one did), whether it ended, whether its event stream
        # ended (`data: [DONE]` passed through), its chunks and bytes so far.
        self.status_code, self.served_backend = 0, cast(str | None, None)
        self.ended = self.events_ended = False
        self.response_chunks = self.response_bytes = 0

    def _complete_body(self, p: codec.Phase) -> bytes:
        """The whole body: the chunks so far and this phase's."""
        if not self.chunks:
            return p.body
        return b"".join([*self.chunks, p.body])

    def tokenizes_off_loop(self, p: codec.Phase) -> bool:
        """Whether this phase's body is long enough to tokenize in a worker thread: a
        cold long prompt takes tens of ms to tokenize, which must not hold up every
        other request's decision (the tokenizer releases the GIL on long texts)."""
        return (
            self.tokens is not None
            and self._completes_body(p)
            and self.body_bytes + len(p.body) >= OFF_LOOP_BODY_BYTES
        )

    def _completes_body(self, p: codec.Phase) -> bool:
        return p.name == codec.REQUEST_BODY and p.end_of_stream and not self.routed

    async def tokenize_off_loop(self, p: codec.Phase) -> None:
        """Parse the body here and tokenize it in a thread; `on_request_body` then uses
        the result (a body that does not parse is left for it to answer)."""
        assert self.tokens is not None
        api = api_for_path(self.path)
        assert api is not None
        try:
            llm = parse_body(api, self._complete_body(p))
        except ParseError:
            return
        self._prepared = await asyncio.to_thread(self.tokens.apply, llm, self.request_id)

    def _read_request_headers(self, p: codec.Phase) -> None:
        self.path = p.headers.get(":path", "")
        self.request_id = p.headers.get(HEADER_REQUEST_ID, "")
        self.session_header = p.headers.get(HEADER_SESSION)
        self.flow = read_headers(self.router.cfg.flow_control, p.headers)
        if p.subset is not None and self.router.cfg.envoy.obey_subset_hint:
            self.subset = self.encoder.backends_at(p.subset)

    def on_request_headers(self, p: codec.Phase) -> Reply:
        self._read_request_headers(p)
        if p.end_of_stream:
            self.done = True  # no body to route on: the fallback route serves it
        return self._reply(codec.REQUEST_HEADERS)

    def on_request_body(self, p: codec.Phase) -> Reply:
        if self.routed:  # a body after the one routed on (fuzzing: it was routed again)
            return self._reply(codec.REQUEST_BODY)
        if not p.end_of_stream:  # only if a config streams the body: gather it
            self.chunks.append(p.body)
            self.body_bytes += len(p.body)
            return self._reply(codec.REQUEST_BODY)
        body = self._complete_body(p)
        self.chunks = []
        return self._route(body)

    def _route(self, body: bytes) -> Reply:
        """Parse, tokenize and decide on the complete body; the reply for the outcome."""
        self.routed = True
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
            return self._fallback()
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
            subset=self.subset,
        )
        outcome = self.director.handle(request, len(body))
        if isinstance(outcome, Queued):  # the gateway queue: the reply waits for room
            w = outcome.ticket
            self.held = (w, body, original_id)
            hold_s = w.expires_s - w.arrival_s + HOLD_SLACK_S
            self.reply_extended = True
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
        if isinstance(outcome, Unrouted):
            if (unrouted := self.encoder.unrouted(outcome.reason)) is not None:
                # the endpoint-picker protocol: no endpoint can take it, say so (503)
                log.warning("request %s: %s: 503", self.request_id, outcome.reason)
                return unrouted
            log.warning("request %s: %s: fallback route", self.request_id, outcome.reason)
            return self._fallback()  # the fallback route takes it
        self.decision = outcome.decision
        self.done = not self.info.sends_response_body
        self.pace_s = self.decision.pace_ms / 1000
        # the body names the engine's model (an alias) and the class (its engine_priority)
        model, priority = outcome.served_model, self.decision.engine_priority
        new_body = None if model is None and priority is None else rewritten(body, model, priority)
        renamed = self.request_id if self.request_id != original_id else None
        if self.decision.prefill is not None:  # the server sends its prefill leg first
            self.pending_prefill = PendingPrefill(self.decision, new_body or body, renamed)
            if self.reply_extended:
                return None
            self.reply_extended = True
            hold_s = hold_for_prefill_s(self.router.cfg.routing.prefill_timeout_s)
            return codec.override_message_timeout(hold_s)
        return self._routed(self.decision, new_body, renamed)

    def routed_reply(self, d: Decision, new_body: bytes | None, renamed: str | None) -> Reply:
        """The reply that sends the request to the decision's backend (as `answer` does;
        a disaggregated decision's, once its prefill leg went)."""
        return self._routed(d, new_body, renamed)

    def _routed(self, d: Decision, new_body: bytes | None, renamed: str | None) -> Reply:
        """The reply that sends the request to the decision's backend."""
        return self.encoder.encode(d, new_body, renamed)

    def _fallback(self) -> Reply:
        """No decision: Envoy's fallback route (or the pool's own balancing) takes it."""
        return self._reply(codec.REQUEST_BODY)

    # -- the response ---------------------------------------------------------------------

    def on_response_headers(self, p: codec.Phase) -> Reply:
        self.status_code = _status(p.headers)
        echo = self._note_served(p.served)
        if p.end_of_stream:  # no body will follow: the headers were the first byte
            self._first_byte()
            self.done = True
            self._end()
        if self.info.observe_only:
            return None
        if echo is None:
            return codec.bare_continue(codec.RESPONSE_HEADERS)
        # the pool's Envoy has no per-backend metadata to echo: the picker says who answered
        # (and, for a disaggregated decision, which engine prefilled it)
        names = {HEADER_BACKEND: echo}
        if self.prefilled_by is not None:
            names[HEADER_PREFILL_BACKEND] = self.prefilled_by
        return codec.continue_response(codec.RESPONSE_HEADERS, set_headers=names)

    def _note_served(self, endpoint: str) -> str | None:
        """The endpoint the data plane says served the request: another backend than the
        chosen one gets its TTFT and E2E, the chosen one a failover. Returns the backend
        to echo to the client (None: not this session's decision, or no endpoint mode)."""
        backend = self.encoder.served(endpoint, self.decision.backend) if self.decision else None
        if self.decision is None or backend is None:
            return None
        if backend != self.decision.backend:
            if self.router.inputs.served_by(self.request_id, backend):
                log.info(
                    "request %s: served by %s, not %s (the data plane went on)",
                    self.request_id,
                    backend,
                    self.decision.backend,
                )
            self.served_backend = backend
        return self.served_backend or self.decision.backend

    def on_response_body(self, p: codec.Phase) -> Reply:
        if not self.info.response_streamed:
            return super().on_response_body(p)
        # FULL_DUPLEX_STREAMED: every chunk goes back as it came, or the client loses it
        self.response_chunks += 1
        self._first_byte(p.body)
        self.events_ended = self.events_ended or ends_event_stream(p.body)
        if self.response_chunks == 2 or (p.end_of_stream or self.events_ended):
            self.router.inputs.stream_sample(self.request_id, p.body)
        self.response_bytes += len(p.body)
        if p.end_of_stream:
            self._end()
        return codec.streamed_body(codec.RESPONSE_BODY, p.body, p.end_of_stream)

    def on_response_trailers(self, p: codec.Phase) -> Reply:
        self._end()
        return self._reply(codec.RESPONSE_TRAILERS)

    def _end(self) -> None:
        """The response ended as this stream saw it (a FULL_DUPLEX_STREAMED response, whose
        data plane need not send an access log): close the request with its status."""
        if self.ended or not self.info.response_streamed:
            return
        self.ended = True
        self.done = True
        if self.decision is not None:
            outcome = outcome_of(self.status_code, frozenset(), VIA_UPSTREAM)
            self.router.inputs.response_size(self.request_id, self.response_bytes)
            self.router.close(
                self.request_id,
                outcome.status,
                served_by=self.served_backend,
                reason=outcome.reason,
            )

    def finish(self) -> None:
        super().finish()
        if self.info.response_streamed and self.decision is not None and not self.ended:
            if self.events_ended:  # served: the client read to `[DONE]` and hung up
                return self._end()
            # the stream ended before the response did: the client went away, or the
            # response was reset (the stream cannot tell which; not held against the backend)
            self.router.close(self.request_id, Status.CANCELLED, reason="stream ended early")

    _handlers: ClassVar[dict[str, Callable[[Any, codec.Phase], Reply]]] = {
        codec.REQUEST_HEADERS: on_request_headers,
        codec.REQUEST_BODY: on_request_body,
        codec.RESPONSE_HEADERS: on_response_headers,
        codec.RESPONSE_BODY: on_response_body,
        codec.RESPONSE_TRAILERS: on_response_trailers,
    }


def _status(headers: Mapping[str, str]) -> int:
    raw = headers.get(":status", "")
    return int(raw) if raw.isdigit() else 0
