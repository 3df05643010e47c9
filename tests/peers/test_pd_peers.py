"""The rival routers in their P/D modes (emulator/rivals/fronts.py PD_FRONTS) in front of
a small P/D fleet (emulator/stack/pd.py: two regions, a prefill and a decode twin each,
the KV links between them), on the twins of the protocol it speaks: SMG with SGLang's
bootstrap fields in both bodies, vllm-router with NIXL's two steps. A few streamed
chats each; every leg lands on its role's twins (each prefill twin's count is prefill legs,
each decode twin's the decodes, and every decode received its KV from a prefill twin)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from emulator.rivals.fronts import FRONTS
from emulator.rivals.install import DEFAULT_VENV, is_installed
from emulator.rivals.process import start_rival
from emulator.stack.pd import PdSettings
from emulator.stack.ports import free_ports
from emulator.stack.stack import Stack
from loadgen.bench.peers.pd import pd_legs, pd_workers
from loadgen.bench.peers.run import REPLAY_MODEL, engine_stats
from tests.e2e.conftest import FAST_REGIONS, fast_settings

pytestmark = [
    pytest.mark.peers,
    pytest.mark.skipif(not is_installed(DEFAULT_VENV), reason="rivals not installed: make peers"),
]
REGIONS = FAST_REGIONS[:2]
CHATS = 4


def pd_stack(protocol: str) -> Stack:
    """Two regions' twins of `protocol`, reached directly (no WAN links in front: the
    routers' own), serving the replay's model name (vLLM's refuse any other)."""
    return Stack(
        fast_settings(
            regions=REGIONS,
            flavor=protocol,
            pd=PdSettings(protocol=protocol),
            wan_links=False,
            engine_models={r.id: REPLAY_MODEL for r in REGIONS},
        )
    )


async def chat(http: aiohttp.ClientSession, url: str, k: int) -> int:
    """One streamed chat; its content chunks ([DONE] must end it)."""
    body = {
        "model": REPLAY_MODEL,
        "messages": [{"role": "user", "content": f"topic {k}: " + "words " * (50 + 40 * k)}],
        "max_tokens": 4,
        "stream": True,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        raw = (await r.read()).decode()
        assert r.status == 200, raw[-300:]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    return sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))


@pytest.mark.parametrize(("name", "protocol"), [("smg:pd", "sglang"), ("vllm-router:pd", "vllm")])
def test_a_pd_rival_sends_each_leg_to_its_roles_twins(
    name: str, protocol: str, tmp_path: Path
) -> None:
    f = FRONTS[name]
    assert protocol in f.pd_protocols
    stack = pd_stack(protocol)
    stack.start(front_door=False)
    try:
        workers = pd_workers(stack)
        assert [p for _, p in workers.prefills] == (
            [stack.settings.pd_layout().kv_link(i, i) for i in range(2)]
            if protocol == "sglang"
            else [None, None]
        )

        async def run() -> list[int]:
            served = stack.config.backends[0].id  # any: the twins serve REPLAY_MODEL
            assert served
            port, metrics_port = free_ports(2)
            rival = await start_rival(
                f, [], REPLAY_MODEL, port=port, metrics_port=metrics_port,
                log_path=tmp_path / "rival.log", pd_workers=workers,
            )  # fmt: skip
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as h:
                    return [await chat(h, rival.url, k) for k in range(CHATS)]
            finally:
                await rival.stop()

        assert asyncio.run(run()) == [4] * CHATS
        legs = pd_legs(stack, engine_stats(stack))
    finally:
        stack.stop()
    # every request had one prefill leg on a prefill twin and its decode on a decode twin,
    # which received the KV from a prefill twin (none served whole)
    assert sum(legs["prefill"].values()) == CHATS, legs
    assert sum(legs["decode"].values()) == CHATS, legs
    assert (legs["paired"], legs["whole"]) == (CHATS, 0), legs
    regions = {r.id for r in REGIONS}
    for pair in legs["pairs"]:
        a, b = pair.split("->")
        assert {a, b} <= regions, legs
