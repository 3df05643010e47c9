"""Many models at Envoy's side: the router's own answers for what no engine should see
(an unknown model: 404), the fleet's `GET /v1/models` at the front door, and an alias's
share sent on with the body's `model` rewritten to the served name."""

import json

import orjson

from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.feeds.served_models import ServedModels
from tests.builders import Stream, make_router
from tests.messages import body, headers

BACKENDS = [
    {"id": "a", "address": "127.0.0.1:1", "rtt_prior_ms": 10},
    {"id": "b", "address": "127.0.0.1:2", "rtt_prior_ms": 20},
]
ROLLOUT = [{"name": "chat", "served": [{"model": "v1", "weight": 3}, {"model": "v2", "weight": 1}]}]


def fleet() -> Router:
    r, _ = make_router("gorgo", backends=BACKENDS, models=ROLLOUT)
    r.inputs.record_models("a", ServedModels(frozenset({"v1"})))
    r.inputs.record_models("b", ServedModels(frozenset({"v2"}), {"v2-sql": "v2"}))
    return r


def send(r: Router, rid: str, payload: dict[str, object]) -> codec.ProcessingResponse:
    s = Stream(r)
    s.handle(headers("/v1/chat/completions", rid))
    resp = s.handle(body(json.dumps(payload).encode()))
    assert resp is not None
    return resp


def chat_body(model: str, session: str) -> dict[str, object]:
    return {"model": model, "user": session, "messages": [{"role": "user", "content": "hi"}]}


def test_an_unknown_model_is_answered_404_by_the_router() -> None:
    r = fleet()
    resp = send(r, "u1", chat_body("gamma", "s"))
    assert resp.WhichOneof("response") == "immediate_response"
    assert resp.immediate_response.status.code == 404
    err = json.loads(resp.immediate_response.body)["error"]
    assert "gamma" in err["message"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    assert "u1" not in r.in_flight


def test_an_alias_goes_as_a_served_name_in_its_shares_and_a_session_keeps_its_own() -> None:
    r = fleet()
    seen: dict[str, str] = {}
    for i in range(400):
        session = f"s{i % 100}"
        resp = send(r, f"r{i}", chat_body("chat", session))
        mutation = resp.request_body.response
        sent = orjson.loads(mutation.body_mutation.body)
        heads = {h.header.key: h.header.raw_value for h in mutation.header_mutation.set_headers}
        assert heads["content-length"] == str(len(mutation.body_mutation.body)).encode()
        assert sent["messages"] == [{"role": "user", "content": "hi"}]
        backend = heads["x-gorgo-backend"].decode()
        assert backend == {"v1": "a", "v2": "b"}[sent["model"]]
        assert seen.setdefault(session, sent["model"]) == sent["model"]  # sticky
    v2 = sum(m == "v2" for m in seen.values())
    assert 12 <= v2 <= 40  # a quarter of 100 sessions


def test_a_served_name_goes_on_with_its_body_untouched() -> None:
    r = fleet()
    resp = send(r, "plain", chat_body("v2-sql", "s"))
    mutation = resp.request_body.response
    assert not mutation.HasField("body_mutation")


def test_the_front_doors_model_list_is_the_fleets_with_its_aliases() -> None:
    r = fleet()
    s = Stream(r)
    req = headers("/v1/models", "m", eos=True)
    for h in req.request_headers.headers.headers:
        if h.key == ":method":
            h.raw_value = b"GET"
    resp = s.handle(req)
    assert resp is not None and resp.immediate_response.status.code == 200
    listed = {m["id"]: m["parent"] for m in json.loads(resp.immediate_response.body)["data"]}
    assert listed == {"chat": None, "v1": None, "v2": None, "v2-sql": "v2"}


def test_a_fleet_with_no_backend_at_all_answers_503_not_404() -> None:
    """A discovered pool that emptied knows no model: not 'not found', but 'retry'."""
    r, _ = make_router(
        "gorgo",
        backends=[],
        discovery={"kubernetes": {"pool_name": "p"}},
        envoy={"mode": "endpoint_picker"},
    )
    resp = send(r, "e1", chat_body("v1", "s"))
    assert resp.immediate_response.status.code == 503
    err = json.loads(resp.immediate_response.body)["error"]
    assert err["code"] == "service_unavailable" and "no backend" in err["message"]
    headers_set = {h.header.key for h in resp.immediate_response.headers.set_headers}
    assert {"retry-after", "retry-after-ms"} <= headers_set
