"""The class reaches the engine: for a backend whose engine schedules by priority, the body
sent on carries the request's objective's priority in that engine's order (vLLM and a
low-first SGLang: negated; a default SGLang: as it is), over a client's own `priority`;
for any other backend the body goes as it came (no rewrite, a client's field kept). Both
transports: the buffered body's mutation, and the endpoint picker's streamed chunks."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.feeds.server_info import EngineScheduling
from ext_proc.prompt.parse import rewritten
from tests.builders import Stream, make_router
from tests.messages import body, headers

FLOW = {
    # no gateway queue: the class still reaches the engine
    "enabled": False,
    "objectives": [
        {"name": "interactive", "priority": 10},
        {"name": "batch", "priority": 0},
        {"name": "scavenger", "priority": -3, "models": ["cheap"]},
    ],
    "default_objective": "batch",
}


def router(engine: str, setting: str, **extra: Any) -> Router:
    r, _ = make_router(
        "gorgo",
        backends=[
            {"id": "a", "address": "127.0.0.1:1", "engine": engine, "priority_scheduling": setting}
        ],
        flow_control=FLOW,
        **extra,
    )
    return r


def send(
    r: Router, rid: str, objective: str | None = None, **fields: Any
) -> codec.ProcessingResponse:
    req = headers("/v1/chat/completions", rid)
    if objective is not None:
        req.request_headers.headers.headers.add(
            key="x-gorgo-objective", raw_value=objective.encode()
        )
    s = Stream(r)
    s.handle(req)
    payload = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    resp = s.handle(body(json.dumps(payload).encode()))
    assert resp is not None
    return resp


def sent_body(resp: codec.ProcessingResponse) -> dict[str, Any] | None:
    """The body Envoy sends the engine (None: the client's, untouched)."""
    mutation = resp.request_body.response
    if not mutation.HasField("body_mutation"):
        return None
    new = mutation.body_mutation.body
    heads = {h.header.key: h.header.raw_value for h in mutation.header_mutation.set_headers}
    assert heads["content-length"] == str(len(new)).encode()
    out: dict[str, Any] = orjson.loads(new)
    return out


def test_vllm_on_gets_the_class_negated_over_the_clients_own() -> None:
    r = router("vllm", "on")
    interactive = sent_body(send(r, "i", "interactive"))
    assert interactive is not None and interactive["priority"] == -10
    assert interactive["messages"] == [{"role": "user", "content": "hi"}]
    # the default class is 0, vLLM's own default: a body without the field goes as it came
    assert sent_body(send(r, "b", "batch")) is None
    assert sent_body(send(r, "b2")) is None
    # a client that asks for its own priority gets its class's (the header is the contract)
    overridden = sent_body(send(r, "c", "batch", priority=-100))
    assert overridden is not None and overridden["priority"] == 0
    # a class by its model: lower than the default, so after it (a higher value in vLLM)
    cheap = sent_body(send(r, "m", model="cheap"))
    assert cheap is not None and cheap["priority"] == 3
    # the decision says what was written
    assert r.recent.decisions[-1].as_json()["engine_priority"] == 3


def test_a_backend_that_does_not_schedule_by_priority_gets_the_body_as_it_came() -> None:
    for engine, setting in [("vllm", "auto"), ("vllm", "off"), ("sglang", "off")]:
        r = router(engine, setting)
        assert sent_body(send(r, "i", "interactive")) is None
        # a client's own priority goes through untouched
        assert sent_body(send(r, "c", "interactive", priority=7)) is None
        assert "engine_priority" not in r.recent.decisions[-1].as_json()


@pytest.mark.parametrize(("low_first", "expected"), [(False, 10), (True, -10)])
def test_sglang_auto_follows_its_server_info(low_first: bool, expected: int) -> None:
    r = router("sglang", "auto")
    assert sent_body(send(r, "before", "interactive")) is None  # not read yet: off
    r.inputs.record_scheduling("a", EngineScheduling(True, low_first))
    sent = sent_body(send(r, "after", "interactive"))
    assert sent is not None and sent["priority"] == expected
    # the same value as the client's: nothing to rewrite
    assert sent_body(send(r, "same", "interactive", priority=expected)) is None
    # SGLang serves a body without one last: the default class's 0 is written
    default = sent_body(send(r, "default"))
    assert default is not None and default["priority"] == 0


def test_an_alias_and_a_priority_are_written_in_one_rewrite() -> None:
    r = router("vllm", "on", models=[{"name": "chat", "served": [{"model": "v1"}]}])
    sent = sent_body(send(r, "x", "interactive", model="chat", temperature=0.5))
    assert sent is not None
    assert (sent["model"], sent["priority"], sent["temperature"]) == ("v1", -10, 0.5)


def test_rewritten_sets_only_what_is_given() -> None:
    raw = b'{"model":"a","priority":2,"x":[1,{"y":null}]}'
    assert orjson.loads(rewritten(raw)) == orjson.loads(raw)
    assert orjson.loads(rewritten(raw, priority=-4)) == {
        "model": "a",
        "priority": -4,
        "x": [1, {"y": None}],
    }
    assert orjson.loads(rewritten(raw, model="b"))["priority"] == 2


def test_the_endpoint_picker_streams_the_rewritten_body() -> None:
    """FULL_DUPLEX_STREAMED: the body goes back in chunks of the router's; they carry the
    priority."""
    r, _ = make_router(
        "gorgo",
        backends=[
            {"id": "a", "address": "10.0.0.1:8000", "engine": "vllm", "priority_scheduling": "on"}
        ],
        flow_control=FLOW,
        envoy={"mode": "endpoint_picker"},
    )
    req = headers("/v1/chat/completions", "p")
    req.protocol_config.request_body_mode = codec.pb.ProcessingMode.FULL_DUPLEX_STREAMED
    req.request_headers.headers.headers.add(key="x-gorgo-objective", raw_value=b"interactive")
    s = Stream(r)
    assert s.handle(req) is None  # FULL_DUPLEX: the headers' reply waits for the body
    payload = json.dumps({"messages": [{"role": "user", "content": "hi"}], "priority": 1})
    out = s.session.handle(codec.decode(body(payload.encode()))) if s.session else None
    replies = out if isinstance(out, list) else [out]
    chunks = [
        x.request_body.response.body_mutation.streamed_response.body
        for x in replies
        if x is not None and x.WhichOneof("response") == "request_body"
    ]
    assert chunks and orjson.loads(b"".join(chunks))["priority"] == -10
