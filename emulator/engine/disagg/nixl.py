"""vLLM's P/D protocol with the NixlConnector, as vllm/distributed/kv_transfer/
kv_connector/v1/nixl/ runs it; the proxy in front runs the two legs one after the other
(examples/online_serving/disaggregated_serving toy proxy; SMG routers/common/
kv_transfer.rs; vllm-router).

Prefill leg: the request carries `kv_transfer_params: {"do_remote_decode": true}` and
`max_tokens: 1` (the proxy sets both, and stream false). It runs as any request; when it
finishes by length (nixl/scheduler.py request_finished) its blocks are held, not freed,
and the response body carries `kv_transfer_params` (entrypoints/openai chat_completion/
serving.py and completion/serving.py put final_res.kv_transfer_params in the body; a
stream carries none): do_remote_prefill true, do_remote_decode false, remote_block_ids
(per KV cache group, the prompt's blocks), remote_engine_id (--kv-transfer-config's
engine_id), remote_request_id, remote_host and remote_port (VLLM_NIXL_SIDE_CHANNEL_HOST
and _PORT: where the twin's side channel listens; the twin's --kv-advertise instead when
given), tp_size. Held blocks nobody reads go
after VLLM_NIXL_ABORT_REQUEST_TIMEOUT (vllm:nixl_num_kv_expired_reqs).

Decode leg: the original request with those kv_transfer_params. With do_remote_prefill and
every remote_* field (update_state_after_alloc; otherwise a warning, "Got invalid
KVTransferParams", and no transfer: the twin then prefills locally), the decode hands
shakes once per remote engine (nixl/worker.py _nixl_handshake: the metadata within 5 s,
the engine id must match), allocates the prompt's blocks (the request waits in the
waiting queue for room, as WAITING_FOR_REMOTE_KVS), reads the blocks (the pull), then
computes the last prompt token again and decodes (prebuilt.py). A failed handshake or
read fails the request: 500 "Internal server error" (kv_load_failure_policy fail, the
default), or with policy recompute the decode prefills the prompt itself.

The decode dials remote_host:remote_port through its --kv-route for that address, if any
(config.py). Where the twin differs: a read of KV the prefill no longer holds (expired, or
never held) is refused and fails; real NIXL would read whatever the freed blocks then hold.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from aiohttp import web

from emulator.engine.disagg.config import DECODE, PREFILL
from emulator.engine.disagg.held import KvOffer
from emulator.engine.disagg.kv import block_tokens, kv_bytes, wire_bytes
from emulator.engine.disagg.respond import (
    TransferFailed,
    TwinParts,
    answer,
    fail,
    open_stream,
)
from emulator.engine.disagg.sides import (
    NIXL_META_PATH,
    PullBroken,
    PullRefused,
    get_json,
    pull_kv,
    refuse,
    send_kv,
)
from emulator.engine.model.queues import Emission
from emulator.engine.parse import GenRequest

log = logging.getLogger(__name__)

REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
GENERATION_ERROR = "Internal server error"  # entrypoints/openai/engine/serving.py


class NixlPD:
    """vLLM's prefill and decode legs for one twin (module docstring)."""

    def __init__(self, twin: TwinParts) -> None:
        self.twin = twin
        self.d = twin.disagg
        self.handshaken: set[str] = set()  # remote engine ids met (worker _remote_agents)
        self._blocks = itertools.count()  # block ids handed out

    def meta(self) -> dict[str, Any]:
        """The handshake's answer (the agent metadata a NIXL handshake returns)."""
        cfg = self.twin.engine.cfg
        return {"engine_id": self.d.engine_id, "tp_size": 1, "block_size": cfg.profile.block_tokens}

    async def serve(
        self, request: web.Request, req: GenRequest, body: dict[str, Any], rid: str, arrival: float
    ) -> web.StreamResponse | None:
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return None
        if params.get("do_remote_prefill") and self.d.mode in (DECODE, "both"):
            if params.get("remote_block_ids") and all(
                params.get(k) is not None for k in REMOTE_FIELDS
            ):
                return await self.decode(request, req, params, rid, arrival)
            log.warning(
                "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params
            )
            return None
        if params.get("do_remote_decode") and self.d.mode in (PREFILL, "both"):
            return await self.prefill(request, req, rid, arrival)
        return None

    # -- prefill ------------------------------------------------------------------------

    async def prefill(
        self, request: web.Request, req: GenRequest, rid: str, arrival: float
    ) -> web.StreamResponse:
        twin = self.twin
        cfg = twin.engine.cfg
        # The id the decode asks for: the engine's request id, as the response names it.
        request_id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + rid
        block = cfg.profile.block_tokens
        tokens = block_tokens(req.input_tokens, block)
        block_ids = [next(self._blocks) for _ in range(tokens // block)]

        async def hold(last: Emission) -> None:
            """request_finished: keep the blocks for the decode (delay_free_blocks)."""
            engine_bytes = kv_bytes(tokens, cfg.profile.kv_bytes_per_token)
            offer = KvOffer(
                tokens,
                engine_bytes,
                wire_bytes(engine_bytes, self.d.kv_byte_scale),
                last.cached_tokens,
            )
            entry = twin.held.open(request_id)
            key = f"held:{request_id}"
            twin.model.reserve(key, tokens)
            entry.on_drop = lambda: twin.model.release(key)
            if not entry.offer.done():
                entry.offer.set_result(offer)

            def expired() -> None:
                twin.model.disagg.kv_expired += 1
                log.warning("%s: KV of %s expired unread", cfg.name, request_id)

            twin.held.expire_in(request_id, self.d.abort_request_timeout_s, expired)

        host, port = self.d.advertised()

        def patch(body: dict[str, Any]) -> None:
            body["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [block_ids],
                "remote_engine_id": self.d.engine_id,
                "remote_request_id": request_id,
                "remote_host": host,
                "remote_port": port,
                "tp_size": 1,
            }

        channel = twin.runner.submit(rid, req)
        return await answer(
            twin.engine, request, req, rid, channel, arrival, gate=hold, patch=patch
        )

    async def kv_handler(self, request: web.Request) -> web.StreamResponse:
        """A decode reads the blocks; done, they are freed (the read's notification)."""
        request_id = request.match_info["request_id"]
        held = self.twin.held
        entry = held.get(request_id)
        if entry is None or entry.failed is not None or not entry.offer.done():
            return refuse(404, f"no KV held for request {request_id}")
        resp = await send_kv(request, entry.offer.result())
        held.drop(request_id)
        return resp

    # -- decode -------------------------------------------------------------------------

    async def decode(
        self,
        request: web.Request,
        req: GenRequest,
        params: dict[str, Any],
        rid: str,
        arrival: float,
    ) -> web.StreamResponse:
        twin, stats = self.twin, self.twin.model.disagg
        resp = open_stream(twin.engine) if req.stream else None
        if resp is not None:
            await resp.prepare(request)  # vLLM's StreamingResponse: headers at once
        named = f"{params['remote_host']}:{params['remote_port']}"
        base = f"http://{self.d.via(named)}"  # through the route to it, if any
        stage, submitted = "prealloc", False
        stats.decode_prealloc += 1
        try:
            try:
                await self.handshake(base, str(params["remote_engine_id"]))
                await twin.preallocate(rid, req.input_tokens)
                stats.decode_prealloc -= 1
                stats.decode_transfer += 1
                stage = "transfer"
                url = f"{base}/gorgo/nixl/kv/{params['remote_request_id']}"
                pulled = await asyncio.wait_for(
                    pull_kv(twin.session, url), self.d.abort_request_timeout_s
                )
                stats.transferred(pulled.engine_bytes, pulled.seconds)
                stats.received_from[named] += 1
                # The loaded tokens count as computed, hence cached; the last is computed again.
                channel = twin.runner.submit_prebuilt(
                    rid, req, req.input_tokens - 1, first_token_known=False
                )
                submitted = True
            except (PullRefused, PullBroken, TimeoutError) as e:
                stats.transfer_failed += 1
                log.error("NIXL transfer failure for request %s: %r", rid, e)
                if not self.d.recompute_on_failure:
                    return await fail(
                        twin.engine, request, req, rid, TransferFailed(500, GENERATION_ERROR), resp
                    )
                channel = twin.runner.submit(rid, req)  # recompute: a local prefill
        finally:
            if stage == "prealloc":
                stats.decode_prealloc -= 1
            else:
                stats.decode_transfer -= 1
            if not submitted:
                twin.model.release(rid)
        return await answer(twin.engine, request, req, rid, channel, arrival, resp=resp)

    async def handshake(self, base: str, engine_id: str) -> None:
        if engine_id in self.handshaken:
            return
        meta = await get_json(self.twin.session, base + NIXL_META_PATH, self.d.handshake_timeout_s)
        if meta.get("engine_id") != engine_id:
            got = meta.get("engine_id")
            raise PullBroken(
                f"Remote NIXL agent engine ID mismatch. Expected {engine_id},received {got}."
            )
        self.handshaken.add(engine_id)
