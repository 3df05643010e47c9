"""The endpoint-picker protocol over FULL_DUPLEX_STREAMED streams, as the Gateway API
Inference Extension's chart configures Envoy: the headers' reply held until the body is
complete, every chunk sent back as it came, the subset hint obeyed, 503 when no endpoint
can take a request, 429 when shedding, the served endpoint credited."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from ext_proc.config.load import backend_from_dict
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.duplex import STREAMED_CHUNK_BYTES, StreamedRoutingSession
from ext_proc.envoy.encoders import decision_encoder
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.envoy.roles import open_session
from ext_proc.envoy.session_base import Reply, Session
from ext_proc.feeds.served_models import ServedModels
from ext_proc.vocab.types import BackendLifecycle
from tests.builders import REGIONS, load, make_router
from tests.fakes import FakeClock

CHAT = json.dumps({"messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()
ADDRESS = {b["id"]: str(b["address"]) for b in REGIONS}
DUPLEX = pb.ProcessingMode.FULL_DUPLEX_STREAMED


def picker(policy: str = "round_robin", **extra: object) -> tuple[Router, FakeClock]:
    """Three backends behind an endpoint picker that names only the chosen endpoint (the
    chart's ORIGINAL_DST cluster takes one)."""
    return make_router(
        policy,
        backends=REGIONS,
        envoy={"mode": "endpoint_picker", "connect_retries": 0},
        **extra,
    )


def first(
    path: str = "/v1/chat/completions",
    rid: str = "rid-1",
    eos: bool = False,
    subset: Sequence[str] | None = None,
    method: str = "POST",
) -> pb.ProcessingRequest:
    """The request headers as the chart's Envoy sends them: both bodies full duplex, and
    the subset hint in the metadata when a gateway sets one."""
    req = pb.ProcessingRequest()
    req.protocol_config.request_body_mode = DUPLEX
    req.protocol_config.response_body_mode = DUPLEX
    h = req.request_headers
    h.end_of_stream = eos
    for k, v in {":path": path, ":method": method, "x-request-id": rid}.items():
        h.headers.headers.add(key=k, raw_value=v.encode())
    if subset is not None:
        hint = req.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.update({"x-gateway-destination-endpoint-subset": list(subset)})
    return req


def chunk(data: bytes, eos: bool = False, response: bool = False) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    b = req.response_body if response else req.request_body
    b.body = data
    b.end_of_stream = eos
    return req


def response_headers(
    status: int = 200, served: str = "", eos: bool = False
) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    h = req.response_headers
    h.end_of_stream = eos
    h.headers.headers.add(key=":status", raw_value=str(status).encode())
    if served:
        lb = req.metadata_context.filter_metadata["envoy.lb"]
        lb.update({"x-gateway-destination-endpoint-served": served})
    return req


def trailers(response: bool = False) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    (req.response_trailers if response else req.request_trailers).SetInParent()
    return req


class Duplex:
    """One ext_proc stream fed as the server loop feeds it; every reply kept, in order."""

    def __init__(self, r: Router) -> None:
        self.router = r
        self.session: Session | None = None
        self.sent: list[pb.ProcessingResponse] = []

    def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        phase = codec.decode(req)
        if self.session is None:
            self.session = open_session(self.router, decision_encoder(self.router.cfg), req, phase)
        replies = _as_list(self.session.handle(phase))
        self.sent += replies
        return replies

    def request(
        self, *parts: bytes, subset: Sequence[str] | None = None, rid: str = "rid-1"
    ) -> list[pb.ProcessingResponse]:
        """Headers, then the body in `parts`: the replies to the last part."""
        assert self.handle(first(rid=rid, subset=subset)) == []  # held for the body
        for i, part in enumerate(parts):
            out = self.handle(chunk(part, eos=i == len(parts) - 1))
            if i < len(parts) - 1:
                assert out == []  # nothing goes back before the body is complete
        return out


def _as_list(reply: Reply) -> list[pb.ProcessingResponse]:
    if reply is None:
        return []
    return reply if isinstance(reply, list) else [reply]


def set_headers(resp: pb.ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(resp, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def streamed(resp: pb.ProcessingResponse, phase: str) -> tuple[bytes, bool]:
    s = getattr(resp, phase).response.body_mutation.streamed_response
    return s.body, s.end_of_stream


def test_the_body_goes_back_chunked_as_it_came_after_the_headers_reply() -> None:
    r, _ = picker()
    parts = [CHAT[:7], CHAT[7:30], b"", CHAT[30:]]
    out = Duplex(r).request(*parts)
    kinds = [
        (x.WhichOneof("response"), x.request_body.response.HasField("body_mutation")) for x in out
    ]
    assert kinds == [("request_headers", False)] + [("request_body", True)] * 4
    named = set_headers(out[0], "request_headers")
    assert named["x-gateway-destination-endpoint"] == ADDRESS["near"]  # round robin's first
    assert out[0].request_headers.response.clear_route_cache
    lb = out[0].dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == ADDRESS["near"]
    back = [streamed(x, "request_body") for x in out[1:]]
    assert [b for b, _ in back] == parts  # the same chunks, the empty one included
    assert [e for _, e in back] == [False, False, False, True]
    assert b"".join(b for b, _ in back) == CHAT
    assert list(r.in_flight) == ["rid-1"]


def test_request_trailers_end_the_body_and_get_their_reply_last() -> None:
    r, _ = picker()
    s = Duplex(r)
    s.handle(first())
    assert s.handle(chunk(CHAT[:10])) == []
    assert s.handle(chunk(CHAT[10:])) == []  # no end of stream: trailers follow
    out = s.handle(trailers())
    assert [x.WhichOneof("response") for x in out] == [
        "request_headers",
        "request_body",
        "request_body",
        "request_trailers",
    ]
    # the body's end is the trailers': no chunk says end of stream
    assert [streamed(x, "request_body") for x in out[1:3]] == [
        (CHAT[:10], False),
        (CHAT[10:], False),
    ]


def test_every_response_chunk_goes_back_and_the_end_closes_the_request() -> None:
    r, clock = picker()
    s = Duplex(r)
    s.request(CHAT)
    (echo,) = s.handle(response_headers(200))
    assert set_headers(echo, "response_headers") == {"x-gorgo-backend": "near"}
    clock.advance(0.25)
    events = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]
    for i, e in enumerate(events):
        (back,) = s.handle(chunk(e, eos=i == len(events) - 1, response=True))
        assert streamed(back, "response_body") == (e, i == len(events) - 1)
        clock.advance(0.1)
        if i == 0:  # the first chunk is the first token
            assert r.in_flight["rid-1"].first_byte_s == pytest.approx(clock() - 0.1)
    assert s.session is not None and s.session.done
    near = r.backends["near"]
    assert not r.in_flight and near.stats.completed == 1
    assert list(near.stats.recent_ttft_ms) == [pytest.approx(250.0)]
    assert list(near.stats.recent_e2e_ms) == [pytest.approx(450.0)]


def test_response_trailers_are_answered_and_end_the_request() -> None:
    r, _ = picker()
    s = Duplex(r)
    s.request(CHAT)
    s.handle(response_headers(200))
    (back,) = s.handle(chunk(b"data: x\n\n", eos=False, response=True))
    assert streamed(back, "response_body") == (b"data: x\n\n", False)
    (t,) = s.handle(trailers(response=True))
    assert t.WhichOneof("response") == "response_trailers"
    assert not r.in_flight and r.backends["near"].stats.completed == 1


def test_a_5xx_from_the_engine_is_its_error_and_a_stream_cut_short_is_cancelled() -> None:
    r, _ = picker()
    s = Duplex(r)
    s.request(CHAT, rid="bad")
    s.handle(response_headers(500))
    s.handle(chunk(b'{"error": "boom"}', eos=True, response=True))
    assert r.backends["near"].stats.errors == 1
    s = Duplex(r)
    s.request(CHAT, rid="cut")  # round robin: mid
    s.handle(response_headers(200))
    s.handle(chunk(b"data: x\n\n", response=True))
    assert s.session is not None
    s.session.finish()  # Envoy ended the stream before the response's end
    mid = r.backends["mid"]
    assert "cut" not in r.in_flight and (mid.stats.cancelled, mid.stats.errors) == (1, 0)


def test_a_client_that_hangs_up_after_done_was_served() -> None:
    """The client read to `data: [DONE]` and closed its connection before the stream's
    last (empty) frame: Envoy ends the ext_proc stream without an end_of_stream chunk.
    The response was whole: completed, not cancelled (as the access-log path reads it)."""
    r, _ = picker()
    s = Duplex(r)
    s.request(CHAT)
    s.handle(response_headers(200))
    s.handle(chunk(b'data: {"a": 1}\n\ndata: [DONE]\n\n', response=True))
    assert s.session is not None and "rid-1" in r.in_flight
    s.session.finish()
    near = r.backends["near"]
    assert not r.in_flight and (near.stats.completed, near.stats.cancelled) == (1, 0)


def test_the_subset_hint_is_obeyed_and_an_empty_one_is_a_503() -> None:
    r, _ = picker()
    for i in range(4):  # round robin would go round; the subset allows far alone
        out = Duplex(r).request(CHAT, subset=[ADDRESS["far"], "10.9.9.9:8000"], rid=f"s{i}")
        assert (
            set_headers(out[0], "request_headers")["x-gateway-destination-endpoint"]
            == ADDRESS["far"]
        )
    for subset in ([], ["10.9.9.9:8000"]):  # no endpoint of the pool in it
        (refused,) = Duplex(r).request(CHAT, subset=subset, rid=f"none-{len(subset)}")
        assert refused.immediate_response.status.code == 503
        assert json.loads(refused.immediate_response.body)["error"]["code"] == "service_unavailable"
    assert sorted(r.in_flight) == ["s0", "s1", "s2", "s3"]


def test_a_subset_host_without_a_port_names_every_backend_on_it() -> None:
    r, _ = picker(policy="least_request")
    out = Duplex(r).request(CHAT, subset=["127.0.0.1"])
    assert (
        set_headers(out[0], "request_headers")["x-gateway-destination-endpoint"] in ADDRESS.values()
    )


def no_active_backend() -> Router:
    """A fleet replaced whole: the old backends gone (nothing was in flight), the new one
    waiting for Envoy to have it."""
    r, _ = picker()
    r.fleet.confirm_new_backends = True
    r.fleet.add(backend_from_dict({"id": "new", "address": "10.0.0.9:8000"}), "reload")
    for b in ("near", "mid", "far"):
        r.fleet.drain(b, "reload")
    assert {b: x.lifecycle for b, x in r.backends.items()} == {"new": BackendLifecycle.PENDING}
    return r


def test_no_active_backend_is_a_503_and_shedding_a_429() -> None:
    r = no_active_backend()
    (refused,) = Duplex(r).request(CHAT)
    assert refused.immediate_response.status.code == 503
    assert not r.in_flight

    r, _ = picker(policy="gorgo", routing={"shed_queue_ms": 1})
    for b in ("near", "mid", "far"):
        load(r, f"x-{b}", b, 1000, prefill_ms=2500)
    (shed,) = Duplex(r).request(CHAT)
    ir = shed.immediate_response
    assert ir.status.code == 429
    assert {h.header.key for h in ir.headers.set_headers} >= {"retry-after", "content-type"}


def test_the_buffered_picker_answers_503_too_instead_of_passing_it_unrouted() -> None:
    r = no_active_backend()
    s = Duplex(r)
    head = pb.ProcessingRequest()
    head.CopyFrom(first())
    head.protocol_config.request_body_mode = pb.ProcessingMode.BUFFERED
    head.protocol_config.response_body_mode = pb.ProcessingMode.NONE
    (ok,) = s.handle(head)
    assert ok.WhichOneof("response") == "request_headers"
    (refused,) = s.handle(chunk(CHAT, eos=True))
    assert refused.immediate_response.status.code == 503


def test_the_served_endpoint_gets_the_ttft_and_e2e_and_the_chosen_one_a_failover() -> None:
    r, clock = picker()
    s = Duplex(r)
    out = s.request(CHAT)
    assert (
        set_headers(out[0], "request_headers")["x-gateway-destination-endpoint"] == ADDRESS["near"]
    )
    clock.advance(0.3)
    # Envoy could not connect to near and went on to mid; it says so in the metadata
    (echo,) = s.handle(response_headers(200, served=ADDRESS["mid"]))
    assert set_headers(echo, "response_headers") == {"x-gorgo-backend": "mid"}
    s.handle(chunk(b"data: x\n\n", response=True))
    clock.advance(0.2)
    s.handle(chunk(b"data: [DONE]\n\n", eos=True, response=True))
    near, mid = r.backends["near"], r.backends["mid"]
    assert (near.stats.failovers, near.stats.completed, list(near.stats.recent_ttft_ms)) == (
        1,
        0,
        [],
    )
    assert mid.stats.completed == 1
    assert list(mid.stats.recent_ttft_ms) == [pytest.approx(300.0)]
    assert list(mid.stats.recent_e2e_ms) == [pytest.approx(500.0)]
    assert (near.load.in_flight, near.load.waiting_first_byte, mid.load.in_flight) == (0, 0, 0)


def test_the_served_endpoint_as_a_response_header_and_the_chosen_one_serving() -> None:
    r, _ = picker()
    s = Duplex(r)
    s.request(CHAT)
    head = response_headers(200)
    head.response_headers.headers.headers.add(
        key="x-gateway-destination-endpoint-served", raw_value=ADDRESS["far"].encode()
    )
    s.handle(head)
    s.handle(chunk(b"data: [DONE]\n\n", eos=True, response=True))
    assert (r.backends["near"].stats.failovers, r.backends["far"].stats.completed) == (1, 1)
    s = Duplex(r)
    s.request(CHAT, rid="own")  # round robin: mid, and mid served it
    s.handle(response_headers(200, served=ADDRESS["mid"]))
    s.handle(chunk(b"data: [DONE]\n\n", eos=True, response=True))
    assert (r.backends["mid"].stats.failovers, r.backends["mid"].stats.completed) == (0, 1)


def test_a_request_the_policy_does_not_route_gets_an_endpoint_and_its_body_back() -> None:
    r, _ = picker()
    s = Duplex(r)
    (named,) = s.handle(first(path="/tokenize"))
    assert (
        set_headers(named, "request_headers")["x-gateway-destination-endpoint"] in ADDRESS.values()
    )
    (back,) = s.handle(chunk(b'{"text": "x"}', eos=True))
    assert streamed(back, "request_body") == (b'{"text": "x"}', True)
    s.handle(response_headers(200))
    (out,) = s.handle(chunk(b'{"tokens": [1]}', eos=True, response=True))
    assert streamed(out, "response_body") == (b'{"tokens": [1]}', True)
    assert s.session is not None and s.session.done and not r.in_flight
    # a GET without a body: an endpoint at once
    (named,) = Duplex(r).handle(first(path="/health", eos=True, method="GET"))
    assert "x-gateway-destination-endpoint" in set_headers(named, "request_headers")


def test_an_unreadable_body_goes_to_some_endpoint_with_its_bytes_intact() -> None:
    r, _ = picker()
    out = Duplex(r).request(b"{not json", b" at all")
    assert "x-gateway-destination-endpoint" in set_headers(out[0], "request_headers")
    assert [streamed(x, "request_body") for x in out[1:]] == [
        (b"{not json", False),
        (b" at all", True),
    ]
    assert not r.in_flight  # not the policy's decision


def test_a_rewritten_body_goes_back_in_bounded_chunks_with_its_length() -> None:
    backends = [{"id": "a", "address": "10.0.0.1:8000"}]
    r, _ = make_router(
        "round_robin",
        backends=backends,
        envoy={"mode": "endpoint_picker", "connect_retries": 0},
        models=[{"name": "chat", "served": [{"model": "v1", "weight": 1}]}],
    )
    r.inputs.record_models("a", ServedModels(frozenset({"v1"})))
    big = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "x " * 100_000}]}
    ).encode()
    parts = [big[i : i + 50_000] for i in range(0, len(big), 50_000)]
    out = Duplex(r).request(*parts)
    new = b"".join(streamed(x, "request_body")[0] for x in out[1:])
    assert json.loads(new)["model"] == "v1"
    assert set_headers(out[0], "request_headers")["content-length"] == str(len(new))
    sizes = [len(streamed(x, "request_body")[0]) for x in out[1:]]
    assert max(sizes) <= STREAMED_CHUNK_BYTES and len(sizes) == -(-len(new) // STREAMED_CHUNK_BYTES)
    assert [streamed(x, "request_body")[1] for x in out[1:]] == [False] * (len(sizes) - 1) + [True]


def test_a_request_held_in_the_gateway_queue_goes_with_its_body_when_released() -> None:
    """Flow control: the headers' reply waits while the request waits for room (Envoy's
    timer extended for it), then goes with every chunk; the objective named by the
    extension's header."""
    r, clock = picker(
        policy="gorgo",
        flow_control={
            "enabled": True,
            # sheddable (its SLO met once room comes): held even as the only class
            # arriving (flow.room.Mix)
            "objectives": [
                {
                    "name": "batch",
                    "priority": 0,
                    "max_wait_s": 60,
                    "ttft_slo_ms": 60_000,
                    "sheddable": True,
                }
            ],
        },
    )
    for b in ("near", "mid", "far"):  # 5 s of prefill not yet started everywhere: no room
        load(r, f"peer-{b}", b, 4000, 10, prefill_ms=5000.0)
    s = Duplex(r)
    head = first()
    head.request_headers.headers.headers.add(
        key="x-gateway-inference-objective", raw_value=b"batch"
    )
    s.handle(head)
    (wait,) = s.handle(chunk(CHAT, eos=True))
    assert wait.HasField("override_message_timeout")
    session = s.session
    assert isinstance(session, StreamedRoutingSession) and session.held is not None
    w, held_body, original = session.held
    assert (w.objective, held_body) == ("batch", CHAT)
    clock.advance(5.0)
    [(done, outcome)] = session.director.admission.pump()
    assert done is w
    out = _as_list(session.answer(outcome, held_body, original))
    assert [x.WhichOneof("response") for x in out] == ["request_headers", "request_body"]
    assert "x-gateway-destination-endpoint" in set_headers(out[0], "request_headers")
    assert streamed(out[1], "request_body") == (CHAT, True)
    assert r.in_flight["rid-1"].waited_ms == 5000.0
