"""SGLang's P/D protocol, as python/sglang/srt/disaggregation/ runs it.

The balancer (mini_lb.py) adds `bootstrap_host` (the prefill's host), `bootstrap_port`
(its --disaggregation-bootstrap-port) and `bootstrap_room` (a random 63-bit int) to the
body and sends the very same request to the prefill and the decode server at once; it
streams the decode's answer (the prefill's it reads and drops).

Prefill (prefill.py): the request waits in the bootstrap queue until its decode has
bootstrapped and sent the KV indices for the room, then is prefilled with max_new_tokens
1; its KV and first token go to the decode, and only then does the prefill answer: its
one-token response (FINISH_LENGTH), or 500 "Prefill bootstrap failed ..." when no decode
came within SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, "Prefill transfer failed ..." when
the transfer failed.

Decode (decode.py): a prompt longer than the KV pool is refused at once (400 "Request ...
exceeds the maximum number of tokens: N > M"); the decode fetches the prefill's parallel
info from the bootstrap server (GET /route, retried: 15 tries a second apart, then the
request fails: "Decode handshake failed ..."), waits FIFO for room for the prompt and
--num-reserved-decode-tokens (no timeout there: the prealloc queue does not poll its
waiting_for_input requests), sends its KV indices and waits for the KV, at most
SGLANG_DISAGGREGATION_WAITING_TIMEOUT from the handshake ("Decode transfer failed ...:
Request R timed out after Xs in KVPoll.WaitingForInput"). Its heartbeat (GET /health on
each prefill's bootstrap server every SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL) declares a
prefill dead after _MAX_FAILURE misses and fails its rooms ("Lost connection with prefill
instance (bootstrap_addr: H:P)", common/conn.py); a broken connection alone fails nothing
sooner, as RDMA writes that stop are only noticed so. With the KV the prefill's first
token and cached-token count arrive, and the decode emits that token at once, then
decodes (prebuilt.py). A request naming bootstrap_host 2.2.2.2 (FAKE_BOOTSTRAP_HOST) moves
no KV (fake/conn.py), as SGLang's own warmup and health requests do.

Messages follow the engine's ("... for request rank=0 req.rid='<rid>'
req.bootstrap_room=<room> with exception KVTransferError(bootstrap_room=<room>): <reason>");
reasons the engines do not spell (the decode abandoning a room) are the twin's own.
A request without bootstrap_room is served as on a non-disaggregated engine. The decode
dials the bootstrap address through its --kv-route for it, if any (config.py); messages
name the address the request gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from emulator.engine.disagg.config import DECODE, FAKE_BOOTSTRAP_HOST, PREFILL
from emulator.engine.disagg.held import KvOffer, TransferAborted
from emulator.engine.disagg.kv import kv_bytes, wire_bytes
from emulator.engine.disagg.respond import TransferFailed, TwinParts, answer, fail
from emulator.engine.disagg.sides import (
    KV_ABORT_PATH,
    KV_DONE_PATH,
    KV_PATH,
    ROUTE_QUERY,
    PullBroken,
    Pulled,
    PullRefused,
    get_json,
    pull_kv,
    refuse,
    send_kv,
)
from emulator.engine.model.queues import Emission
from emulator.engine.parse import GenRequest

log = logging.getLogger(__name__)

ABORTED = "Aborted by AbortReq."
DECODE_GONE = "the decode abandoned the transfer"
PREFILL_GONE = "the prefill request was aborted"


def failure(what: str, rid: str, room: int, reason: str) -> str:
    """The engine's message: "<what> failed for request rank=0 req.rid=... with
    exception KVTransferError(...)" (prefill.py and decode.py log and abort with it)."""
    return (
        f"{what} failed for request rank=0 req.rid='{rid}' req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): {reason}"
    )


class SglangPD:
    """SGLang's prefill and decode paths for one twin (module docstring)."""

    def __init__(self, twin: TwinParts) -> None:
        self.twin = twin
        self.d = twin.disagg
        # Decode side: prefills whose parallel info we have, their heartbeats, and the
        # transfers to fail when a prefill is declared dead.
        self.prefill_info: dict[str, Any] = {}
        self.heartbeats: dict[str, asyncio.Task[None]] = {}
        self.watchers: dict[str, set[asyncio.Future[str]]] = {}
        # Prefill side: when each room's KV began to leave.
        self.started: dict[str, float] = {}
        self.notices: set[asyncio.Task[None]] = set()  # abort notifications on their way

    # -- entry --------------------------------------------------------------------------

    async def serve(
        self, request: web.Request, req: GenRequest, body: dict[str, Any], rid: str, arrival: float
    ) -> web.StreamResponse | None:
        room, host = body.get("bootstrap_room"), body.get("bootstrap_host")
        if isinstance(room, list) or isinstance(host, list):
            raise TransferFailed(400, "the twin takes one request per body (no batches)")
        if room is None or not isinstance(room, int) or isinstance(room, bool):
            return None
        fake = host == FAKE_BOOTSTRAP_HOST or (host is None and self.d.transfer_backend == "fake")
        if self.d.mode == PREFILL:
            return await self.prefill(request, req, rid, arrival, room, fake)
        if self.d.mode == DECODE:
            return await self.decode(
                request, req, rid, arrival, room, f"{host}:{body.get('bootstrap_port')}", fake
            )
        return None

    async def stop(self) -> None:
        """The engine stops: transfers waiting on a prefill's fate fail now."""
        for watchers in self.watchers.values():
            for fut in watchers:
                if not fut.done():
                    fut.set_result("the decode engine stopped")
        tasks = [*self.heartbeats.values(), *self.notices]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- prefill ------------------------------------------------------------------------

    async def prefill(
        self, request: web.Request, req: GenRequest, rid: str, arrival: float, room: int, fake: bool
    ) -> web.StreamResponse:
        twin, stats, key = self.twin, self.twin.model.disagg, str(room)
        one = replace(req, output_tokens=1)  # PrefillBootstrapQueue._process_req
        if fake:
            return await answer(
                twin.engine, request, one, rid, twin.runner.submit(rid, one), arrival
            )
        entry = twin.held.open(key)
        try:
            if entry.failed is None:
                stats.prefill_bootstrap += 1
                try:
                    await asyncio.wait_for(entry.decode_arrived.wait(), self.d.bootstrap_timeout_s)
                except TimeoutError:
                    waited = self.d.bootstrap_timeout_s
                    why = f"Request {room} timed out after {waited:.1f}s in KVPoll.Bootstrapping"
                    twin.held.fail(key, why)
                finally:
                    stats.prefill_bootstrap -= 1
            if entry.failed is not None:
                stats.bootstrap_failed += 1
                msg = failure("Prefill bootstrap", rid, room, entry.failed)
                return await fail(twin.engine, request, one, rid, TransferFailed(500, msg, "500"))

            async def send(first: Emission) -> None:
                """Offer the KV and the first token; answer once they have left."""
                if entry.failed is None:
                    tokens = one.input_tokens
                    engine_bytes = kv_bytes(tokens, twin.engine.cfg.profile.kv_bytes_per_token)
                    wire = wire_bytes(engine_bytes, self.d.kv_byte_scale)
                    twin.model.reserve(f"held:{key}", tokens)  # held until it has left
                    if not entry.offer.done():
                        entry.offer.set_result(
                            KvOffer(tokens, engine_bytes, wire, first.cached_tokens)
                        )
                stats.prefill_inflight += 1
                try:
                    await entry.sent
                except TransferAborted as exc:
                    stats.transfer_failed += 1
                    msg = failure("Prefill transfer", rid, room, exc.reason)
                    raise TransferFailed(500, msg, "500") from None
                finally:
                    stats.prefill_inflight -= 1

            channel = twin.runner.submit(rid, one)
            return await answer(twin.engine, request, one, rid, channel, arrival, gate=send)
        finally:
            twin.model.release(f"held:{key}")
            if not entry.sent.done():
                twin.held.fail(key, PREFILL_GONE)  # left before the transfer settled
            elif entry.failed is None:
                twin.held.drop(key)

    async def kv_handler(self, request: web.Request) -> web.StreamResponse:
        """The decode's KV indices for a room arrive: wait for the prefill's KV, send it."""
        try:
            room = int(request.query["room"])
        except (KeyError, ValueError):
            return refuse(400, "room: an integer is required")
        held, key = self.twin.held, str(room)
        entry = held.open(key)
        if entry.failed is not None:
            return refuse(500, entry.failed)
        entry.decode_arrived.set()
        try:
            offer = await entry.offer
        except TransferAborted as exc:
            return refuse(500, exc.reason)
        except asyncio.CancelledError:
            held.fail(key, DECODE_GONE)
            raise
        self.started[key] = asyncio.get_running_loop().time()
        try:
            resp = await send_kv(request, offer)
        except (ConnectionError, asyncio.CancelledError):
            held.fail(key, DECODE_GONE)
            raise
        # The decode confirms the arrival (done_handler); without it the room fails.
        held.expire_in(key, self.d.bootstrap_timeout_s, lambda: entry.give_up(DECODE_GONE))
        return resp

    async def abort_handler(self, request: web.Request) -> web.Response:
        """The decode gave the room up (common/conn.py _send_abort_notification)."""
        self.twin.held.fail(request.query.get("room", ""), DECODE_GONE)
        return web.Response(text="OK")

    async def done_handler(self, request: web.Request) -> web.Response:
        """The decode has the room's KV: the transfer succeeded."""
        key = request.query.get("room", "")
        entry = self.twin.held.get(key)
        if entry is None or entry.sent.done():
            return refuse(404, f"no transfer under way for room {key}")
        entry.sent.set_result(None)
        # The prefill observes the transfer (prefill.py process_disagg_prefill_inflight_queue).
        start = self.started.pop(key, None)
        if start is not None and entry.offer.done():
            seconds = asyncio.get_running_loop().time() - start
            self.twin.model.disagg.transferred(entry.offer.result().engine_bytes, seconds)
        return web.Response(text="OK")

    # -- decode -------------------------------------------------------------------------

    async def decode(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        arrival: float,
        room: int,
        addr: str,
        fake: bool,
    ) -> web.StreamResponse:
        twin, stats = self.twin, self.twin.model.disagg
        cap = twin.engine.cfg.profile.kv_capacity_tokens
        if req.input_tokens > cap:
            msg = f"Request {rid} exceeds the maximum number of tokens: {req.input_tokens} > {cap}"
            return await fail(twin.engine, request, req, rid, TransferFailed(400, msg))
        stage = "prealloc"
        stats.decode_prealloc += 1
        try:
            loop = asyncio.get_running_loop()
            if not fake:
                await self.ensure_info(addr, rid, room)
            deadline = loop.time() + self.d.waiting_timeout_s  # init_time: bootstrapped
            await twin.preallocate(rid, req.input_tokens + self.d.reserved_decode_tokens)
            stats.decode_prealloc -= 1
            stats.decode_transfer += 1
            stage = "transfer"
            cached = 0
            if not fake:
                cached = (await self.transfer(addr, room, rid, deadline)).cached_tokens
                stats.received_from[addr] += 1
            stats.decode_transfer -= 1
            stage = "done"
            channel = twin.runner.submit_prebuilt(rid, req, cached, first_token_known=True)
        except TransferFailed as exc:
            return await fail(twin.engine, request, req, rid, exc)
        finally:
            if stage == "prealloc":
                stats.decode_prealloc -= 1
            elif stage == "transfer":
                stats.decode_transfer -= 1
            if stage != "done":
                twin.model.release(rid)
        return await answer(twin.engine, request, req, rid, channel, arrival)

    async def ensure_info(self, addr: str, rid: str, room: int) -> None:
        """The prefill's parallel info, fetched once per bootstrap address (decode.py
        _ensure_prefill_info); starts that prefill's heartbeat."""
        if addr in self.prefill_info:
            return
        url = f"http://{self.d.via(addr)}/route?" + "&".join(f"{k}=-1" for k in ROUTE_QUERY)
        for attempt in range(1, self.d.ensure_retries + 1):
            try:
                self.prefill_info[addr] = await get_json(
                    self.twin.session, url, self.d.ensure_retry_interval_s
                )
                break
            except (PullBroken, PullRefused) as e:
                if attempt == self.d.ensure_retries:
                    log.error(
                        "Could not fetch prefill parallel info from %s after %d attempts: %s",
                        addr,
                        attempt,
                        e,
                    )
                    self.twin.model.disagg.bootstrap_failed += 1
                    msg = failure("Decode handshake", rid, room, ABORTED)
                    raise TransferFailed(500, msg, "500") from None
                await asyncio.sleep(self.d.ensure_retry_interval_s)
        if addr not in self.heartbeats or self.heartbeats[addr].done():
            self.heartbeats[addr] = asyncio.create_task(self._heartbeat(addr))

    async def transfer(self, addr: str, room: int, rid: str, deadline: float) -> Pulled:
        """The KV for the room, within the deadline; a broken pull waits for the heartbeat's
        verdict or the deadline, as the engine notices no sooner (module docstring)."""
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[str] = loop.create_future()
        self.watchers.setdefault(addr, set()).add(lost)
        pull = asyncio.create_task(self._fetch(addr, room))
        reason = ""
        try:
            racing: set[asyncio.Future[Any]] = {pull, lost}
            left = max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(racing, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if pull in done:
                try:
                    return pull.result()
                except PullRefused as e:
                    reason = e.reason
                except PullBroken as e:
                    log.info(
                        "%s: KV pull for room %d broke: %s", self.twin.engine.cfg.name, room, e
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            asyncio.shield(lost), max(0.0, deadline - loop.time())
                        )
            if not reason:
                if lost.done():
                    reason = lost.result()
                else:
                    elapsed = self.d.waiting_timeout_s - max(0.0, deadline - loop.time())
                    reason = (
                        f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
                    )
        finally:
            pull.cancel()
            with contextlib.suppress(BaseException):
                await pull
            if not pull.done() or pull.cancelled() or pull.exception() is not None:
                self._notify_abort(addr, room)
            self.watchers.get(addr, set()).discard(lost)
            if not lost.done():
                lost.cancel()
        self.twin.model.disagg.transfer_failed += 1
        msg = failure("Decode transfer", rid, room, reason)
        raise TransferFailed(500, msg, "500")

    async def _fetch(self, addr: str, room: int) -> Pulled:
        """The room's KV, then the prefill's word that it is complete: Mooncake's sender
        learns its writes landed and sends the decode KVPoll.Success (common/conn.py), one
        more round trip after the last byte; the twin's decode asks for it."""
        base = f"http://{self.d.via(addr)}"
        pulled = await pull_kv(self.twin.session, f"{base}{KV_PATH}?room={room}")
        url = f"{base}{KV_DONE_PATH}?room={room}"
        try:
            async with self.twin.session.post(url) as resp:
                if resp.status >= 400:
                    raise PullRefused(resp.status, await resp.text())
                await resp.read()
        except (aiohttp.ClientError, ConnectionError) as e:
            raise PullBroken(repr(e)) from e
        return pulled

    def _notify_abort(self, addr: str, room: int) -> None:
        """Best effort, as the engine's (common/conn.py _send_abort_notification)."""

        async def notify() -> None:
            url = f"http://{self.d.via(addr)}{KV_ABORT_PATH}?room={room}"
            with contextlib.suppress(Exception):
                limit = aiohttp.ClientTimeout(total=self.d.heartbeat_interval_s)
                async with self.twin.session.post(url, timeout=limit) as resp:
                    await resp.read()

        task = asyncio.create_task(notify())
        self.notices.add(task)
        task.add_done_callback(self.notices.discard)

    async def _heartbeat(self, addr: str) -> None:
        """common/conn.py CommonKVManager heartbeat: GET /health on the prefill's bootstrap
        server every interval; after max failures in a row it is dead."""
        failures = 0
        timeout_s = min(self.d.heartbeat_interval_s, 3.0)  # requests' timeout=(2, 3)
        while True:
            await asyncio.sleep(self.d.heartbeat_interval_s)
            url = f"http://{self.d.via(addr)}/health"
            try:
                limit = aiohttp.ClientTimeout(total=timeout_s)
                async with self.twin.session.get(url, timeout=limit) as resp:
                    failures = 0 if resp.status == 200 else failures + 1
            except Exception:
                failures += 1
            if failures >= self.d.heartbeat_max_failures:
                reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
                watchers = self.watchers.pop(addr, set())
                log.error("%s, %d requests affected", reason, len(watchers))
                for fut in watchers:
                    if not fut.done():
                        fut.set_result(reason)
                self.prefill_info.pop(addr, None)
                self.heartbeats.pop(addr, None)
                return
