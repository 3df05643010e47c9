"""What every session of an ext_proc stream shares: the reply's shape, the phase dispatch
(one method per phase, Envoy AI Gateway's processorForPath + passThroughProcessor
pattern), the response's first byte watched (the TTFT; a stream that ends without it
closes its request as cancelled), and the observing session, which does only that. The
routing session is sessions.py's; roles.py chooses a stream's session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

from ext_proc.common.names import HEADER_REQUEST_ID
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import Forward, first_chunk_event
from ext_proc.envoy.outcome import VIA_UPSTREAM, outcome_of
from ext_proc.prompt.parse import ends_event_stream, event_bytes, is_error_event
from ext_proc.vocab.types import Status

log = logging.getLogger("gorgo.server")


# What a session answers one message with: nothing (observability mode, or a reply held
# for later), one reply, or several in order (FULL_DUPLEX_STREAMED: the headers' reply, the
# body's chunks, the trailers' reply).
Reply = codec.ProcessingResponse | list[codec.ProcessingResponse] | None


class Session:
    """One HTTP request as seen through one ext_proc stream: one method per phase; a
    phase without a method is acknowledged and nothing else happens."""

    def __init__(self, info: codec.StreamInfo) -> None:
        self.info = info
        # True once nothing more is needed from this stream: the server then closes it.
        self.done = False
        # Seconds to wait before sending the reply just handled (dispatch pacing).
        self.pace_s = 0.0
        # The headers and trailers messages handled so far (each comes once).
        self._seen: set[str] = set()

    def handle(self, p: codec.Phase) -> Reply:
        handler = self._handlers.get(p.name)
        if p.name in codec.ONCE_PER_STREAM:  # a second one (fuzzing: left unanswered)
            if p.name in self._seen:  # ends the stream as an unknown message does
                raise ValueError(f"unexpected ext_proc message {p.name!r}: a second one")
            self._seen.add(p.name)
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


class FirstByteWatcher(Session):
    """A stream that may see the response: its first byte is the TTFT; a stream that
    watched for it and ends without it means the request ended without a body (client
    gone, upstream reset), and the request is closed as cancelled."""

    def __init__(
        self,
        router: Router,
        info: codec.StreamInfo,
        request_id: str,
        forward: Forward | None = None,
        response_status: tuple[int, str] = (0, ""),
    ) -> None:
        super().__init__(info)
        self.router = router
        self.request_id = request_id
        self.first_byte_seen = False
        # Several routers behind one Envoy: another router's request goes to it.
        self.forward = forward
        # The response's code and code details, when Envoy sent them as attributes: a 5xx
        # the backend answered is its failure, known at the first chunk.
        code, details = response_status
        upstream_failed = code >= 500 and details == VIA_UPSTREAM
        self.upstream_failure = outcome_of(code, frozenset(), details) if upstream_failed else None

    def on_response_headers(self, p: codec.Phase) -> Reply:
        if p.end_of_stream:  # no body will follow: the headers were the first byte
            self._first_byte()
            self.done = True
        return self._reply(codec.RESPONSE_HEADERS)

    def on_response_body(self, p: codec.Phase) -> Reply:
        second, body = self.first_byte_seen, p.body
        self._first_byte(body)
        # the first chunk is the TTFT, the second (of an event stream) one token's event,
        # whose size counts the tokens at the end; later chunks skip Python
        self.done = second or p.end_of_stream or ends_event_stream(body) or not event_bytes(body)
        if self.done and self.request_id:
            self.router.inputs.stream_sample(self.request_id, body)
        return self._reply(codec.RESPONSE_BODY)

    def _first_byte(self, chunk: bytes = b"") -> None:
        if not self.first_byte_seen and self.request_id:
            self.first_byte_seen = True
            failure = self.upstream_failure
            error = failure is not None or is_error_event(chunk)
            if error:
                # The backend's 5xx, or an error inside a 200 stream: not a first token,
                # and the backend's failure (the access-log entry that follows finds it
                # closed).
                reason = failure.reason if failure is not None else "error event in the stream"
                log.info("request %s: %s", self.request_id, reason)
                mine = self.router.close(self.request_id, Status.ERROR, reason=reason) is not None
            else:
                mine = self.router.first_byte(self.request_id) is not None
            if not mine and self.forward is not None:  # another router's, or a repeat
                self.forward(first_chunk_event(self.request_id, error))

    def finish(self) -> None:
        # All other requests are closed by their access-log entry (or, if lost, expiry).
        if self.info.sends_response_body and not self.first_byte_seen and self.request_id:
            self.router.close(self.request_id, Status.CANCELLED)


class ObservingSession(FirstByteWatcher):
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
        codec.RESPONSE_HEADERS: FirstByteWatcher.on_response_headers,
        codec.RESPONSE_BODY: FirstByteWatcher.on_response_body,
    }
