"""The side servers a P/D twin runs beside its HTTP port, and their client.

SGLang's bootstrap server (disaggregation/common/conn.py CommonKVBootstrapServer, on
--disaggregation-bootstrap-port, prefill only): `GET /health` -> "OK"; `PUT /route` (a
prefill rank registers: the twin's one rank is there from the start); `GET /route` with
prefill_dp_rank, prefill_cp_rank, target_tp_rank and target_pp_rank (400 "Missing inputs
for bootstrap server." without them): all -1 -> the prefill's parallel info
(PrefillServerInfo: attn_tp_size, attn_cp_size, dp_size, pp_size, page_size,
kv_cache_dtype, follow_bootstrap_room, ...), else that rank's {rank_ip, rank_port} (404
for a rank it lacks); `POST /register_dp_rank` {bootstrap_room, dp_rank} and
`POST /query_dp_ranks` {bootstrap_rooms} -> {room: dp_rank}.

vLLM's NIXL side channel (nixl/scheduler.py _nixl_handshake_listener, a ZMQ ROUTER on
VLLM_NIXL_SIDE_CHANNEL_PORT answering GET_META_MSG with the agent's metadata): the twin
serves it as HTTP, `GET /gorgo/nixl/meta` -> {engine_id, tp_size, block_size}.

The data plane is the twin's own (the engines write KV with RDMA: Mooncake's transfer
engine, NIXL over UCX), on the same port, so a link placed in front of that port carries
the KV: SGLang `GET /gorgo/kv?room=R` (the decode's KV indices for the room; the answer is
the KV once the prefill has it; `POST /gorgo/kv/done?room=R` tells the prefill it
arrived, as Mooncake's status message does, and only then does the prefill answer;
`POST /gorgo/kv/abort?room=R` is the decode's abort notification), vLLM
`GET /gorgo/nixl/kv/<remote_request_id>` (the read; done, it frees the prefill's blocks as
NIXL's notification does). A KV answer carries
Content-Length (its wire bytes) and x-gorgo-engine-bytes and x-gorgo-cached-tokens
headers; a refusal is a JSON {"error": reason} with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from emulator.engine.disagg.held import KvOffer
from emulator.engine.disagg.kv import chunks

log = logging.getLogger(__name__)

ENGINE_BYTES_HEADER = "x-gorgo-engine-bytes"
CACHED_TOKENS_HEADER = "x-gorgo-cached-tokens"
KV_PATH = "/gorgo/kv"
KV_DONE_PATH = "/gorgo/kv/done"
KV_ABORT_PATH = "/gorgo/kv/abort"
NIXL_META_PATH = "/gorgo/nixl/meta"
NIXL_KV_PATH = "/gorgo/nixl/kv/{request_id}"
ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class SideServer:
    """An aiohttp application on host:port of its own (port 0: a free one). A client that
    goes away cancels its handler (a decode that gives up ends its pull)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self._port = app, host, port
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("side server is not started")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    async def stop(self) -> None:
        """Stop, cutting every connection with a reset: a transfer dies with its engine
        (RDMA queue pairs do) and bytes not yet sent are dropped, not flushed as a plain
        close would flush them."""
        runner, self._runner = self._runner, None
        if runner is not None:
            for handler in runner.server.connections if runner.server is not None else ():
                transport = handler.transport
                if transport is not None:
                    sock = transport.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    transport.abort()
            await runner.cleanup()


def refuse(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


async def send_kv(request: web.Request, offer: KvOffer) -> web.StreamResponse:
    """The KV's wire bytes, in chunks; raises if the puller goes away before the end."""
    resp = web.StreamResponse(
        headers={
            ENGINE_BYTES_HEADER: str(offer.engine_bytes),
            CACHED_TOKENS_HEADER: str(offer.cached_tokens),
            "Content-Type": "application/octet-stream",
        }
    )
    resp.content_length = offer.wire_bytes
    await resp.prepare(request)
    for piece in chunks(offer.wire_bytes):
        await resp.write(piece)
    await resp.write_eof()
    return resp


def bootstrap_app(
    host: str,
    page_size: int,
    kv_handler: Any,
    done_handler: Any,
    abort_handler: Any,
    advertised_port: int = 0,
) -> web.Application:
    """SGLang's bootstrap server (module docstring), with the twin's KV routes; its rank
    is at `host` and `advertised_port` (0: the port a request came in on)."""
    rooms: dict[int, int] = {}
    rank = {"rank_ip": host, "rank_port": advertised_port}

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def route(request: web.Request) -> web.Response:
        if request.method == "PUT":
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405)
        values = [request.query.get(key) for key in ROUTE_QUERY]
        if not all(values):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        try:
            dp, cp, tp, pp = (int(v or "") for v in values)
        except ValueError:
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            return web.json_response(
                {
                    "attn_tp_size": 1,
                    "attn_cp_size": 1,
                    "dp_size": 1,
                    "pp_size": 1,
                    "page_size": page_size,
                    "kv_cache_dtype": "auto",
                    "follow_bootstrap_room": True,
                    "enable_dsa_cache_layer_split": False,
                    "prefill_http_port": None,
                    "target_tp_rank": None,
                    "target_tp_ranks": None,
                    "target_cp_ranks": None,
                    "target_pp_ranks": None,
                    "required_dst_info_num": None,
                    "required_prefill_response_num": None,
                }
            )
        if (dp, cp, tp, pp) != (0, 0, 0, 0):
            return web.Response(
                text=f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                f"pp_rank={pp}",
                status=404,
            )
        # The twin's one rank answers on this very port (module docstring).
        if not advertised_port:
            rank["rank_port"] = int(request.transport.get_extra_info("sockname")[1])  # type: ignore[union-attr]
        return web.json_response(rank)

    async def register_dp_rank(request: web.Request) -> web.Response:
        data = await request.json()
        rooms[int(data["bootstrap_room"])] = int(data["dp_rank"])
        return web.Response(text="OK")

    async def query_dp_ranks(request: web.Request) -> web.Response:
        data = await request.json()
        found = {str(int(r)): rooms[int(r)] for r in data["bootstrap_rooms"] if int(r) in rooms}
        return web.json_response(found)

    app = web.Application()
    app.router.add_route("*", "/route", route)
    app.router.add_post("/register_dp_rank", register_dp_rank)
    app.router.add_post("/query_dp_ranks", query_dp_ranks)
    app.router.add_get("/health", health)
    app.router.add_get(KV_PATH, kv_handler)
    app.router.add_post(KV_DONE_PATH, done_handler)
    app.router.add_post(KV_ABORT_PATH, abort_handler)
    return app


def side_channel_app(meta: dict[str, Any], kv_handler: Any) -> web.Application:
    """vLLM's NIXL side channel (module docstring), `kv_handler` serving NIXL_KV_PATH."""

    async def get_meta(request: web.Request) -> web.Response:
        return web.json_response(meta)

    app = web.Application()
    app.router.add_get(NIXL_META_PATH, get_meta)
    app.router.add_get(NIXL_KV_PATH, kv_handler)
    return app


# -- the client ------------------------------------------------------------------------


class PullRefused(Exception):
    """The other side answered, with an error: `status` and its `reason`."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


class PullBroken(Exception):
    """The connection failed or ended before the last byte."""


@dataclass(frozen=True)
class Pulled:
    """A transfer received: wire and engine bytes, the prefill's cached tokens, seconds."""

    wire_bytes: int
    engine_bytes: int
    cached_tokens: int
    seconds: float


async def get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    """A JSON answer; PullRefused for an error status, PullBroken if unreachable."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status >= 400:
                raise PullRefused(resp.status, await resp.text())
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise PullBroken(repr(e)) from e


async def pull_kv(session: aiohttp.ClientSession, url: str) -> Pulled:
    """Read a KV answer to its end (no timeout of its own: the caller bounds it)."""
    start = time.perf_counter()
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=None)) as resp:
            if resp.status >= 400:
                try:
                    reason = str((await resp.json(content_type=None))["error"])
                except (ValueError, KeyError, TypeError):
                    reason = await resp.text()
                raise PullRefused(resp.status, reason)
            got = 0
            async for piece in resp.content.iter_chunked(1 << 20):
                got += len(piece)
            expected = resp.content_length
            if expected is not None and got < expected:
                raise PullBroken(f"{got} of {expected} bytes")
            return Pulled(
                got,
                int(resp.headers.get(ENGINE_BYTES_HEADER, "0")),
                int(resp.headers.get(CACHED_TOKENS_HEADER, "0")),
                time.perf_counter() - start,
            )
    except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError) as e:
        raise PullBroken(repr(e)) from e
