"""vLLM's P/D (NixlConnector) between two twins over a WAN link on 127.0.0.1, as its
proxies drive them: the prefill leg (kv_transfer_params {"do_remote_decode": true},
max_tokens 1, not streamed), then the decode leg with the kv_transfer_params the prefill
answered. One normal stream; the first token after RTT + bytes / bandwidth; each fault
with vLLM's answer, and both twins idle after."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from emulator.engine.disagg.kv import block_tokens, kv_bytes
from tests.component.emulator.engine.pd_harness import (
    PD_PROFILE,
    Pair,
    assert_idle,
    chat,
    pd_pair,
    running_and_waiting,
)
from tests.component.engine_harness import CHAT, read_sse

PROMPT = 200
SLACK_S = 0.4


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def prefill_leg(
    http: aiohttp.ClientSession, pair: Pair, body: dict[str, Any]
) -> dict[str, Any]:
    """The proxy's first leg; the kv_transfer_params it answered, pointed at the link."""
    leg = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    async with http.post(pair.prefill.url + CHAT, json=leg) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    return {**params, "remote_host": "127.0.0.1", "remote_port": pair.side_port}


async def decode_leg(
    http: aiohttp.ClientSession, pair: Pair, body: dict[str, Any], params: dict[str, Any]
) -> tuple[int, list[tuple[float, Any]], float]:
    sent = time.perf_counter()
    async with http.post(
        pair.decode.url + CHAT, json={**body, "kv_transfer_params": params}
    ) as resp:
        events = await read_sse(resp)
        parsed = [(t, e if e == "[DONE]" else json.loads(e)) for t, e in events]
        return resp.status, parsed, sent


def tokens_of(events: list[tuple[float, Any]]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for _, e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def test_a_request_prefilled_on_one_twin_streams_from_the_other(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("vllm") as pair:
        body = chat(PROMPT, 8, True, "tiny")
        params = await prefill_leg(http, pair, body)
        # What vLLM's NIXL connector answers (nixl/scheduler.py request_finished).
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == pair.prefill.cfg.disagg.engine_id  # type: ignore[union-attr]
        assert params["remote_request_id"].startswith("chatcmpl-")
        assert params["tp_size"] == 1
        prompt = pair.prefill.engine.runner.model.stats.prompt_tokens
        assert len(params["remote_block_ids"][0]) == -(-prompt // PD_PROFILE.block_tokens)
        # The prefill holds the blocks until they are read.
        assert pair.prefill.engine.runner.model.held_tokens > 0
        status, events, _ = await decode_leg(http, pair, body, params)
        assert status == 200
        assert events[0][1]["choices"][0]["delta"]["role"] == "assistant"
        assert tokens_of(events) == "tok " * 8
        assert events[-1][1] == "[DONE]"
        # The read freed the prefill's blocks; the decode observed the transfer, and its
        # /stats names the side-channel address the KV came from.
        assert pair.decode.engine.runner.model.disagg.transfers == 1
        async with http.get(pair.decode.url + "/stats") as r:
            assert (await r.json())["kv_received_from"] == {f"127.0.0.1:{pair.side_port}": 1}
        for srv in (pair.prefill, pair.decode):
            assert_idle(srv)
            assert await running_and_waiting(http, srv) == (0, 0)


async def test_the_first_token_comes_after_rtt_plus_bytes_over_bandwidth(
    http: aiohttp.ClientSession,
) -> None:
    rtt_s, gbps = 0.080, 1.0
    async with pd_pair("vllm", rtt_ms=rtt_s * 1000, gbps=gbps) as pair:
        body = chat(PROMPT, 4, True, "tiny")
        params = await prefill_leg(http, pair, body)
        prompt = pair.prefill.engine.runner.model.stats.prompt_tokens
        whole_blocks = block_tokens(prompt, PD_PROFILE.block_tokens)  # vLLM moves blocks
        transfer_s = kv_bytes(whole_blocks, PD_PROFILE.kv_bytes_per_token) * 8 / (gbps * 1e9)
        status, events, sent = await decode_leg(http, pair, body, params)
        assert status == 200 and tokens_of(events) == "tok " * 4
        first_s = events[0][0] - sent
        # At least the read's round trip and the bytes; at most the handshake too (a
        # fresh connection: 2 RTT).
        assert rtt_s + transfer_s <= first_s < 3 * rtt_s + transfer_s + SLACK_S
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_the_prefill_dying_mid_transfer_fails_the_decode_at_once(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("vllm", gbps=0.1) as pair:  # ~2.6 s on the wire
        body = chat(PROMPT, 4, True, "tiny")
        params = await prefill_leg(http, pair, body)
        leg = asyncio.create_task(decode_leg(http, pair, body, params))
        d_stats = pair.decode.engine.runner.model.disagg
        async with asyncio.timeout(5):
            while d_stats.decode_transfer == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        killed = time.perf_counter()
        await pair.prefill.stop()
        status, events, _ = await leg
        assert status == 200  # vLLM's headers left at once; the error is in the stream
        errors = [e["error"] for _, e in events if isinstance(e, dict) and "error" in e]
        assert errors == [
            {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        ]
        assert events[-1][1] == "[DONE]"
        assert time.perf_counter() - killed < 1.0  # the read fails as the connection does
        assert d_stats.transfer_failed == 1
        assert_idle(pair.decode)
        metrics = await (await http.get(pair.decode.url + "/metrics")).text()
        assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 1' in metrics


async def test_kv_unread_past_the_abort_timeout_is_freed_and_the_decode_fails(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("vllm", prefill={"abort_request_timeout_s": 0.2}) as pair:
        body = chat(PROMPT, 4, False, "tiny")
        params = await prefill_leg(http, pair, body)
        await asyncio.sleep(0.4)  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT passes
        assert pair.prefill.engine.runner.model.disagg.kv_expired == 1
        assert_idle(pair.prefill)
        async with http.post(
            pair.decode.url + CHAT, json={**body, "kv_transfer_params": params}
        ) as resp:
            assert resp.status == 500
            assert await resp.json() == {
                "error": {
                    "message": "Internal server error",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        assert_idle(pair.decode)
        metrics = await (await http.get(pair.prefill.url + "/metrics")).text()
        assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny"} 1' in metrics


async def test_with_the_recompute_policy_a_failed_load_is_prefilled_locally(
    http: aiohttp.ClientSession,
) -> None:
    kvc = (
        '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'
    )
    async with pd_pair("vllm", decode_kv_transfer_config=kvc) as pair:
        body = chat(PROMPT, 4, False, "tiny")
        params = {
            **(await prefill_leg(http, pair, body)),
            "remote_request_id": "chatcmpl-nobody-holds-this",
        }
        async with http.post(
            pair.decode.url + CHAT, json={**body, "kv_transfer_params": params}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "tok " * 4
        assert pair.decode.engine.runner.model.stats.prefill_steps >= 1  # computed here
        assert_idle(pair.decode)


async def test_a_decode_without_room_keeps_the_request_waiting_until_room_frees(
    http: aiohttp.ClientSession,
) -> None:
    small = replace(PD_PROFILE, kv_capacity_tokens=1000)
    async with pd_pair("vllm", decode_profile=small) as pair:
        hog = asyncio.create_task(
            http.post(pair.decode.url + CHAT, json=chat(900, 600, False, "tiny", "hog"))
        )
        await asyncio.sleep(0.1)
        body = chat(PROMPT, 4, True, "tiny")
        params = await prefill_leg(http, pair, body)
        leg = asyncio.create_task(decode_leg(http, pair, body, params))
        await asyncio.sleep(0.15)
        # Waiting for blocks, as WAITING_FOR_REMOTE_KVS in vLLM's waiting queue.
        running, waiting = await running_and_waiting(http, pair.decode)
        assert (running, waiting) == (1, 1)
        status, events, _ = await leg
        assert status == 200 and tokens_of(events) == "tok " * 4
        assert hog.done()  # it went first: the room was its
        await (await hog).read()
        assert_idle(pair.prefill)
        assert_idle(pair.decode)


async def test_an_unknown_remote_request_fails_the_decode(http: aiohttp.ClientSession) -> None:
    async with pd_pair("vllm") as pair:
        body = chat(PROMPT, 4, True, "tiny")
        params = {
            **(await prefill_leg(http, pair, body)),
            "remote_request_id": "chatcmpl-nobody-holds-this",
        }
        status, events, _ = await decode_leg(http, pair, body, params)
        assert status == 200
        assert [e["error"]["message"] for _, e in events if isinstance(e, dict)] == [
            "Internal server error"
        ]
        # The real request's blocks stay held until read or expired.
        assert len(pair.prefill.engine.disagg.held) == 1  # type: ignore[union-attr]
        assert_idle(pair.decode)


async def test_params_without_the_remote_fields_are_served_without_a_transfer(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("vllm") as pair:
        body = {**chat(PROMPT, 3, False, "tiny"), "kv_transfer_params": {"do_remote_prefill": True}}
        async with http.post(pair.decode.url + CHAT, json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "tok " * 3
        assert pair.decode.engine.runner.model.disagg.transfers == 0
        assert_idle(pair.decode)


async def test_the_role_shows_in_server_info_and_the_nixl_metrics(
    http: aiohttp.ClientSession,
) -> None:
    async with pd_pair("vllm") as pair:
        async with http.get(pair.decode.url + "/server_info") as resp:
            info = await resp.json()
        assert info["disaggregation_mode"] == "both"
        assert info["kv_transfer_config"]["kv_connector"] == "NixlConnector"
        assert info["kv_transfer_config"]["kv_load_failure_policy"] == "fail"
        metrics = await (await http.get(pair.decode.url + "/metrics")).text()
        for name in ("vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_count"):
            assert name + "{" in metrics
        base = f"http://127.0.0.1:{pair.prefill.engine.disagg.side_port}"  # type: ignore[union-attr]
        async with http.get(base + "/gorgo/nixl/meta") as resp:
            assert (await resp.json())["engine_id"] == pair.prefill.cfg.disagg.engine_id  # type: ignore[union-attr]
