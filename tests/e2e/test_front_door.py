"""Requests through a real Envoy front door, routed by the real ext_proc service."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import chat_body
from tests.e2e.conftest import FAST_REGIONS, start_stack
from tests.e2e.stack_harness import admin_call, chats, engine_counts, router_state, wait_for

pytestmark = pytest.mark.e2e

IDS = [r.id for r in FAST_REGIONS]


def test_requests_go_where_the_policy_chose(stack: Stack) -> None:
    before = engine_counts(stack)
    decisions_before = router_state(stack)["decisions"]
    results = asyncio.run(chats(stack.front_door_url, [chat_body("hi " * 50, 5)] * 6))
    assert all(r.ok for r in results), [r.error for r in results]
    # round robin over three backends: each served two, and the header names the server
    seen = [r.backend for r in results]
    assert sorted(seen) == sorted(IDS * 2)
    after = engine_counts(stack)
    assert {b: after[b] - before[b] for b in IDS} == {b: 2 for b in IDS}
    state = router_state(stack)
    assert state["decisions"] - decisions_before == 6
    # completion learned from the access log: nothing stays in flight
    wait_for(lambda: router_state(stack)["in_flight"] == 0)
    # the observer timed every first token; the access log gave every E2E
    for b in IDS:
        s = router_state(stack)["backends"][b]
        assert len(s["last_ttft_ms"]) >= 2 and len(s["last_e2e_ms"]) >= 2
        # each request's TTFT is at most its E2E, so sorted they pair up too (completions
        # can be recorded in another order than first bytes: see COMPLETION_GRACE_S)
        pairs = zip(sorted(s["last_ttft_ms"]), sorted(s["last_e2e_ms"]), strict=False)
        assert all(0 < t <= e for t, e in pairs), (b, s["last_ttft_ms"], s["last_e2e_ms"])


def test_streamed_responses_arrive_whole(stack: Stack) -> None:
    (r,) = asyncio.run(chats(stack.front_door_url, [chat_body("hello", 40)]))
    assert r.ok and r.output_tokens == 40 and len(r.itl_ms) == 39
    assert r.ttft_ms is not None and r.e2e_ms is not None and r.e2e_ms > r.ttft_ms


def test_client_sent_routing_headers_have_no_effect(stack: Stack) -> None:
    forged = {"x-gorgo-backend": "ap-seoul", "x-gateway-destination-endpoint": "127.0.0.1:1"}
    results = asyncio.run(chats(stack.front_door_url, [chat_body("x", 2)] * 6, forged))
    assert all(r.ok for r in results)
    assert sorted(r.backend for r in results) == sorted(IDS * 2)


def test_prompt_over_one_mib_is_routed(stack: Stack) -> None:
    """Through Envoy's buffer (16 MiB) to the policy. The router counts it approximately
    (no engine tokenizer here: ~300k tokens, which may fit the engines' 262,144-token
    context), so it routes it; the engine counts 921,614 and answers its own 400."""
    decisions = router_state(stack)["decisions"]
    big = "abc " * (300 * 1024)  # 1.2 MiB
    (r,) = asyncio.run(chats(stack.front_door_url, [chat_body(big, 3)]))
    assert r.backend in IDS
    assert router_state(stack)["decisions"] == decisions + 1
    assert r.status == 400 and "longer than the model's context length" in r.error


def test_unreadable_body_is_answered_by_a_backend_via_the_fallback(stack: Stack) -> None:
    req = urllib.request.Request(
        f"{stack.front_door_url}/v1/chat/completions",
        data=b'{"messages": [oops',
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert e.value.headers["x-gorgo-backend"] in IDS  # echoed even on the fallback route
    assert "invalid" in e.value.read().decode().lower()
    wait_for(
        lambda: sum(b["fallback_completed"] for b in router_state(stack)["backends"].values()) >= 1
    )


def test_the_stacks_admin_takes_changes_with_the_token_its_ready_line_prints(
    stack: Stack,
) -> None:
    """`gorgo up` generates an admin token and hands it to its router (issue 39, point 3):
    a change without it is refused, even JSON from loopback; a page's text/plain post too;
    with it the change reaches its handler. A foreign Host reads nothing."""
    line = stack.ready_line()
    token = stack.admin_token
    assert f"{stack.admin_url}/state (changes: Authorization: Bearer {token})" in line
    freeze = json.dumps({"action": "freeze"}).encode()
    for headers in (
        {"Content-Type": "application/json"},
        {"Content-Type": "text/plain", "Origin": "http://attacker.example"},
        {"Content-Type": "application/json", "Authorization": "Bearer not-it"},
    ):
        req = urllib.request.Request(f"{stack.admin_url}/tuner", freeze, headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401, headers
    # with the token: through to the handler (round_robin has no tuner to freeze: 409)
    status, body = admin_call(stack, "POST", "/tuner", {"action": "freeze"})
    assert status == 409 and "no tuner" in body["error"]
    status, body = admin_call(stack, "POST", "/backends", {"id": "x"})
    assert status == 400 and "address" in body["error"]  # the guard let it through
    rebound = urllib.request.Request(f"{stack.admin_url}/state", headers={"Host": "evil.test"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(rebound, timeout=5)
    assert e.value.code == 421


@pytest.mark.long  # `make test-long`
def test_router_killed_requests_still_succeed_then_routing_resumes() -> None:
    stack = start_stack()
    try:
        stack.kill("gorgo-serve")
        results = asyncio.run(chats(stack.front_door_url, [chat_body("x", 3)] * 5))
        assert all(r.ok for r in results), [r.error for r in results]
        assert all(r.backend in IDS for r in results)  # fallback route served them
        stack.start_router()
        stack.wait_router_ready()
        results = asyncio.run(chats(stack.front_door_url, [chat_body("x", 3)] * 3))
        assert all(r.ok for r in results)
        state = router_state(stack)
        assert state["decisions"] == 3  # the new process routed every one of them
        wait_for(lambda: sum(b["completed"] for b in router_state(stack)["backends"].values()) == 3)
    finally:
        stack.stop()
