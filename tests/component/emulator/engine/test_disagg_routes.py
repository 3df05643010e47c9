"""P/D twins placed on an emulated WAN as `gorgo up --pd` places them: the prefill names an
address of its choosing (--kv-advertise) and the decode dials it through its route
(--kv-route ADDR=VIA), a link. The advertised address here is a port nothing listens on,
so the transfer succeeds only through the route, and takes the link's round trips."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.disagg.config import DisaggConfig
from emulator.engine.server import EngineServer
from emulator.stack.ports import free_ports
from emulator.wan import WanLink
from tests.component.emulator.engine.pd_harness import (
    NIXL_BOTH,
    PD_PROFILE,
    SCALE,
    assert_idle,
    chat,
)
from tests.component.engine_harness import CHAT, read_sse

pytestmark = pytest.mark.component

RTT_S = 0.060


@contextlib.asynccontextmanager
async def routed_pair(flavor: str) -> AsyncIterator[tuple[EngineServer, EngineServer, str]]:
    """A prefill advertising 127.0.0.1:N (N unbound), a link to its side server, and a
    decode routing 127.0.0.1:N through the link; yields (prefill, decode, the name)."""
    named = f"127.0.0.1:{free_ports(1)[0]}"
    if flavor == "sglang":
        p_cfg = DisaggConfig.sglang("prefill", bootstrap_port=0, advertise=named)
        model = "emulated"
    else:
        p_cfg = DisaggConfig.vllm(NIXL_BOTH, side_channel_port=0, advertise=named)
        model = "tiny"
    common: dict[str, Any] = {"flavor": flavor, "model": model, "profile": PD_PROFILE}
    prefill = EngineServer(EngineConfig("prefill", disagg=p_cfg, **common))
    await prefill.start()
    assert prefill.engine.disagg is not None
    side = prefill.engine.disagg.side_port
    link = WanLink("127.0.0.1", 0, "127.0.0.1", side, RTT_S * 1000, byte_scale=SCALE)
    await link.start()
    routes = {named: f"127.0.0.1:{link.port}"}
    if flavor == "sglang":
        d_cfg = DisaggConfig.sglang("decode", routes=routes)
    else:
        d_cfg = DisaggConfig.vllm(NIXL_BOTH, side_channel_port=0, routes=routes)
    decode = EngineServer(EngineConfig("decode", disagg=d_cfg, **common))
    await decode.start()
    try:
        yield prefill, decode, named
    finally:
        await decode.stop()
        await link.stop()
        await prefill.stop()


async def first_token_s(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the decode's first token; the stream must end normally."""
    sent = time.perf_counter()
    async with http.post(url + CHAT, json=body) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    assert events[-1][1] == "[DONE]"
    firsts = [t for t, e in events if e != "[DONE]" and json.loads(e).get("choices")]
    return firsts[0] - sent


async def test_sglang_the_decode_dials_the_bootstrap_address_through_its_route() -> None:
    async with (
        aiohttp.ClientSession() as http,
        routed_pair("sglang") as (prefill, decode, named),
    ):
        host, port = named.rsplit(":", 1)
        body = {
            **chat(200, 4, True, "emulated"),
            "bootstrap_host": host,
            "bootstrap_port": int(port),
            "bootstrap_room": 7,
        }

        async def prefill_leg() -> int:
            async with http.post(prefill.url + CHAT, json=body) as resp:
                await resp.read()
                return resp.status

        # mini_lb: both at once; the handshake (/route) and the KV: 2 RTTs at least
        p_status, ttft_s = await asyncio.gather(
            prefill_leg(), first_token_s(http, decode.url, body)
        )
        assert p_status == 200 and ttft_s >= 2 * RTT_S
        # The bootstrap server names the advertised address as its rank's.
        side = prefill.engine.disagg.side_port  # type: ignore[union-attr]
        q = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        async with http.get(f"http://127.0.0.1:{side}/route?{q}") as resp:
            assert await resp.json() == {"rank_ip": host, "rank_port": int(port)}
        assert decode.engine.runner.model.disagg.decode_transfer == 0
        assert prefill.engine.runner.model.disagg.transfers == 1
        assert_idle(decode)


async def test_vllm_the_prefill_names_its_advertised_address_and_the_decode_routes_it() -> None:
    async with (
        aiohttp.ClientSession() as http,
        routed_pair("vllm") as (prefill, decode, named),
    ):
        body = chat(200, 4, True, "tiny")
        leg = {**body, "max_tokens": 1, "stream": False}
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        async with http.post(prefill.url + CHAT, json=leg) as resp:
            params = (await resp.json())["kv_transfer_params"]
        assert f"{params['remote_host']}:{params['remote_port']}" == named
        # handshake and read, each a round trip over the link
        decode_body = {**body, "kv_transfer_params": params}
        assert await first_token_s(http, decode.url, decode_body) >= 2 * RTT_S
        assert decode.engine.runner.model.disagg.transfers == 1
        assert_idle(decode)
        assert_idle(prefill)
