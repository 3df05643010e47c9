"""DisaggTwin: what the engine's HTTP layer (emulator/engine/server.py) calls when the twin
runs prefill/decode disaggregation. It starts the side server beside the engine's port
(SGLang's bootstrap server on a prefill, vLLM's NIXL side channel), keeps the client that
reaches other twins' side servers, and hands each request whose body names a P/D transfer
(bootstrap_room; kv_transfer_params) to its engine's protocol (sglang.py, nixl.py); any
other request the engine serves as usual.

The decode side's room for KV in transit is taken in arrival order (SGLang's
DecodePreallocQueue pops FIFO and stops at the first request that does not fit; vLLM's
waiting queue is FCFS), polled each PREALLOC_POLL_S as the engines' schedulers check once
per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from typing import Any

import aiohttp
from aiohttp import web

from emulator.engine.config import SGLANG
from emulator.engine.disagg.config import PREFILL, DisaggConfig
from emulator.engine.disagg.held import HeldKv
from emulator.engine.disagg.nixl import NixlPD
from emulator.engine.disagg.prebuilt import DisaggRunner, PrebuiltModel
from emulator.engine.disagg.respond import EngineParts, TransferFailed, fail
from emulator.engine.disagg.sglang import SglangPD
from emulator.engine.disagg.sides import SideServer, bootstrap_app, side_channel_app
from emulator.engine.parse import GenRequest

log = logging.getLogger(__name__)

PREALLOC_POLL_S = 0.005
# Only bodies naming a transfer are decoded a second time (the engine parsed them once).
MARKERS = (b"bootstrap_room", b"kv_transfer_params")


class DisaggTwin:
    """One engine's P/D side (module docstring)."""

    def __init__(self, engine: EngineParts) -> None:
        disagg = engine.cfg.disagg
        if disagg is None:
            raise ValueError("DisaggTwin needs EngineConfig.disagg")
        if disagg.flavor != engine.cfg.flavor:
            raise ValueError(
                f"a {engine.cfg.flavor} twin speaks {engine.cfg.flavor}'s P/D protocol"
            )
        if not isinstance(engine.runner, DisaggRunner):
            raise TypeError("a P/D twin runs a DisaggRunner")
        self.engine = engine
        self.disagg: DisaggConfig = disagg
        self.runner: DisaggRunner = engine.runner
        self.model: PrebuiltModel = engine.runner.model
        # Tombstones live as long as SGLang's (the bootstrap timeout); vLLM's held KV has
        # a timer each.
        self.held = HeldKv(disagg.bootstrap_timeout_s)
        self.protocol: SglangPD | NixlPD = (
            SglangPD(self) if disagg.flavor == SGLANG else NixlPD(self)
        )
        self.side: SideServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._prealloc: deque[str] = deque()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the P/D twin is not started")
        return self._session

    @property
    def side_port(self) -> int:
        """The bound port of the side server (bootstrap server / NIXL side channel)."""
        if self.side is None:
            raise RuntimeError("this twin runs no side server")
        return self.side.port

    # -- lifecycle ----------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        d = self.disagg
        self._session = aiohttp.ClientSession()
        if isinstance(self.protocol, SglangPD):
            if d.mode == PREFILL:  # only a prefill server runs the bootstrap server
                page = self.engine.cfg.profile.block_tokens
                pd = self.protocol
                handlers = (pd.kv_handler, pd.done_handler, pd.abort_handler)
                host, port = d.advertised() if d.advertise else (d.host, 0)
                app_ = bootstrap_app(host, page, *handlers, advertised_port=port)
                self.side = SideServer(app_, d.host, d.bootstrap_port)
        elif d.active:  # the NIXL handshake listener runs on every role
            self.side = SideServer(
                side_channel_app(self.protocol.meta(), self.protocol.kv_handler),
                d.host,
                d.side_channel_port,
            )
        if self.side is not None:
            await self.side.start()
            if d.bootstrap_port == 0 or d.side_channel_port == 0:
                # Port 0 took a free one: what the twin reports (and, for vLLM, what its
                # kv_transfer_params name) is the one it listens on.
                bootstrap = self.side.port if d.flavor == SGLANG else d.bootstrap_port
                channel = self.side.port if d.flavor != SGLANG else d.side_channel_port
                self.disagg = self.engine.cfg.disagg = d.with_ports(bootstrap, channel)
                self.protocol.d = self.disagg
            log.info(
                "%s: P/D %s, side server on %s:%d",
                self.engine.cfg.name,
                d.mode,
                d.host,
                self.side.port,
            )

    async def on_shutdown(self, app: web.Application) -> None:
        """The engine stops (before its own requests are awaited): the side server and
        the transfers go first, so no request waits on them."""
        if isinstance(self.protocol, SglangPD):
            await self.protocol.stop()
        if self.side is not None:
            await self.side.stop()
        self.held.close()
        if self._session is not None:
            await self._session.close()

    # -- requests -----------------------------------------------------------------------

    async def serve(
        self, request: web.Request, req: GenRequest, raw: bytes, rid: str, arrival_s: float
    ) -> web.StreamResponse | None:
        """The answer of a request naming a P/D transfer; None: the engine serves it."""
        if not self.disagg.active or not any(m in raw for m in MARKERS):
            return None
        try:
            body: Any = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
        try:
            return await self.protocol.serve(request, req, body, rid, arrival_s)
        except TransferFailed as exc:
            return await fail(self.engine, request, req, rid, exc)

    async def preallocate(self, rid: str, tokens: int) -> None:
        """Reserve `tokens` of KV for rid once it is first in line and they fit (module
        docstring); waits as long as that takes."""
        self._prealloc.append(rid)
        try:
            while not (self._prealloc[0] == rid and self.model.fits(tokens)):
                await asyncio.sleep(PREALLOC_POLL_S)
            self.model.reserve(rid, tokens)
        finally:
            with contextlib.suppress(ValueError):
                self._prealloc.remove(rid)
