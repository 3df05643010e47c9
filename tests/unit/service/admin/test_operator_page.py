"""The operator's page and the JSON it polls: the fleet's rows, the decisions made or
closed since the page's last poll with their candidates' terms, the tuner's path only when
it moved, one decision whole by request id; no prompt text; bad queries answered 400."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from unittest.mock import MagicMock

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ext_proc.core.router import Router
from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.admin.operator_page import FEED_CANDIDATES, prefix_why
from ext_proc.vocab.types import Status
from tests.builders import FakeClock, chat, make_router

BACKENDS = [
    {"id": f"b{i}", "address": f"127.0.0.1:{i + 1}", "region": f"region-{i}"} for i in range(6)
]
SECRET = "the secret prompt text"


@pytest.fixture
def routed() -> tuple[Router, FakeClock]:
    return make_router("gorgo", backends=BACKENDS, tuner={"mode": "paired"})


@pytest.fixture
async def client(routed: tuple[Router, FakeClock]) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_admin_app(routed[0], MagicMock(), dict)
    async with TestClient(TestServer(app)) as c:
        yield c


async def feed(client: TestClient[Any, Any], since: int = 0, steps: str = "") -> Any:
    r = await client.get("/ui/feed", params={"since": since, "steps": steps})
    assert r.status == 200
    return await r.json()


async def test_the_page_and_its_assets_are_served_from_the_package(
    client: TestClient[Any, Any],
) -> None:
    page = await client.get("/ui")
    html = await page.text()
    assert page.status == 200 and page.content_type == "text/html"
    assert '<script src="/ui/page.js">' in html and "/ui/page.css" in html
    assert "http" not in html.replace("http-equiv", "")  # nothing from elsewhere (no CDN)
    js = await client.get("/ui/page.js")
    assert js.content_type == "text/javascript" and "/ui/feed" in await js.text()
    missing = await client.get("/ui/other.js")
    assert missing.status == 404 and "page.js" in await missing.text()


async def test_the_feed_gives_what_changed_since_the_last_poll(
    client: TestClient[Any, Any], routed: tuple[Router, FakeClock]
) -> None:
    router, clock = routed
    router.decide(chat(SECRET, rid="X"))
    first = await feed(client)
    assert [b["id"] for b in first["backends"]] == [b["id"] for b in BACKENDS]
    assert first["backends"][0]["region"] == "region-0"
    assert first["backends"][0]["prefix_why"] == "no KV events configured: the router's own index"
    (x,) = first["decisions"]
    assert x["id"] == "X" and x["backend"] == router.recent.decisions[0].backend
    assert x["observed"] is None and x["of"] == len(BACKENDS)
    # the chosen candidate first, then the best scores; each with its score, its tokens
    # and every cost term the feed names
    names = [t["name"] for t in first["terms"]]
    assert names == ["rtt", "queue", "lora_wait", "prefill", "decode_stall", "kv"]
    assert len(x["candidates"]) == FEED_CANDIDATES and x["candidates"][0][0] == x["backend"]
    d = router.recent.decisions[0]
    chosen = d.chosen
    assert x["candidates"][0][1:] == [
        round(d.scores[chosen.backend_id], 3),
        chosen.cached_tokens,
        chosen.uncached_tokens,
        *(round(chosen.terms[n], 2) for n in names),
    ]
    scores = [c[1] for c in x["candidates"][1:]]
    assert scores == sorted(scores)
    # gorgo's score is the weighted sum of the terms: the page's bars draw them so
    weights = x["term_weights"]
    assert d.weights is not None  # the tuner's arm for X: its weights, not the parent's
    w = d.weights
    assert weights == [round(w.rtt, 4), round(w.queue, 4), round(w.queue, 4), 1.0, 0.3, 1.0]
    for c in x["candidates"]:
        assert sum(w * t for w, t in zip(weights, c[4:], strict=True)) == pytest.approx(
            c[1], abs=0.05
        )
    assert SECRET not in str(first)

    again = await feed(client, first["seq"])
    assert again["decisions"] == []
    clock.advance(0.3)
    router.first_byte("X")
    router.close("X", Status.OK)
    router.decide(chat(rid="Y"))
    later = await feed(client, first["seq"])
    assert [(d["id"], d["n"]) for d in later["decisions"]] == [("X", x["n"]), ("Y", x["n"] + 2)]
    assert later["decisions"][0]["observed"] == {"status": "ok", "ttft_ms": 300.0, "e2e_ms": 300.0}


async def test_one_decision_whole_by_request_id(
    client: TestClient[Any, Any], routed: tuple[Router, FakeClock]
) -> None:
    routed[0].decide(chat(rid="who-went-where"))
    r = await client.get("/ui/decision", params={"request_id": "who-went-where"})
    body = await r.json()
    assert r.status == 200 and len(body["candidates"]) == len(BACKENDS)
    assert {c[0] for c in body["candidates"]} == {b["id"] for b in BACKENDS}
    decode_stall = [t["name"] for t in body["terms"]].index("decode_stall")
    assert body["term_weights"] is not None and body["term_weights"][decode_stall] == 0.3
    unknown = await client.get("/ui/decision", params={"request_id": "nobody"})
    assert unknown.status == 404 and "nobody" in (await unknown.json())["error"]
    assert (await client.get("/ui/decision")).status == 400


async def test_the_tuner_path_is_sent_only_when_it_moved(
    client: TestClient[Any, Any], routed: tuple[Router, FakeClock]
) -> None:
    first = await feed(client)
    tuner = first["tuner"]
    assert tuner["mode"] == "paired" and tuner["frozen"] is False and tuner["steps"] == []
    assert (await feed(client, steps=tuner["steps_key"]))["tuner"]["steps"] is None
    router, clock = routed
    for i in range(5000):  # completions until the tuner ends a round
        router.decide(chat(rid=f"r{i}"))
        clock.advance(0.01 * (1 + i % 7))
        router.first_byte(f"r{i}")
        router.close(f"r{i}", Status.OK)
        if router.tuner is not None and router.tuner.state.history:
            break
    moved = (await feed(client, steps=tuner["steps_key"]))["tuner"]
    (step,) = moved["steps"]
    assert step["samples"] == moved["samples"] and {"parent", "child", "sigma"} <= set(step)
    assert (await feed(client, steps=moved["steps_key"]))["tuner"]["steps"] is None


async def test_bad_queries_name_the_parameter(client: TestClient[Any, Any]) -> None:
    r = await client.get("/ui/feed", params={"since": "-1"})
    assert r.status == 400 and "since" in (await r.json())["error"]


async def test_a_policy_whose_score_is_no_sum_of_the_terms_has_no_term_weights() -> None:
    router, _ = make_router("least_request", backends=BACKENDS)
    router.decide(chat(rid="lr"))
    async with TestClient(TestServer(make_admin_app(router, MagicMock(), dict))) as c:
        (row,) = (await feed(c))["decisions"]
    assert row["term_weights"] is None and row["candidates"][0][1] is not None


def test_why_a_prefix_state_is_what_it_is() -> None:
    kv_up = {"up": True, "unsupported": None}
    assert prefix_why({"prefix_state": "precise", "kv_events": kv_up}) == "the engine's KV events"
    assert "warming" in prefix_why({"prefix_state": "warming", "kv_events": kv_up})
    down = {"prefix_state": "approximate", "kv_events": {"up": False, "unsupported": None}}
    assert prefix_why(down).startswith("KV-event stream down")
    odd = {"prefix_state": "approximate", "kv_events": {"up": True, "unsupported": "no parent"}}
    assert prefix_why(odd) == "KV events unusable: no parent"
    tokens = {**down, "tokens": {"ok": False, "reason": "vocab differs"}}
    assert prefix_why(tokens) == "token ids differ from the engine's: vocab differs"


async def test_the_page_shows_the_gateway_queue_when_flow_control_is_on() -> None:
    from tests.unit.director.test_flow_control import busy, flow_router

    director, _ = flow_router()
    busy(director)
    director.handle(replace(chat(rid="held"), objective="batch", tenant="acme"))
    app = make_admin_app(director.router, MagicMock(), dict, flow=director.admission.snapshot)
    async with TestClient(TestServer(app)) as c:
        q = (await feed(c))["flow"]
    assert q["enabled"] and q["waiting"] == 1 and q["bands"] == {"0": 1}
    assert q["tenants"] == {"acme": 1} and q["oldest_wait_s"] == 0.0
    # off: the page hides the section
    async with TestClient(TestServer(make_admin_app(director.router, MagicMock(), dict))) as c:
        assert (await feed(c))["flow"] == {"enabled": False}


async def test_a_disaggregated_decision_names_its_prefill_engine_and_the_transfer() -> None:
    from tests.unit.core.test_pairs import LONG, pd_router

    router, _ = pd_router()
    d = router.decide(chat(LONG, rid="pd"))
    assert d.prefill is not None
    async with TestClient(TestServer(make_admin_app(router, MagicMock(), dict))) as c:
        body = await (await c.get("/ui/decision", params={"request_id": "pd"})).json()
        shown = (await feed(c))["decisions"][0]["prefill"]
    assert body["prefill"] == shown == d.prefill.as_json()
    assert body["prefill"]["backend"] == "pa" and body["prefill"]["transfer_ms"] > 0
    # an aggregated decision has none
    plain, _ = make_router("gorgo")
    plain.decide(chat(rid="whole"))
    async with TestClient(TestServer(make_admin_app(plain, MagicMock(), dict))) as c:
        assert (await feed(c))["decisions"][0]["prefill"] is None
