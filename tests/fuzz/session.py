"""A whole ext_proc session (ext_proc/envoy/sessions.py, roles.py) fed any messages: the
routing stream, the observer's, the pass-through and /v1/models ones, with any phases in
any order, bodies, attributes and metadata, as the server loop feeds them (tests/builders
Stream).

Invariant: every message of a stream that Envoy waits on gets a reply (in
FULL_DUPLEX_STREAMED mode once the request's body is complete), and a message
that names no phase, or a second headers or trailers message, is refused with a
ValueError that says so (the server then ends the
stream: Envoy fails open); nothing raises otherwise; once the stream has ended and its
request is closed, nothing stays in flight, on the router or on any backend."""

from __future__ import annotations

import logging

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from google.protobuf.message import DecodeError

    from ext_proc.envoy import codec
    from ext_proc.envoy.proto import envoy_wire_pb2 as pb
    from ext_proc.envoy.server import replies
    from ext_proc.vocab.types import Status
    from tests.builders import REGIONS, Stream, make_router

from tests.fuzz.runner import fuzz

logging.disable(logging.CRITICAL)  # the router logs every refusal and unreadable body

NAME = "session"
# Two routers kept from input to input (state carries over, as in a server), each input
# ten minutes after the last: an ejection for the last input's errors is over.
ROUTERS = (
    make_router("gorgo", backends=REGIONS),
    make_router("gorgo", backends=REGIONS, routing={"unreadable_body": "reject"}),
)
GAP_S = 600.0
PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/x", "")
METHODS = ("POST", "GET", "PUT")
MODES = (
    pb.ProcessingMode.NONE,
    pb.ProcessingMode.STREAMED,
    pb.ProcessingMode.BUFFERED,
    pb.ProcessingMode.FULL_DUPLEX_STREAMED,
)
BODIES = (
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}',
    b'{"prompt":"once","max_tokens":2,"stream":true}',
    b'{"text":"x","sampling_params":{"max_new_tokens":1}}',
    b'data: {"error": {"message": "boom"}}\n\n',
    b'data: {"choices": []}\n\n',
    b"",
)
PHASES = (*codec.PHASES, "")


def _headers(fdp: atheris.FuzzedDataProvider, h: pb.HeaderMap) -> None:
    if fdp.ConsumeBool():
        h.headers.add(
            key=":path", raw_value=PATHS[fdp.ConsumeIntInRange(0, len(PATHS) - 1)].encode()
        )
    if fdp.ConsumeBool():
        h.headers.add(key=":method", raw_value=METHODS[fdp.ConsumeIntInRange(0, 2)].encode())
    if fdp.ConsumeBool():
        h.headers.add(key="x-request-id", raw_value=fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8)))
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        key = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
        h.headers.add(key=key, raw_value=fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)))


def _message(fdp: atheris.FuzzedDataProvider, first: bool) -> pb.ProcessingRequest | None:
    """One message: raw bytes read as one (None if they are not), or one built of parts."""
    if fdp.ConsumeIntInRange(0, 7) == 0:
        try:
            return pb.ProcessingRequest.FromString(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)))
        except DecodeError:
            return None
    req = pb.ProcessingRequest()
    name = (
        PHASES[fdp.ConsumeIntInRange(0, len(PHASES) - 1)] if not first or fdp.ConsumeBool() else ""
    )
    name = name or (codec.REQUEST_HEADERS if first else "")
    eos = fdp.ConsumeBool()
    if name in (codec.REQUEST_HEADERS, codec.RESPONSE_HEADERS):
        part = getattr(req, name)
        part.end_of_stream = eos
        _headers(fdp, part.headers)
    elif name in (codec.REQUEST_BODY, codec.RESPONSE_BODY):
        part = getattr(req, name)
        part.end_of_stream = eos
        pick = fdp.ConsumeIntInRange(0, len(BODIES))
        part.body = BODIES[pick] if pick < len(BODIES) else fdp.ConsumeBytes(200)
    elif name:
        _headers(fdp, getattr(req, name).trailers)
    if first or fdp.ConsumeIntInRange(0, 3) == 0:
        req.observability_mode = fdp.ConsumeIntInRange(0, 3) == 0
        req.protocol_config.request_body_mode = MODES[fdp.ConsumeIntInRange(0, 3)]
        req.protocol_config.response_body_mode = MODES[fdp.ConsumeIntInRange(0, 3)]
    if fdp.ConsumeIntInRange(0, 3) == 0:
        attrs = req.attributes["envoy.filters.http.ext_proc"].fields
        attrs["request.id"].string_value = fdp.ConsumeUnicodeNoSurrogates(8)
        attrs["response.code"].number_value = fdp.ConsumeIntInRange(0, 600)
        attrs["response.code_details"].string_value = fdp.ConsumeUnicodeNoSurrogates(16)
    if fdp.ConsumeIntInRange(0, 3) == 0:
        meta = req.metadata_context.filter_metadata
        hint = meta["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"]
        hint.string_value = fdp.ConsumeUnicodeNoSurrogates(40)
        served = meta["envoy.lb"].fields["x-gateway-destination-endpoint-served"]
        served.string_value = fdp.ConsumeUnicodeNoSurrogates(24)
    return req


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    r, clock = ROUTERS[fdp.ConsumeIntInRange(0, len(ROUTERS) - 1)]
    clock.advance(GAP_S)
    s = Stream(r)
    waited = answered = 0  # messages Envoy waits on, replies sent
    try:
        for i in range(fdp.ConsumeIntInRange(1, 8)):
            req = _message(fdp, first=i == 0)
            if req is None:
                continue
            try:
                reply = s.handle(req)
            except ValueError as e:  # no phase, or a second headers: the stream ends here
                assert "message ''" in str(e) or "phase ''" in str(e) or "a second" in str(e), e
                break
            session = s.session
            assert session is not None
            waits = not session.info.observe_only and req.WhichOneof("request") is not None
            waited += waits
            answered += len(replies(reply))
            # FULL_DUPLEX_STREAMED: the replies wait for the whole body, then all go out
            if not session.info.request_streamed or getattr(session, "sent_on", True):
                assert answered >= waited, f"no reply to {req.WhichOneof('request')}"
            assert getattr(session, "held", None) is None  # no gateway queue configured
            if session.done:
                break
    finally:
        if s.session is not None:
            s.session.finish()
    request_id = getattr(s.session, "request_id", "")
    if request_id:
        r.close(request_id, Status.OK)
    assert not r.in_flight, f"still in flight: {sorted(r.in_flight)}"
    for b in r.backends.values():
        load = b.load
        assert (load.in_flight, load.waiting_first_byte, load.in_flight_tokens) == (0, 0, 0)
        assert not load.records


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
