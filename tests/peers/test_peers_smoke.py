"""The rival routers users deploy instead of gorgo (SMG 1.13, vllm-router 0.1.17) in front of
the emulated fleet: each routes streamed chats to it, and reads what the twin serves
(its loads, its server info), as it would read a real SGLang's. `make test-peers`
installs them (.venv-peers) and runs this tier; not in `make test`.

SMG 1.13 writes no cache-trace JSON for HTTP workers (SMG_CACHE_TRACE=1 is set: nothing
comes), so the evidence that it routes on the engines' loads is what it logs and exports:
each expected-wait decision's score (policies/least_load.rs, debug) and its
smg_engine_* gauges of the last poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.server import EngineServer
from emulator.engine.tokenizer import load_twin_tokenizer
from emulator.rivals.fronts import FRONTS, PdWorkers, RivalFront, argv
from emulator.rivals.install import DEFAULT_VENV, is_installed, rival_binary
from emulator.rivals.process import (
    RivalProcess,
    smg_decisions,
    smg_engine_loads,
    smg_load_polls,
    start_rival,
)
from emulator.stack.ports import free_ports
from ext_proc.estimate.profile import load_profile

pytestmark = [
    pytest.mark.peers,
    pytest.mark.skipif(not is_installed(DEFAULT_VENV), reason="rivals not installed: make peers"),
]

MODEL = "alpha"
# SMG's expected-wait unit: a request of unknown length counts p = 1024 tokens
# (--least-load-mean-prefill-tokens default).
MEAN_PREFILL_TOKENS = 1024
SMG_LOADS_QUERY = "/v1/loads?include=core,disagg,queues,memory"
PROFILE = load_profile()
TOPICS = (
    "Alpha Centauri: how far is it?",
    "Baking bread: why does dough rise?",
    "Compilers: what is a basic block?",
)


def engine_cfg(name: str, **profile: Any) -> EngineConfig:
    tokens = load_twin_tokenizer()
    return EngineConfig(
        name=name,
        profile=replace(PROFILE, **profile),
        model=MODEL,
        model_path=tokens.model_dir,
        tokenizer=tokens.tokenizer,
        chat_template=tokens.template,
        enable_metrics=True,
    )


@contextlib.asynccontextmanager
async def fleet(cfgs: Sequence[EngineConfig]) -> AsyncIterator[list[EngineServer]]:
    servers = [EngineServer(c) for c in cfgs]
    try:
        for s in servers:
            await s.start()
        yield servers
    finally:
        for s in servers:
            await s.stop()


@contextlib.asynccontextmanager
async def rival(
    front: RivalFront, servers: Sequence[EngineServer], tmp: Path, **kw: Any
) -> AsyncIterator[RivalProcess]:
    port, metrics_port = free_ports(2)
    p = await start_rival(
        front,
        [s.url for s in servers],
        MODEL,
        port=port,
        metrics_port=metrics_port,
        log_path=tmp / f"{front.name.replace(':', '-')}.log",
        **kw,
    )
    try:
        yield p
    finally:
        await p.stop()


def chat(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream_chat(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, str], int]:
    """(status, headers, content chunks) of one streamed chat; [DONE] must end it."""
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        raw = (await r.read()).decode()
        headers = {k.lower(): v for k, v in r.headers.items()}
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    if r.status == 200:
        assert events[-1] == "[DONE]", raw[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    content = sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
    return r.status, headers, content


async def metrics_of(http: aiohttp.ClientSession, p: RivalProcess) -> str:
    async with http.get(p.metrics_url) as r:
        assert r.status == 200
        return await r.text()


async def twin_load(http: aiohttp.ClientSession, s: EngineServer) -> dict[str, Any]:
    async with http.get(f"{s.url}/v1/loads?include=core") as r:
        (rank,) = (await r.json())["loads"]
        return dict(rank)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def test_every_flag_is_in_the_pinned_tools_help() -> None:
    """Each front's command line parses in the pinned version: every flag it passes is in
    that tool's --help."""
    helps = {
        "smg": subprocess.run(
            [str(rival_binary("smg")), "launch", "--help"], capture_output=True, text=True
        ).stdout,
        "vllm-router": subprocess.run(
            [str(rival_binary("vllm-router")), "--help"], capture_output=True, text=True
        ).stdout,
    }
    pd = PdWorkers((("http://127.0.0.1:4", 5),), ("http://127.0.0.1:6",))
    for f in FRONTS.values():
        workers = {"pd_workers": pd} if f.pd_protocol else {}
        urls = [] if f.pd_protocol else ["http://127.0.0.1:1"]
        cmd = argv(f, urls, MODEL, 2, 3, served_model="x",
                   default_throughput_tok_s=100.0, **workers)  # fmt: skip
        flags = [a for a in cmd if a.startswith("--")]
        assert flags, f.name
        for flag in flags:
            assert flag in helps[f.tool], (f.name, flag)
        assert f.policy in helps[f.tool], f.name


async def test_smg_cache_aware_routes_on_the_engines_loads(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with fleet([engine_cfg(f"e{i}") for i in range(3)]) as servers:
        # Each engine decodes 48 tokens directly first, so each has measured a generation
        # throughput (SGLang's: over 40 decode steps) that SMG's poll can carry.
        await asyncio.gather(
            *(stream_chat(http, s.url, chat(f"warm {s.cfg.name}", 48)) for s in servers)
        )
        tput = {s.url: (await twin_load(http, s))["gen_throughput"] for s in servers}
        assert all(t > 0 for t in tput.values()), tput
        # A 1 s poll instead of the default 10 s, so the test need not wait for one.
        async with rival(
            FRONTS["smg:cache_aware"],
            servers,
            tmp_path,
            extra_args=["--load-monitor-interval", "1"],
        ) as p:
            # SMG holds what each twin reported at its last poll.
            for _ in range(50):
                seen = smg_engine_loads(await metrics_of(http, p))
                if all(
                    seen.get(u, {}).get("gen_throughput") == pytest.approx(t, abs=0.01)
                    for u, t in tput.items()
                ):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"SMG's gauges {seen} never showed the twins' throughput {tput}")
            # three conversations, each twice: a miss, then a hit on the worker chosen
            results = []
            for i in range(6):
                results.append(await stream_chat(http, p.url, chat(TOPICS[i % 3], 4)))
            metrics = await metrics_of(http, p)
        log = p.log_path
        by_url = {s.url: s for s in servers}
    for status, headers, content in results:
        assert status == 200 and content == 4
        worker = headers["x-smg-routed-worker-id"]
        assert worker in by_url
        assert headers["x-engine-id"] == by_url[worker].cfg.name  # the header tells true
    # each conversation's second turn goes where its first went: the prefix-tree hit
    routed = [h["x-smg-routed-worker-id"] for _, h, _ in results]
    assert routed[3:] == routed[:3]
    # Expected-wait decisions are scored in units of p/T, T being the generation throughput
    # the chosen engine reported: SMG's default 2000 tok/s would give multiples of 0.512 s.
    # A first turn on the idle fleet may be scored 0 (nothing ahead of it: seen in about
    # half the runs, on the base commit too); every score is whole units, and some are
    # at least one.
    decisions = smg_decisions(log)
    assert decisions, "no decision in SMG's log"
    for d in decisions:
        units = d.score * tput[d.worker] / MEAN_PREFILL_TOKENS
        assert units == pytest.approx(round(units), abs=0.05), d
    assert max(round(d.score * tput[d.worker] / MEAN_PREFILL_TOKENS) for d in decisions) >= 1
    polls = smg_load_polls(metrics)
    for url, s in by_url.items():
        gets = s.engine.stats.gets
        assert gets[SMG_LOADS_QUERY] >= 1 and polls[url] >= 1  # its load poll
        assert gets["/server_info"] >= 1  # read at registration: max_running_requests...
        assert gets["/v1/models"] >= 1 and gets["/health"] >= 1


async def test_smg_least_load_routes_away_from_a_long_queue(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Engine e0 has one batch slot and three long requests sent to it directly: SMG's own
    in-flight counts are equal everywhere, only e0's report of its queue tells it apart."""
    cfgs = [engine_cfg("e0", max_running_requests=1), engine_cfg("e1"), engine_cfg("e2")]
    async with fleet(cfgs) as servers:
        busy, *others = servers
        hogs = [
            asyncio.create_task(stream_chat(http, busy.url, chat(f"long {i} " * 200, 4000)))
            for i in range(3)
        ]
        try:
            for _ in range(50):
                if (await twin_load(http, busy))["num_waiting_reqs"] >= 2:
                    break
                await asyncio.sleep(0.05)
            queued = await twin_load(http, busy)
            assert queued["num_waiting_reqs"] >= 2 and queued["num_waiting_uncached_tokens"] > 0
            front = FRONTS["smg:least_load"]
            async with rival(front, servers, tmp_path, default_throughput_tok_s=1000.0) as p:
                for _ in range(60):  # its 2 s poll
                    seen = smg_engine_loads(await metrics_of(http, p))
                    if seen.get(busy.url, {}).get("num_waiting_reqs", 0) >= 2:
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail(f"SMG never saw e0's queue: {seen}")
                routed = [
                    (await stream_chat(http, p.url, chat(f"short {i}", 2)))[1] for i in range(6)
                ]
        finally:
            for t in hogs:
                t.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
        workers = [h["x-smg-routed-worker-id"] for h in routed]
        assert busy.url not in workers, workers
        assert set(workers) <= {s.url for s in others}


async def test_vllm_router_cache_aware_routes_to_the_twins(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with fleet([engine_cfg(f"e{i}") for i in range(3)]) as servers:
        async with rival(FRONTS["vllm-router:cache_aware"], servers, tmp_path) as p:
            results = [await stream_chat(http, p.url, chat(TOPICS[i % 3], 4)) for i in range(6)]
        names = {s.cfg.name for s in servers}
        for status, headers, content in results:
            assert status == 200 and content == 4
            assert headers["x-engine-id"] in names
        served = sum(s.engine.stats.requests_by_path["/v1/chat/completions"] for s in servers)
        assert served == 6
        # What 0.1.17 reads of an SGLang worker in regular mode: /health (start-up, then
        # every 60 s); not /get_server_info (its /workers lists model_id "unknown").
        for s in servers:
            assert s.engine.stats.gets["/health"] >= 1
            assert "/get_server_info" not in s.engine.stats.gets
