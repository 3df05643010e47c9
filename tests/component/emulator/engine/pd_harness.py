"""Two P/D engine twins on 127.0.0.1 with a WAN link in front of the prefill's side server
(SGLang's bootstrap port, vLLM's NIXL side channel), the bodies a P/D router sends, and the
check that both twins are idle again (nothing in flight, queued, reserved or held)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from emulator.engine.config import EngineConfig
from emulator.engine.disagg.config import DisaggConfig
from emulator.engine.disagg.prebuilt import PrebuiltModel
from emulator.engine.server import EngineServer
from emulator.wan import WanLink
from tests.component.engine_harness import FAST, filler

NIXL_BOTH = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
# Fast twins whose KV is Llama-3.1-8B's (131072 B per token): a 200-token prompt is
# 26.2 MB of KV, 25.6 kB on the wire at the default scale.
PD_PROFILE = replace(FAST, kv_bytes_per_token=131072)
SCALE = 1024.0


@dataclass
class Pair:
    prefill: EngineServer
    decode: EngineServer
    link: WanLink

    @property
    def side_port(self) -> int:
        """The prefill's side server as the decode reaches it: through the link."""
        return self.link.port


@contextlib.asynccontextmanager
async def pd_pair(
    flavor: str,
    *,
    rtt_ms: float = 20.0,
    gbps: float = 0.0,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    profile: Any = PD_PROFILE,
    decode_profile: Any = None,
    decode_kv_transfer_config: str = NIXL_BOTH,
) -> AsyncIterator[Pair]:
    """A prefill twin and a decode twin of `flavor`, the link between them (rtt_ms, gbps,
    byte_scale = the twins' kv_byte_scale). `prefill` / `decode`: DisaggConfig settings."""
    if flavor == "sglang":
        p_cfg = DisaggConfig.sglang("prefill", bootstrap_port=0, **(prefill or {}))
        d_cfg = DisaggConfig.sglang("decode", **(decode or {}))
        model = "emulated"
    else:
        p_cfg = DisaggConfig.vllm(NIXL_BOTH, side_channel_port=0, **(prefill or {}))
        d_cfg = DisaggConfig.vllm(decode_kv_transfer_config, side_channel_port=0, **(decode or {}))
        model = "tiny"
    common: dict[str, Any] = {"flavor": flavor, "model": model, "enable_metrics": True}
    p = EngineServer(EngineConfig("prefill", profile=profile, disagg=p_cfg, **common))
    d_profile = decode_profile or profile
    d = EngineServer(EngineConfig("decode", profile=d_profile, disagg=d_cfg, **common))
    await p.start()
    await d.start()
    assert p.engine.disagg is not None
    link = WanLink(
        "127.0.0.1", 0, "127.0.0.1", p.engine.disagg.side_port, rtt_ms, gbps=gbps, byte_scale=SCALE
    )
    await link.start()
    try:
        yield Pair(p, d, link)
    finally:
        await link.stop()
        await d.stop()
        await p.stop()


def chat(
    tokens: int, max_tokens: int, stream: bool, model: str, salt: str = "pd"
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": filler(tokens, salt)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return body


def with_bootstrap(body: dict[str, Any], port: int, room: int | None = None) -> dict[str, Any]:
    """What SGLang's mini_lb adds (bootstrap_host, _port, a random 63-bit room)."""
    room = random.randint(0, 2**63 - 1) if room is None else room
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


def assert_idle(srv: EngineServer) -> None:
    """Nothing in flight, queued, reserved or held on the twin."""
    engine = srv.engine
    model = engine.runner.model
    assert isinstance(model, PrebuiltModel)
    s = model.disagg
    assert engine.stats.in_flight == 0
    assert (model.num_running, model.num_waiting, model.num_queued) == (0, 0, 0)
    assert (s.prefill_bootstrap, s.prefill_inflight, s.decode_prealloc, s.decode_transfer) == (
        0,
        0,
        0,
        0,
    )
    assert model.reservations == {}
    assert model.held_tokens == 0
    assert engine.disagg is not None
    assert all(e.failed is not None for e in engine.disagg.held.entries.values())


async def running_and_waiting(
    session: aiohttp.ClientSession, srv: EngineServer
) -> tuple[float, float]:
    """(running, waiting) as the twin's /metrics page says, in its flavor's names."""
    names = (
        ("sglang:num_running_reqs", "sglang:num_queue_reqs")
        if srv.cfg.flavor == "sglang"
        else ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )
    async with session.get(srv.url + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values[names[0]], values[names[1]]
