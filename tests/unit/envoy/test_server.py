"""A request another backend served counted against the chosen one, load shedding, and
hostile input never breaking a stream."""

import json
import logging
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc.config.schema import TelemetryConfig
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import AccessLogService
from ext_proc.envoy.server import replies
from ext_proc.prompt.parse import ParseError, api_for_path, parse_body
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.types import Status
from tests.builders import REGIONS, Stream, chat, load, make_router
from tests.fuzz.runner import findings, read_messages
from tests.messages import body, headers


def test_requests_another_backend_served_count_against_the_chosen_one() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    for _ in range(2):  # Envoy could not connect to near and retried on mid: status ok
        d = r.decide(chat(f"p{random.random()}"))
        assert d.backend == "near"
        closed = r.close(d.request_id, Status.OK, served_by="mid")
        assert closed is not None and closed.status == Status.FAILED_OVER
    near = r.backends["near"]
    assert (near.stats.failovers, near.health.ejected_until_s) == (2, clock() + 5.0)
    assert near.stats.completed == 0  # mid's answers are not near's
    # a long prompt served by mid after a failover: its blocks are cached on mid now
    d = r.decide(chat("long prompt " * 2000))
    served = "far" if d.backend != "far" else "mid"
    r.close(d.request_id, Status.OK, served_by=served)
    assert (
        r.backends[served].prefix.match(r.features.prompt_blocks(chat("long prompt " * 2000))[0])
        > 0
    )
    # a request near served itself resets the count; served_by "" (unknown) is not evidence
    clock.advance(5.1)
    d = r.decide(chat("back"))
    r.close(d.request_id, Status.OK, served_by="")
    assert (near.stats.failovers, near.health.request_failures) == (2, 0)


def test_only_a_retried_request_counts_as_a_failover() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    log = AccessLogService(r, Telemetry(TelemetryConfig(), r).fallback)

    def served_elsewhere(attempts: int) -> None:
        d = r.decide(chat(f"p{random.random()}"))
        other = "mid" if d.backend != "mid" else "far"
        log.observe(codec.AccessLogEntry(d.request_id, other, "gorgo", 200, 5.0, attempts))

    # one attempt: the router answered too late and Envoy failed open, not near's fault
    served_elsewhere(1)
    served_elsewhere(1)
    assert r.backends["near"].stats.failovers == 0
    assert r.backends["near"].health.ejected_until_s is None
    served_elsewhere(2)  # Envoy retried a connect failure elsewhere
    assert r.backends["near"].stats.failovers == 1


def test_ranked_puts_the_choice_first_then_best_scores() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    d = r.decide(chat("hello"))
    ranked = d.ranked()
    assert ranked[0] == d.backend and sorted(ranked) == sorted(r.backends)
    rest = [d.scores[b] for b in ranked[1:]]
    assert rest == sorted(rest)


def test_shedding_only_when_every_queue_is_past_the_bound() -> None:
    r, _ = make_router("gorgo", backends=REGIONS, routing={"shed_queue_ms": 2000})
    assert r.admit(chat("hello")) is None
    for b in ("near", "mid"):
        load(r, f"x-{b}", b, 1000, prefill_ms=5000)
    assert r.admit(chat("hello")) is None  # far is still free
    load(r, "x-far", "far", 1000, prefill_ms=3000)
    shed = r.admit(chat("hello"))
    assert shed is not None and shed.retry_after_s == pytest.approx(3.0)  # the shortest wait


def test_shed_requests_get_429_with_retry_after() -> None:
    r, _ = make_router("gorgo", backends=REGIONS, routing={"shed_queue_ms": 1})
    for b in ("near", "mid", "far"):
        load(r, f"x-{b}", b, 1000, prefill_ms=2500)
    s = Stream(r)
    s.handle(headers("/v1/chat/completions", "shed-me"))
    resp = s.handle(body(b'{"messages": [{"role": "user", "content": "hi"}]}'))
    assert resp is not None and resp.WhichOneof("response") == "immediate_response"
    ir = resp.immediate_response
    assert ir.status.code == 429
    error = json.loads(ir.body)["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "rate_limit_error",
        "rate_limit_exceeded",
        None,
    )
    answered = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    # the least queue estimate, 2.5 s of prefill: in whole seconds rounded up, and exact
    assert (answered["retry-after"], answered["retry-after-ms"]) == (b"3", b"2500")
    assert "shed-me" not in r.in_flight


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate", "/x", ""])
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
BODIES = (
    st.binary(max_size=2000)
    | JSONISH.map(lambda v: json.dumps(v).encode())
    | st.builds(
        lambda msgs, extra: json.dumps({"messages": msgs, **extra}).encode(),
        st.lists(
            st.dictionaries(st.sampled_from(["role", "content", "x"]), JSONISH, max_size=3),
            max_size=4,
        ),
        st.dictionaries(
            st.sampled_from(["max_tokens", "stream", "user", "model", "prompt"]),
            JSONISH,
            max_size=3,
        ),
    )
    | st.integers(1, 200).map(lambda n: b"[" * n * 50)  # deep nesting
    | st.just(b"\xff\xfe\x00garbage")
)


# `make test` runs 1,000 generated bodies (~8 s here), the long tier 10,000 (~80 s).
QUICK = settings(max_examples=1_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(QUICK, max_examples=10_000)


@QUICK
@given(PATHS, BODIES, st.booleans(), st.booleans())
def test_no_input_breaks_the_stream(path: str, data: bytes, split: bool, reject: bool) -> None:
    """Generated bodies: every message gets a reply, never an exception; an unreadable
    body falls back (routing.unreadable_body: route) or is answered 400 with a JSON error
    naming the problem (reject); nothing stays in flight once closed."""
    no_input_breaks_the_stream(path, data, split, reject)


@pytest.mark.long  # `make test-long`
@LONG
@given(PATHS, BODIES, st.booleans(), st.booleans())
def test_no_input_of_ten_thousand_breaks_the_stream(
    path: str, data: bytes, split: bool, reject: bool
) -> None:
    no_input_breaks_the_stream(path, data, split, reject)


def no_input_breaks_the_stream(path: str, data: bytes, split: bool, reject: bool) -> None:
    r, _ = REJECTING if reject else ROUTER
    s = Stream(r)
    assert s.handle(headers(path, "fuzz")) is not None
    if s.done:
        return
    parts = [data[: len(data) // 2], data[len(data) // 2 :]] if split else [data]
    for i, part in enumerate(parts):
        resp = s.handle(body(part, eos=i == len(parts) - 1))
        assert resp is not None
    try:
        parse_body(api_for_path(path) or "", data)
    except ParseError as e:
        if reject:
            assert resp.WhichOneof("response") == "immediate_response"
            assert resp.immediate_response.status.code == 400
            error = json.loads(resp.immediate_response.body)["error"]
            assert str(e) in error["message"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_body")
        else:  # no routing header: the fallback route serves it
            assert not resp.request_body.response.header_mutation.set_headers
    else:
        assert resp.request_body.response.header_mutation.set_headers[0].header.key == (
            "x-gorgo-backend"
        )
    r.close("fuzz", Status.OK)
    assert not r.in_flight


@pytest.mark.parametrize("mode", ["route", "reject"])
def test_no_prompt_text_reaches_the_logs(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    secret = "SECRET-PROMPT-TEXT"
    r, _ = make_router("gorgo", backends=REGIONS, routing={"unreadable_body": mode})
    bodies = [
        json.dumps({"messages": [{"role": "user", "content": secret}]}).encode(),
        json.dumps({"messages": [{"content": "x"}], "max_tokens": secret}).encode(),
        json.dumps({"messages": secret}).encode(),
        json.dumps({"prompt": {"text": secret}}).encode(),
        json.dumps({"messages": [{"content": "x"}], "stream": secret}).encode(),
        b'{"messages": [{"content": "' + secret.encode() + b'"}',  # truncated JSON
        secret.encode(),
    ]
    caplog.set_level(logging.DEBUG)
    for i, data in enumerate(bodies):
        s = Stream(r)
        s.handle(headers("/v1/chat/completions", f"s{i}"))
        s.handle(body(data))
    assert "unreadable body" in caplog.text  # the failures were logged...
    assert secret not in caplog.text  # ...without the prompt


ROUTER = make_router("gorgo", backends=REGIONS)
REJECTING = make_router("gorgo", backends=REGIONS, routing={"unreadable_body": "reject"})


def test_a_ten_megabyte_body_is_routed() -> None:
    r, _ = make_router("gorgo", backends=REGIONS)
    s = Stream(r)
    s.handle(headers("/v1/completions", "big"))
    resp = s.handle(body(json.dumps({"prompt": "word " * 2_000_000}).encode()))  # ~10 MB
    assert resp is not None
    heads = {h.header.key for h in resp.request_body.response.header_mutation.set_headers}
    assert heads == {"x-gorgo-backend", "x-envoy-upstream-rq-per-try-timeout-ms"}
    assert r.in_flight["big"].input_tokens == 2_500_000


def observer_chunk(
    rid: str, data: bytes, code: int = 0, details: str = ""
) -> codec.ProcessingRequest:
    """The observing filter's first message: the first response chunk, the request id and
    (when given) the response code and its details as attributes, as Envoy sends them."""
    req = body(data, response=True, eos=False)
    req.observability_mode = True
    req.protocol_config.response_body_mode = codec.pb.ProcessingMode.STREAMED
    attrs = req.attributes["envoy.filters.http.ext_proc"].fields
    attrs["request.id"].string_value = rid
    if code:
        attrs["response.code"].number_value = code
        attrs["response.code_details"].string_value = details
    return req


def test_an_error_event_as_the_first_chunk_is_a_failure_not_a_ttft() -> None:
    r, clock = make_router("gorgo", backends=REGIONS)
    for i in range(2):
        d = r.decide(chat(f"p{i}"))
        clock.advance(0.05)
        event = b'data: {"error": {"object": "error", "message": "boom", "code": 500}}\n\n'
        Stream(r).handle(observer_chunk(d.request_id, event))
        assert d.request_id not in r.in_flight  # closed as an error, at once
        assert not r.backends[d.backend].stats.recent_ttft_ms  # not a first token
        # the access log's 200 that follows finds it closed
        assert r.close(d.request_id, Status.OK) is None
    near = r.backends["near"]
    assert (
        near.stats.errors == 2 and near.health.ejected_until_s is not None
    )  # two in a row: ejected
    d = r.decide(chat("fine"))
    Stream(r).handle(observer_chunk(d.request_id, b'data: {"id": "x", "choices": []}\n\n'))
    assert r.backends[d.backend].stats.recent_ttft_ms  # a normal first chunk is timed


def test_a_backends_5xx_counts_at_its_first_chunk_and_envoys_own_do_not() -> None:
    """The observer's first chunk carries the response code: a 5xx the backend answered
    (via_upstream) closes the request as the backend's failure at once, so two in a row
    eject it before the client can send its next request (the access-log entry comes
    only when the exchange ends: a race the long tier lost on CI); Envoy's or the
    router's own 5xx, or a 4xx, is not held against the backend."""
    r, clock = make_router("gorgo", backends=REGIONS)
    engine_500 = b'{"error": {"message": "boom", "type": "InternalServerError"}}'
    for code, details in (
        (503, "gorgo_service_unavailable"),
        (502, "upstream_reset_x"),
        (404, "via_upstream"),
    ):
        d = r.decide(chat(f"{code}"))
        Stream(r).handle(observer_chunk(d.request_id, engine_500, code, details))
        assert d.request_id in r.in_flight  # left to the access log's entry
        assert d.backend == "near"
        r.close(d.request_id, Status.CANCELLED)
    for i in range(2):
        d = r.decide(chat(f"p{i}"))
        assert d.backend == "near"
        clock.advance(0.05)
        Stream(r).handle(observer_chunk(d.request_id, engine_500, 500, "via_upstream"))
        assert d.request_id not in r.in_flight
        assert r.close(d.request_id, Status.ERROR) is None  # the access log's entry, later
    near = r.backends["near"]
    assert near.stats.errors == 2 and near.health.ejected_until_s is not None
    assert list(near.health.recent_failures) == ["500 via_upstream"] * 2
    assert len(near.stats.recent_ttft_ms) == 3  # the first three's; no failure's
    assert r.decide(chat("next")).backend != "near"


def test_a_late_success_of_an_older_request_does_not_end_a_failure_streak() -> None:
    """Successes come in batched access-log entries (up to 50 ms late), failures at once:
    an older request's success reported between two newer failures must not reset the
    streak (seen live: 2 errors in a row, never ejected); a newer success does."""
    r, clock = make_router("gorgo", backends=REGIONS)
    older = r.decide(chat("older"))
    assert older.backend == "near"
    clock.advance(0.01)
    first = r.decide(chat("f1"))
    r.close(first.request_id, Status.ERROR)
    r.close(older.request_id, Status.OK)  # its entry, batched, after the failure
    second = r.decide(chat("f2"))
    r.close(second.request_id, Status.ERROR)
    near = r.backends["near"]
    assert near.health.ejected_until_s is not None  # two in a row, by dispatch
    clock.advance(10.0)  # the ejection over: a newer success ends a streak
    streak = r.decide(chat("f3"))
    assert streak.backend == "near"
    r.close(streak.request_id, Status.ERROR)
    newer = r.decide(chat("ok"))
    r.close(newer.request_id, Status.OK)
    assert near.health.request_failures == 0


def test_a_first_chunk_timed_after_the_response_ended_is_moved_back_to_its_end() -> None:
    """The observer's first-chunk message reaches a busy router after Envoy sent the whole
    short response (seen once in the e2e tests: TTFT 22.6 ms against E2E 21.7 ms): the
    TTFT the router keeps is never past the E2E Envoy measured."""
    r, clock = make_router("gorgo", backends=REGIONS)
    d = r.decide(chat("short"))
    clock.advance(0.030)
    first = r.first_byte(d.request_id)
    assert first is not None and first.ttft_ms == pytest.approx(30.0)
    closed = r.close(d.request_id, Status.OK, e2e_ms=21.7)
    assert closed is not None and closed.ttft_ms == pytest.approx(21.7)
    b = r.backends[d.backend]
    assert list(b.stats.recent_ttft_ms) == pytest.approx([21.7])
    assert list(b.stats.recent_e2e_ms) == [21.7] and (b.stats.completed, b.stats.errors) == (1, 0)


async def test_an_access_log_entry_that_overtakes_the_first_chunk_waits_for_it() -> None:
    """The entry and the observer's first-chunk message travel over two gRPC streams: when
    the entry wins, the close waits a moment so the TTFT is still learned, never later
    than the response's end."""
    import asyncio

    from ext_proc.envoy.access_log import COMPLETION_GRACE_S

    r, clock = make_router("gorgo", backends=REGIONS)
    log = AccessLogService(r, Telemetry(TelemetryConfig(), r).fallback)
    d = r.decide(chat("quick"))
    clock.advance(0.010)
    log.observe(codec.AccessLogEntry(d.request_id, d.backend, "gorgo", 200, 6.0, 1))
    assert d.request_id in r.in_flight  # not closed yet: its first chunk may follow
    clock.advance(0.002)
    first = r.first_byte(d.request_id)  # the observer's message, late
    assert first is not None and first.ttft_ms == 6.0  # not after the response's end
    await asyncio.sleep(COMPLETION_GRACE_S + 0.05)
    assert d.request_id not in r.in_flight
    assert list(r.backends[d.backend].stats.recent_e2e_ms) == [6.0]
    # an error or a client gone sends no body to wait for: closed at once
    d2 = r.decide(chat("gone"))
    log.observe(codec.AccessLogEntry(d2.request_id, d2.backend, "gorgo", 0, 3.0, 1))
    assert d2.request_id not in r.in_flight


def test_the_output_length_is_counted_from_the_response_size_and_learned() -> None:
    """The observer keeps its stream for the second chunk (one token's event, as this
    engine writes it for this request) and closes it then; the access log's body size
    counts the tokens, which teach the output lengths of requests without max_tokens."""
    r, clock = make_router("gorgo", backends=REGIONS)
    log = AccessLogService(r, Telemetry(TelemetryConfig(), r).fallback)
    role = b'data: {"id":"x","choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"id":"x","choices":[{"delta":{"content":"abc"}}]}\n\n'
    for i in range(8):
        d = r.decide(chat(f"p{i}"))  # no max_tokens
        s = Stream(r)
        s.handle(observer_chunk(d.request_id, role + token))
        assert not s.done  # waits for the second chunk
        assert s.handle(body(token, response=True, eos=False)) is None  # not waited for
        assert s.done and r.in_flight[d.request_id].token_event_bytes == len(token)
        clock.advance(0.5)
        size = len(role) + 120 * len(token) + len(b"data: [DONE]\n\n")
        log._close(
            codec.AccessLogEntry(
                d.request_id, d.backend, "gorgo", 200, 500.0, 1, response_body_bytes=size
            )
        )
    learned = r.fleet.state.output_lengths.as_json()["*"]  # no model named: any model's
    assert learned["completions"] == 8 and learned["mean_tokens"] == pytest.approx(120, abs=1)
    # a response of one chunk (a short answer) is measured on that chunk; a whole JSON
    # answer is not an event stream: not counted
    d = r.decide(chat("short"))
    s = Stream(r)
    s.handle(observer_chunk(d.request_id, role + token + b"data: [DONE]\n\n"))
    assert s.done and r.in_flight[d.request_id].token_event_bytes is not None
    d = r.decide(chat("whole"))
    s = Stream(r)
    s.handle(observer_chunk(d.request_id, b'{"choices": []}'))
    assert s.done and r.in_flight[d.request_id].token_event_bytes is None


@pytest.mark.parametrize("found", findings("session"), ids=lambda p: p.name)
def test_a_message_out_of_envoys_order_is_answered_or_ends_the_stream(found: Path) -> None:
    """Found by fuzzing (tests/fuzz/session.py), messages Envoy's protocol does not send:
    a second headers message on a FULL_DUPLEX_STREAMED stream was never answered; a body
    chunk after headers that ended the stream was kept and never sent back; a second
    complete body was routed again, leaving the first decision in flight. Now each
    message is answered or (a second headers) ends the stream with a ValueError, and once
    the stream's request is closed nothing stays in flight."""
    r, _ = make_router("gorgo", backends=REGIONS)
    s = Stream(r)
    for data in read_messages(found):
        req = codec.ProcessingRequest.FromString(data)
        try:
            reply = s.handle(req)
        except ValueError as e:
            assert "a second one" in str(e)
            break
        assert replies(reply), f"{found.name}: no reply to {req.WhichOneof('request')}"
    assert s.session is not None
    s.session.finish()
    request_id = getattr(s.session, "request_id", "")
    if request_id:
        r.close(request_id, Status.OK)
    assert not r.in_flight
    assert all(b.load.in_flight == 0 for b in r.backends.values())
