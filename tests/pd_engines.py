"""Stub engines speaking the minimum of the two P/D protocols (until the twins of
emulator/engine/disagg/ land), each an aiohttp app on its own port that records the
bodies it got:

- SGLang (python/sglang/srt/disaggregation/): the prefill holds its answer until the
  decode of the same `bootstrap_room` has taken the KV; the decode waits (up to
  ROOM_WAIT_S) for a prefill of its room, else answers 500 as a failed transfer, then
  streams; a body without a room it serves whole.
- vLLM NIXL: the prefill wants `kv_transfer_params: {"do_remote_decode": true}`,
  `max_tokens: 1`, no stream, and answers JSON with `kv_transfer_params`; the decode wants
  those params (a known `remote_request_id`), else 500, then streams; a body without them
  it serves whole.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

ROOM_WAIT_S = 3.0
TOKENS = ("Hello", " from", " the", " decode")


@dataclass
class Kv:
    """What the prefill engines handed over: SGLang rooms and vLLM request ids."""

    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    taken: dict[int, asyncio.Event] = field(default_factory=dict)
    remote_ids: set[str] = field(default_factory=set)


@dataclass
class StubEngine:
    """One engine: its protocol, role, the bodies it got, its port once started."""

    engine: str
    role: str
    kv: Kv
    bodies: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    # a prefill that fails: answers this status (0: serves)
    fail_status: int = 0
    # a prefill that never answers in time (seconds it sleeps first)
    stall_s: float = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.fail_status:
            return web.json_response(
                {"error": {"message": "prefill broke"}}, status=self.fail_status
            )
        if self.engine == "sglang":
            return await (self._sglang_prefill if self.role == "prefill" else self._sglang_decode)(
                request, body
            )
        return await (self._vllm_prefill if self.role == "prefill" else self._vllm_decode)(
            request, body
        )

    async def _sglang_prefill(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        room = body.get("bootstrap_room")
        if not isinstance(room, int) or "bootstrap_host" not in body:
            return web.json_response({"error": "no bootstrap fields"}, status=400)
        self.kv.rooms.setdefault(room, asyncio.Event()).set()
        taken = self.kv.taken.setdefault(room, asyncio.Event())
        await asyncio.wait_for(taken.wait(), ROOM_WAIT_S * 2)  # the decode pulls the KV
        return web.json_response({"choices": [{"message": {"content": "Hello"}}]})

    async def _sglang_decode(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        room = body.get("bootstrap_room")
        if room is None:  # served whole, as by an engine that is not disaggregated
            return await _stream(request)
        if not isinstance(room, int):
            return web.json_response({"error": "bootstrap_room not an int"}, status=400)
        arrived = self.kv.rooms.setdefault(room, asyncio.Event())
        try:
            await asyncio.wait_for(arrived.wait(), ROOM_WAIT_S)
        except TimeoutError:
            return web.json_response({"error": "KVTransferError: no prefill"}, status=500)
        self.kv.taken.setdefault(room, asyncio.Event()).set()
        return await _stream(request)

    async def _vllm_prefill(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        ok = (
            body.get("kv_transfer_params") == {"do_remote_decode": True}
            and body.get("max_tokens") == 1
            and body.get("stream") is False
        )
        if not ok:
            return web.json_response({"error": "not a prefill leg"}, status=400)
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.kv.remote_ids.add(rid)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[0, 1]],
            "remote_engine_id": "stub-engine",
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
        return web.json_response({"id": rid, "choices": [], "kv_transfer_params": params})

    async def _vllm_decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        params = body.get("kv_transfer_params")
        if params is None:  # served whole, as by an engine that is not disaggregated
            return await _stream(request)
        if params.get("remote_request_id") not in self.kv.remote_ids:
            return web.json_response({"error": "unknown remote_request_id"}, status=500)
        return await _stream(request)


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for t in TOKENS:
        chunk = {"choices": [{"index": 0, "delta": {"content": t}}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@asynccontextmanager
async def stub_engines(engine: str) -> AsyncIterator[tuple[StubEngine, StubEngine]]:
    """A prefill and a decode stub of `engine` (sglang or vllm), sharing their KV."""
    kv = Kv()
    pair = (StubEngine(engine, "prefill", kv), StubEngine(engine, "decode", kv))
    runners = []
    try:
        for e in pair:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", e.handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            e.port = int(runner.addresses[0][1])
        yield pair
    finally:
        for r in runners:
            await r.cleanup()
