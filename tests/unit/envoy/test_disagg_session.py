"""A routing session's disaggregated decision, without Envoy: the body's reply asks Envoy to
wait (once per message: not again for a request the gateway queue already held), then the
decode leg's reply names both engines with the decode body; a failed prefill leg is the
router's own answer naming the prefill engine, and the request is closed at once, not
against the decode engine."""

from __future__ import annotations

import dataclasses
import json

from ext_proc.director.outcomes import Routed
from ext_proc.envoy import codec
from ext_proc.envoy.disagg import send_prefill
from ext_proc.envoy.prefill import PrefillFailed, PrefillResult, PrefillSent
from ext_proc.envoy.sessions import RoutingSession
from ext_proc.vocab.types import PrefillLeg
from tests.builders import REGIONS, Stream, chat, make_router
from tests.messages import headers

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


class FakeLegs:
    """The prefill legs as the sender would end them: `result` for each."""

    def __init__(self, result: PrefillResult) -> None:
        self.result = result
        self.sent: list[tuple[str, str, bytes, str]] = []

    async def send(self, prefill_id: str, path: str, body: bytes, request_id: str) -> PrefillResult:
        self.sent.append((prefill_id, path, body, request_id))
        return self.result


def session_with_decision(
    extended: bool = False, decode_role: str = "decode"
) -> tuple[RoutingSession, str]:
    # `far` prefills when the others decode (a decode engine needs a prefill engine)
    backends = [
        {**b, "role": "prefill" if b["id"] == "far" and decode_role == "decode" else decode_role}
        for b in REGIONS
    ]
    r, _ = make_router("round_robin", backends=backends, routing={"prefill_timeout_s": 7})
    d = r.decide(chat("hi"))
    s = Stream(r)
    s.handle(headers("/v1/chat/completions", d.request_id))
    session = s.session
    assert isinstance(session, RoutingSession)
    session.reply_extended = extended  # the gateway queue held it (its override went)
    pd = dataclasses.replace(d, prefill=PrefillLeg("far", 1 << 20, 12.0))
    first = session.answer(Routed(pd), BODY, d.request_id)
    if extended:
        assert first is None  # Envoy already waits longer: nothing to send yet
    else:
        assert isinstance(first, codec.ProcessingResponse)
        assert first.WhichOneof("response") is None
        assert first.override_message_timeout.seconds == 12  # the timeout + 5 s slack
    assert session.pending_prefill is not None
    return session, d.backend


async def test_the_decode_leg_names_both_engines_and_carries_the_decode_body() -> None:
    for extended in (False, True):
        session, decode = session_with_decision(extended)
        legs = FakeLegs(PrefillSent(b'{"decode": true}'))
        reply = await send_prefill(session, legs)  # type: ignore[arg-type]
        assert legs.sent == [("far", "/v1/chat/completions", BODY, session.request_id)]
        assert isinstance(reply, codec.ProcessingResponse)
        common = reply.request_body.response
        assert common.body_mutation.body == b'{"decode": true}'
        set_headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
        assert set_headers["x-gorgo-backend"] == decode.encode()
        assert set_headers["x-gorgo-prefill-backend"] == b"far"
        assert set_headers["content-length"] == b"16"
        assert session.pending_prefill is None and session.router.in_flight


async def test_a_failed_prefill_leg_is_answered_and_closed_not_against_the_decode() -> None:
    for timed_out, status in ((False, 503), (True, 504)):
        session, decode = session_with_decision()
        reason = "prefill engine far unreachable: refused"
        reply = await send_prefill(session, FakeLegs(PrefillFailed(reason, timed_out)))  # type: ignore[arg-type]
        assert isinstance(reply, codec.ProcessingResponse)
        answer = reply.immediate_response
        assert answer.status.code == status
        assert json.loads(answer.body)["error"]["message"] == reason
        named = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
        assert named["x-gorgo-prefill-backend"] == b"far"
        assert session.done and not session.router.in_flight
        stats = session.router.backends[decode].stats
        assert (stats.errors, stats.gateway_errors) == (0, 1)


async def test_a_decode_engine_that_serves_whole_requests_takes_it_whole() -> None:
    session, decode = session_with_decision(decode_role="both")
    reply = await send_prefill(session, FakeLegs(PrefillFailed("refused")))  # type: ignore[arg-type]
    assert isinstance(reply, codec.ProcessingResponse)
    common = reply.request_body.response
    set_headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert set_headers["x-gorgo-backend"] == decode.encode()
    assert "x-gorgo-prefill-backend" not in set_headers  # not prefilled apart
    assert common.body_mutation.body == BODY  # the client's, nothing of the pair in it
    assert session.router.in_flight  # served on: the access log closes it
