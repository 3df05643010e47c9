"""The prefill leg of a disaggregated request, sent by the router itself while Envoy waits
for the routing reply (docs/envoy.md, "Prefill and decode apart"): to the prefill engine's
`address` (what its Envoy cluster reaches, so the same WAN link is crossed), in its
engine's protocol. What comes back is the body for the decode engine, which Envoy then
carries as any routed request, or why the leg failed.

- SGLang: the body with the bootstrap fields goes to the prefill engine and is not waited
  for (its answer comes only once the decode engine has pulled the KV): the decode leg goes
  on once the prefill's request is on the wire (a refused connection is a failure); its
  answer is drained in the background, cut off at the timeout (counted from the leg's
  start: the decode's transfer then fails).
- vLLM (NIXL): the one-token prefill is awaited (at most the timeout); its
  `kv_transfer_params` go into the decode leg's body.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

from ext_proc.common.names import HEADER_REQUEST_ID
from ext_proc.prompt import disagg
from ext_proc.vocab.backend import Backend, EngineKind

log = logging.getLogger("gorgo.prefill")


@dataclass(frozen=True)
class PrefillSent:
    """The prefill leg went out (SGLang) or answered (vLLM: `answered`): the decode
    engine's body."""

    decode_body: bytes
    answered: bool = False


@dataclass(frozen=True)
class PrefillFailed:
    """The prefill leg failed: why, and whether it ran out of time (504, else 503)."""

    reason: str
    timed_out: bool = False


PrefillResult = PrefillSent | PrefillFailed


class PrefillSender:
    """Sends prefill legs over one HTTP client session (opened on first use, on the
    running loop); `timeout_s`: the longest a leg may take (routing.prefill_timeout_s)."""

    def __init__(
        self,
        find: Callable[[str], Backend | None],
        timeout_s: float,
        rng: random.Random | None = None,
        on_kv_sent: Callable[[str], None] | None = None,
    ) -> None:
        # The backend of an id as the fleet has it now (None: not in it).
        self.find = find
        # Told an SGLang leg's answer by its request id (the prefill engine sent the KV).
        self.on_kv_sent = on_kv_sent
        self.timeout_s = timeout_s
        self.rng = rng or random.SystemRandom()
        self._client: aiohttp.ClientSession | None = None
        # SGLang legs whose answers are drained in the background (kept referenced).
        self._background: set[asyncio.Task[None]] = set()

    async def send(self, prefill_id: str, path: str, body: bytes, request_id: str) -> PrefillResult:
        """Send the prefill leg of the request to `path` with `body` (the client's, as
        rewritten for the decode engine's model) to the backend `prefill_id`."""
        backend = self.find(prefill_id)
        if backend is None:
            return PrefillFailed(f"prefill engine {prefill_id} is not in the fleet")
        try:
            if backend.engine == EngineKind.VLLM:
                return await self._vllm(backend, path, body, request_id)
            return await self._sglang(backend, path, body, request_id)
        except ValueError as e:  # a body the router parsed but cannot rewrite
            return PrefillFailed(f"prefill leg for {prefill_id}: {e}")

    async def _vllm(self, b: Backend, path: str, body: bytes, request_id: str) -> PrefillResult:
        leg = disagg.vllm_prefill_body(body)
        try:
            async with asyncio.timeout(self.timeout_s):
                status, answer = await self._post(b, path, leg, request_id)
        except TimeoutError:
            return PrefillFailed(f"prefill engine {b.id}: no answer in {self.timeout_s:g} s", True)
        except (aiohttp.ClientError, OSError) as e:
            return PrefillFailed(f"prefill engine {b.id} unreachable: {_describe(e)}")
        if status >= 400:
            return PrefillFailed(f"prefill engine {b.id} answered {status}")
        try:
            params = disagg.kv_transfer_params(answer)
        except disagg.PrefillAnswerError as e:
            return PrefillFailed(f"prefill engine {b.id}: {e}")
        return PrefillSent(disagg.vllm_decode_body(body, params), answered=True)

    async def _sglang(self, b: Backend, path: str, body: bytes, request_id: str) -> PrefillResult:
        room = disagg.bootstrap_room(self.rng)
        both = disagg.sglang_body(body, disagg.host_of(b.address), b.bootstrap_port, room)
        sent = asyncio.Event()
        task = asyncio.create_task(self._sglang_leg(b, path, both, request_id, sent))
        waiter = asyncio.create_task(sent.wait())
        try:
            await asyncio.wait(
                {task, waiter}, timeout=self.timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            waiter.cancel()
        if task.done():  # ended before (or as) it was sent: refused, reset, or answered early
            failure = task.result()
            if failure is not None:
                return failure
        elif not sent.is_set():
            task.cancel()
            return PrefillFailed(
                f"prefill engine {b.id}: not reached in {self.timeout_s:g} s", True
            )
        else:
            end = _log_end(task, b.id, request_id, self.on_kv_sent)
            self._background.add(drain := asyncio.create_task(end))
            drain.add_done_callback(self._background.discard)
        return PrefillSent(both)

    async def _sglang_leg(
        self, b: Backend, path: str, body: bytes, request_id: str, sent: asyncio.Event
    ) -> PrefillFailed | None:
        """The SGLang prefill request, to its end (None: answered below 400)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                status, _ = await self._post(b, path, body, request_id, sent)
        except TimeoutError:
            return PrefillFailed(f"prefill engine {b.id}: no answer in {self.timeout_s:g} s", True)
        except (aiohttp.ClientError, OSError) as e:
            return PrefillFailed(f"prefill engine {b.id} unreachable: {_describe(e)}")
        if status >= 400:
            return PrefillFailed(f"prefill engine {b.id} answered {status}")
        return None

    async def _post(
        self,
        b: Backend,
        path: str,
        body: bytes,
        request_id: str,
        sent: asyncio.Event | None = None,
    ) -> tuple[int, bytes]:
        client = self._session()
        async with client.post(
            f"http://{b.address}{path}",
            data=body,
            headers={"content-type": "application/json", HEADER_REQUEST_ID: request_id},
            trace_request_ctx=SimpleNamespace(sent=sent),
        ) as resp:
            return resp.status, await resp.read()

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_on_sent)
            trace.on_request_headers_sent.append(_on_sent)
            self._client = aiohttp.ClientSession(trace_configs=[trace])
        return self._client

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.close()


async def _on_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    """aiohttp's trace hook: the request's headers (or a chunk of its body) went out."""
    sent = getattr(ctx.trace_request_ctx, "sent", None)
    if sent is not None:
        sent.set()


async def _log_end(
    task: asyncio.Task[PrefillFailed | None],
    backend: str,
    request_id: str,
    on_kv_sent: Callable[[str], None] | None,
) -> None:
    """An SGLang prefill leg's end, awaited after the decode leg went on: a failure then is
    the decode engine's to report (its transfer fails), logged here; an answer says the KV
    was sent (`on_kv_sent`)."""
    failure = await task
    if failure is not None:
        log.warning("request %s: prefill leg on %s failed: %s", request_id, backend, failure.reason)
    elif on_kv_sent is not None:
        on_kv_sent(request_id)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
