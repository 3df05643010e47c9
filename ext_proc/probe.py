"""Active RTT probes and optional engine-metrics scraping: the async shell that feeds the
router's RTT and load features.

Each backend is probed with a small GET over a kept-alive connection, the same network
path Envoy uses, every `probes.interval_s`. A sample taken on a freshly opened connection
includes the TCP handshake (a second RTT) and is not used; failures count towards marking
the backend suspect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from types import SimpleNamespace

import aiohttp

from ext_proc.config import Backend, Config
from ext_proc.router import Router

log = logging.getLogger("gorgo.probe")

_QUEUE_LINE = re.compile(r"^sglang:num_queue_reqs(?:\{[^}]*\})?\s+(\S+)")


class Prober:
    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(self._on_new_connection)
        # One connection per backend is plenty; keep it alive across probes.
        connector = aiohttp.TCPConnector(limit_per_host=2, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(connector=connector, trace_configs=[trace])
        for b in self.cfg.backends:
            self._tasks.append(asyncio.create_task(self._probe_loop(b)))
            if self.cfg.probes.metrics_interval_s > 0:
                self._tasks.append(asyncio.create_task(self._metrics_loop(b)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()

    @staticmethod
    async def _on_new_connection(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
    ) -> None:
        ctx.trace_request_ctx["new_connection"] = True

    async def probe_once(self, b: Backend) -> float | None:
        """One probe: RTT in ms, or None if it failed. A sample that had to open a
        connection is not an RTT (it includes the handshake): it is retried at once."""
        assert self._session is not None
        p = self.cfg.probes
        url = f"http://{b.address}{p.path}"
        for _ in range(2):
            ctx: dict[str, bool] = {}
            start = time.perf_counter()
            try:
                async with self._session.get(
                    url, timeout=aiohttp.ClientTimeout(total=p.timeout_s), trace_request_ctx=ctx
                ) as resp:
                    await resp.read()
                    if resp.status >= 500:
                        return None
            except (aiohttp.ClientError, TimeoutError, OSError):
                return None
            if not ctx.get("new_connection"):
                return (time.perf_counter() - start) * 1000
        return None

    async def _probe_loop(self, b: Backend) -> None:
        while True:
            rtt_ms = await self.probe_once(b)
            was_suspect = self.router.state.backends[b.id].suspect
            self.router.record_probe(b.id, rtt_ms)
            now_suspect = self.router.state.backends[b.id].suspect
            if now_suspect != was_suspect:
                log.warning(
                    "backend %s %s",
                    b.id,
                    "suspect: probes fail" if now_suspect else "healthy again",
                )
            await asyncio.sleep(self.cfg.probes.interval_s)

    async def _metrics_loop(self, b: Backend) -> None:
        assert self._session is not None
        url = f"http://{b.address}/metrics"
        while True:
            try:
                async with self._session.get(
                    url, timeout=aiohttp.ClientTimeout(total=self.cfg.probes.timeout_s)
                ) as resp:
                    text = await resp.text()
                # Summed over label sets (one per data-parallel rank, if any).
                queued = sum(
                    float(m.group(1)) for m in map(_QUEUE_LINE.match, text.splitlines()) if m
                )
                self.router.state.record_metrics(b.id, queued, self.router.clock())
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                log.debug("metrics of %s: %s", b.id, e)
            await asyncio.sleep(self.cfg.probes.metrics_interval_s)
