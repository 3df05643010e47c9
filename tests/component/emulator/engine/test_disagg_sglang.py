"""SGLang's P/D between two twins over a WAN link on 127.0.0.1, as its mini_lb drives
them: the same body, with bootstrap_host/port/room, to the prefill and the decode at once;
the decode's answer is the client's. One normal stream; the first token after RTT +
bytes / bandwidth; each fault with SGLang's answer, and both twins idle after."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from emulator.engine.disagg.kv import kv_bytes
from tests.component.emulator.engine.pd_harness import (
    PD_PROFILE,
    Pair,
    assert_idle,
    chat,
    pd_pair,
    running_and_waiting,
    with_bootstrap,
)
from tests.component.engine_harness import CHAT, read_sse

PROMPT = 200
SLACK_S = 0.4  # a shared 2-core machine


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, list[tuple[float, dict[str, Any] | str]]]:
    """Status and (arrival, event) of a streamed answer; the events parsed."""
    async with http.post(url + CHAT, json=body) as resp:
        events = await read_sse(resp)
        parsed = [(t, e if e == "[DONE]" else json.loads(e)) for t, e in events]
        return resp.status, parsed


def tokens_of(events: list[tuple[float, Any]]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for _, e in events
        if isinstance(e, dict) and e.get("choices")
    )


def error_of(events: list[tuple[float, Any]]) -> dict[str, Any]:
    errors = [e["error"] for _, e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events
    assert events[-1][1] == "[DONE]"
    return errors[0]


async def route(
    http: aiohttp.ClientSession, pair: Pair, body: dict[str, Any]
) -> tuple[tuple[int, list[Any]], tuple[int, list[Any]], float]:
    """mini_lb: both legs at once; (prefill's, decode's, when the decode leg was sent)."""
    sent = time.perf_counter()
    p, d = await asyncio.gather(
        post_stream(http, pair.prefill.url, body), post_stream(http, pair.decode.url, body)
    )
    return p, d, sent


async def test_a_request_prefilled_on_one_twin_streams_from_the_other(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("sglang") as pair:
        body = with_bootstrap(chat(PROMPT, 8, True, "emulated"), pair.side_port)
        (p_status, p_events), (d_status, d_events), _ = await route(http, pair, body)
        assert (p_status, d_status) == (200, 200)
        # The decode's stream is a normal one: role, 8 tokens, the finish chunk, [DONE].
        assert tokens_of(d_events) == "tok " * 8
        assert d_events[0][1]["choices"][0]["delta"]["role"] == "assistant"
        assert d_events[-2][1]["choices"][0]["finish_reason"] == "length"
        assert d_events[-1][1] == "[DONE]"
        # The prefill's: its one token (max_new_tokens 1), after the KV had left.
        assert tokens_of(p_events) == "tok "
        # Both engines saw one request, and the transfer was observed on the prefill;
        # the decode's /stats names the bootstrap address its KV came from.
        assert pair.prefill.engine.runner.model.disagg.transfers == 1
        async with http.get(pair.decode.url + "/stats") as r:
            received = (await r.json())["kv_received_from"]
        assert received == {f"{body['bootstrap_host']}:{pair.side_port}": 1}
        prompt = pair.prefill.engine.runner.model.stats.prompt_tokens  # the chat's template
        assert PROMPT < prompt == pair.decode.engine.runner.model.stats.prompt_tokens
        for srv in (pair.prefill, pair.decode):
            assert_idle(srv)
            assert await running_and_waiting(http, srv) == (0, 0)
        # Not streamed: the decode's body is the whole answer.
        body = with_bootstrap(chat(PROMPT, 4, False, "emulated", "b"), pair.side_port)
        p_resp, d_resp = await asyncio.gather(
            http.post(pair.prefill.url + CHAT, json=body),
            http.post(pair.decode.url + CHAT, json=body),
        )
        d_body = await d_resp.json()
        assert d_resp.status == p_resp.status == 200
        assert d_body["choices"][0]["message"]["content"] == "tok " * 4
        assert (await p_resp.json())["usage"]["completion_tokens"] == 1
        assert_idle(pair.decode)


async def test_the_first_token_comes_after_rtt_plus_bytes_over_bandwidth(
    http: aiohttp.ClientSession,
) -> None:
    rtt_s, gbps = 0.080, 1.0
    transfer_s = kv_bytes(PROMPT, PD_PROFILE.kv_bytes_per_token) * 8 / (gbps * 1e9)  # 0.21 s
    async with pd_pair("sglang", rtt_ms=rtt_s * 1000, gbps=gbps) as pair:
        body = with_bootstrap(chat(PROMPT, 4, True, "emulated"), pair.side_port)
        _, (status, events), sent = await route(http, pair, body)
        assert status == 200 and tokens_of(events) == "tok " * 4
        first_s = events[0][0] - sent
        # At least the pull's round trip and the bytes on the wire; at most the handshake
        # (a fresh connection: 2 RTT), the pull, the bytes, the completion's round trip.
        assert rtt_s + transfer_s <= first_s < 4 * rtt_s + transfer_s + SLACK_S
        latency_ms = pair.prefill.engine.runner.model.disagg.last_latency_ms
        assert latency_ms >= transfer_s * 1000
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_the_prefill_dying_mid_transfer_fails_the_decode_on_its_heartbeat(
    http: aiohttp.ClientSession,
) -> None:
    # 2.1 s on the wire; the decode probes every 0.1 s and gives up after 2 misses.
    decode = {"heartbeat_interval_s": 0.1, "heartbeat_max_failures": 2, "waiting_timeout_s": 20}
    async with pd_pair("sglang", gbps=0.1, decode=decode) as pair:
        body = with_bootstrap(chat(PROMPT, 4, True, "emulated"), pair.side_port)
        p_leg = asyncio.create_task(post_stream(http, pair.prefill.url, body))
        d_leg = asyncio.create_task(post_stream(http, pair.decode.url, body))
        p_stats = pair.prefill.engine.runner.model.disagg
        async with asyncio.timeout(5):
            while p_stats.prefill_inflight == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the KV is on its way
        killed = time.perf_counter()
        await pair.prefill.stop()
        status, events = await d_leg
        with contextlib.suppress(aiohttp.ClientError):
            await p_leg  # whatever the dying prefill managed to answer, it did not hang
        assert status == 200
        error = error_of(events)
        assert error["code"] == 500 and error["type"] == "INTERNAL_SERVER_ERROR"
        assert error["message"].startswith("Decode transfer failed for request rank=0")
        addr = f"127.0.0.1:{pair.side_port}"
        assert f"Lost connection with prefill instance (bootstrap_addr: {addr})" in error["message"]
        assert time.perf_counter() - killed < 1.5  # the heartbeat's verdict, not 2.1 s
        assert pair.decode.engine.runner.model.disagg.transfer_failed == 1
        assert pair.prefill.engine.stats.in_flight == 0
        assert_idle(pair.decode)
        assert await running_and_waiting(http, pair.decode) == (0, 0)


async def test_a_transfer_past_the_waiting_timeout_fails_both_legs(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("sglang", gbps=0.1, decode={"waiting_timeout_s": 0.5}) as pair:
        body = with_bootstrap(chat(PROMPT, 4, True, "emulated"), pair.side_port)
        (p_status, p_events), (d_status, d_events), sent = await route(http, pair, body)
        assert (p_status, d_status) == (200, 200)
        d_error = error_of(d_events)
        room = body["bootstrap_room"]
        assert d_error["message"].startswith("Decode transfer failed for request rank=0")
        assert (
            f"Request {room} timed out after 0.5s in KVPoll.WaitingForInput" in d_error["message"]
        )
        assert d_events[-1][0] - sent < 2.0  # before the 2.1 s transfer could end
        p_error = error_of(p_events)
        assert p_error["message"].startswith("Prefill transfer failed for request rank=0")
        assert f"KVTransferError(bootstrap_room={room})" in p_error["message"]
        assert pair.prefill.engine.runner.model.disagg.transfer_failed == 1
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_a_decode_without_room_waits_while_the_prefill_gives_up(
    http: aiohttp.ClientSession,
) -> None:
    small = replace(PD_PROFILE, kv_capacity_tokens=1000)
    decode = {"reserved_decode_tokens": 0}
    async with pd_pair(
        "sglang", decode=decode, decode_profile=small, prefill={"bootstrap_timeout_s": 0.3}
    ) as pair:
        # A prompt the decode's pool can never hold: refused at once (decode.py).
        too_long = with_bootstrap(chat(1200, 4, False, "emulated", "big"), pair.side_port)
        async with http.post(pair.decode.url + CHAT, json=too_long) as resp:
            assert resp.status == 400
            message = (await resp.json())["message"]
        assert "exceeds the maximum number of tokens: " in message and message.endswith(" > 1000")
        # The pool taken by a long plain request (~0.8 s of decoding).
        hog = asyncio.create_task(
            http.post(pair.decode.url + CHAT, json=chat(900, 600, False, "emulated", "hog"))
        )
        await asyncio.sleep(0.1)
        body = with_bootstrap(chat(PROMPT, 4, True, "emulated"), pair.side_port)
        legs = asyncio.create_task(route(http, pair, body))
        await asyncio.sleep(0.15)
        async with http.get(pair.decode.url + "/v1/loads?include=disagg") as resp:
            section = (await resp.json())["loads"][0]["disaggregation"]
        assert section["mode"] == "decode" and section["decode_prealloc_queue_reqs"] == 1
        (p_status, p_events), (d_status, d_events), _ = await legs
        assert (p_status, d_status) == (200, 200)
        room = body["bootstrap_room"]
        bootstrap = f"Request {room} timed out after 0.3s in KVPoll.Bootstrapping"
        p_error = error_of(p_events)
        assert p_error["message"].startswith("Prefill bootstrap failed for request rank=0")
        assert bootstrap in p_error["message"]
        d_error = error_of(d_events)
        assert (
            d_error["message"].startswith("Decode transfer failed")
            and bootstrap in d_error["message"]
        )
        await (await hog).read()
        assert pair.prefill.engine.runner.model.disagg.bootstrap_failed == 1
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_an_unknown_bootstrap_room_times_out_on_the_decode(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("sglang", decode={"waiting_timeout_s": 0.4}) as pair:
        body = with_bootstrap(chat(PROMPT, 4, False, "emulated"), pair.side_port, room=42)
        async with http.post(
            pair.decode.url + CHAT, json=body
        ) as resp:  # the prefill never sees it
            assert resp.status == 500
            error = await resp.json()
        assert error["object"] == "error" and error["type"] == "500" and error["code"] == 500
        assert "Request 42 timed out after 0.4s in KVPoll.WaitingForInput" in error["message"]
        # The decode's abort notification left the room's tombstone on the prefill: a
        # late prefill request for it fails at once.
        await asyncio.sleep(0.1)
        late = with_bootstrap(chat(PROMPT, 4, False, "emulated"), pair.side_port, room=42)
        async with http.post(pair.prefill.url + CHAT, json=late) as resp:
            assert resp.status == 500
            message = (await resp.json())["message"]
        assert message.startswith("Prefill bootstrap failed for request rank=0")
        assert message.endswith(
            "KVTransferError(bootstrap_room=42): the decode abandoned the transfer"
        )
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_an_unreachable_bootstrap_server_fails_the_handshake(
    http: aiohttp.ClientSession,
) -> None:
    decode = {"ensure_retries": 3, "ensure_retry_interval_s": 0.05}
    async with pd_pair("sglang", decode=decode) as pair:
        port = pair.side_port
        await pair.link.stop()  # nothing listens where the request points
        body = with_bootstrap(chat(PROMPT, 4, True, "emulated"), port, room=7)
        status, events = await post_stream(http, pair.decode.url, body)
        assert status == 200
        message = error_of(events)["message"]
        assert message.startswith("Decode handshake failed for request rank=0")
        assert "KVTransferError(bootstrap_room=7): Aborted by AbortReq." in message
        assert_idle(pair.decode)


async def test_the_fake_bootstrap_host_moves_no_kv(http: aiohttp.ClientSession) -> None:
    async with pd_pair("sglang") as pair:
        body = {
            **chat(PROMPT, 3, True, "emulated"),
            "bootstrap_host": "2.2.2.2",
            "bootstrap_room": 1,
        }
        status, events = await post_stream(http, pair.decode.url, body)
        assert status == 200 and tokens_of(events) == "tok " * 3
        assert pair.prefill.engine.runner.model.disagg.transfers == 0
        assert_idle(pair.decode)


async def test_the_modes_show_in_server_info_loads_and_metrics(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("sglang") as pair:
        for srv, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
            async with http.get(srv.url + "/server_info") as resp:
                info = await resp.json()
            assert info["disaggregation_mode"] == mode
            assert info["disaggregation_transfer_backend"] == "mooncake"
            async with http.get(srv.url + "/metrics") as resp:
                text = await resp.text()
            assert f'sglang:num_running_reqs{{model_name="emulated",engine_type="{mode}"' in text
            assert "sglang:num_decode_prealloc_queue_reqs{" in text
            assert "sglang:kv_transfer_latency_ms_bucket{" in text
        # The bootstrap server answers as SGLang's does.
        base = f"http://127.0.0.1:{pair.prefill.engine.disagg.side_port}"  # type: ignore[union-attr]
        async with http.get(base + "/health") as resp:
            assert await resp.text() == "OK"
        async with http.get(base + "/route") as resp:
            assert resp.status == 400
        q = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        async with http.get(f"{base}/route?{q}") as resp:
            info = await resp.json()
        assert (info["dp_size"], info["attn_tp_size"], info["follow_bootstrap_room"]) == (
            1,
            1,
            True,
        )
