"""Active RTT probes, engine-metrics scrapes and model lists: the async shell that feeds
the router's RTT and load features and what each backend serves.

Each backend is probed with a small GET over a kept-alive connection, the same network
path Envoy uses, every `probes.interval_s`, on a path the engine answers without work
(`PROBE_PATH`, per engine), so the sample is the network's round trip and not the
engine's queue. A sample taken on a freshly opened connection includes the TCP handshake
(a second RTT) and is not used; failures count towards marking the backend suspect. A
configured path other than the engine's own is compared with that one on every probe: a
path answered much more slowly makes the engine work, and a warning says so. A backend
added at run time gets its tasks (`add`); a removed one's are cancelled (`cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections import deque

import aiohttp

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import PROBE_PATH, Config
from ext_proc.core.backend import BackendState
from ext_proc.core.router import Router
from ext_proc.feeds.engine_metrics import MetricsError
from ext_proc.service.loops.engine_http import (
    UNREACHABLE,
    NoMetricsPage,
    probe_rtt,
    probe_session,
    read_engine_report,
    read_scheduling,
    read_served_models,
    read_session,
)
from ext_proc.vocab.backend import Backend, EngineKind, PriorityScheduling

log = logging.getLogger("gorgo.probe")

# A configured probe path other than the engine's no-work path is checked against it on
# every probe (one more small GET, only when misconfigured), over the last few pairs; a
# median this much slower warns.
COMPARE_PAIRS = 3
SLOWER_FACTOR = 2.0
SLOWER_MARGIN_MS = 10.0
# A probe waits at most this many of the backend's RTTs (never less than the floor, never
# more than probes.timeout_s; the whole timeout until a first probe has answered, so a
# slow probe path is measured, not failed): a link that swallows everything is caught in
# about a second instead of after the whole timeout, and a loaded router's slow loop or a
# busy engine's HTTP server is no failure.
PROBE_TIMEOUT_RTTS = 5.0
PROBE_TIMEOUT_FLOOR_S = 1.0
# An engine's pool this close to its profile's is the profile's (the emulated engine
# rounds it down to whole blocks): logged, not warned of.
POOL_TOLERANCE = 0.01


def kv_pool_note(b: BackendState) -> tuple[int, str]:
    """What to log once the backend's engine has said (or not said) its KV pool: a
    warning when the prefix index is sized to a pool other than the engine's, or to the
    profile's because the engine does not report one."""
    engine, (used, source) = b.engine.kv_capacity_tokens, b.kv_capacity
    profile = b.profile
    if engine is None:
        if source == "config":
            return logging.DEBUG, f"backend {b.id}: KV pool {used} tokens (config)"
        return logging.WARNING, (
            f"backend {b.id}: its engine's /metrics does not report its KV pool "
            "(vllm:cache_config_info, sglang:max_total_num_tokens): the prefix index is sized "
            f"to engine profile {profile.name}'s {used} tokens; set "
            "backends[].kv_capacity_tokens to the engine's (docs/engines.md)"
        )
    if source == "config" and abs(engine - used) > POOL_TOLERANCE * engine:
        return logging.WARNING, (
            f"backend {b.id}: its engine reports a KV pool of {engine} tokens, "
            f"backends[].kv_capacity_tokens says {used}: the config's is used"
        )
    if source == "engine" and abs(engine - profile.kv_capacity_tokens) > POOL_TOLERANCE * engine:
        return logging.WARNING, (
            f"backend {b.id}: its engine reports a KV pool of {engine} tokens, engine "
            f"profile {profile.name} says {profile.kv_capacity_tokens}: the prefix index is "
            "sized to the engine's"
        )
    return logging.INFO, f"backend {b.id}: KV pool {used} tokens ({source})"


class Prober:
    """RTT probes, metrics scrapes and model reads of every backend (a `Feed`)."""

    name = "probed"

    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        # Per backend: its probe loop and its metrics scrape.
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        # Metrics scrapes and model reads go on connections of their own: a probe that
        # waited for a connection another request holds would time that wait as RTT.
        self._aux: aiohttp.ClientSession | None = None
        # Backends whose configured probe path was found to make the engine work.
        self.slow_paths: dict[str, str] = {}
        # Set to probe a backend now rather than at its next interval (poke).
        self._pokes: dict[str, asyncio.Event] = {}
        # Backends whose /server_info has answered (whatever it said) since they were added.
        self._scheduling_answered: set[str] = set()

    async def start(self) -> None:
        self._session = probe_session()
        self._aux = read_session()
        backends = self.router.cfg.backends
        if self.cfg.probes.models_interval_s > 0:
            # What each engine serves, read before start returns (the service answers
            # /healthz after it): until then every backend takes every model, and a
            # request for a model one engine serves could go to another, which 404s it.
            await asyncio.gather(*(self._read_models(b) for b in backends))
        # Which SGLang engines schedule by priority, before the first request is routed.
        await asyncio.gather(*(self._read_scheduling(b) for b in backends))
        for b in backends:
            self.add(b, models_read=True)

    def add(self, b: Backend, models_read: bool = False) -> None:
        """Probe (and scrape) a backend from now on (restarted if it was); `models_read`:
        its models were just read (the next read is an interval away)."""
        self.cancel(b.id)
        tasks = [asyncio.create_task(self._probe_loop(b))]
        if self.cfg.probes.metrics_interval_s > 0:
            tasks.append(asyncio.create_task(self._metrics_loop(b)))
        if self.cfg.probes.models_interval_s > 0:
            tasks.append(asyncio.create_task(self._models_loop(b, models_read)))
        self._tasks[b.id] = tasks

    def poke(self, backend: str) -> None:
        """Probe the backend now (a request there is late for its first byte)."""
        event = self._pokes.get(backend)
        if event is not None:
            event.set()

    def timeout_s(self, backend: str) -> float:
        """How long a probe of the backend may take (PROBE_TIMEOUT_RTTS)."""
        state = self.router.backends.get(backend)
        limit_s = self.cfg.probes.timeout_s
        if state is None or not state.health.rtt_samples:
            return limit_s
        return min(
            limit_s, max(PROBE_TIMEOUT_FLOOR_S, PROBE_TIMEOUT_RTTS * state.health.rtt_ms / 1000)
        )

    def cancel(self, backend: str) -> list[asyncio.Task[None]]:
        """Stop a backend's tasks: cancelled now, returned to be awaited."""
        tasks = self._tasks.pop(backend, [])
        self._pokes.pop(backend, None)
        for t in tasks:
            t.cancel()
            self._stopping.add(t)  # a reference until it has ended
            t.add_done_callback(self._stopping.discard)
        self.slow_paths.pop(backend, None)
        self._scheduling_answered.discard(backend)
        return tasks

    @property
    def backends(self) -> list[str]:
        return list(self._tasks)

    async def stop(self) -> None:
        await cancel_and_wait([*(t for ts in self._tasks.values() for t in ts), *self._stopping])
        self._tasks.clear()
        for session in (self._session, self._aux):
            if session is not None:
                await session.close()

    async def probe_once(self, b: Backend, path: str | None = None) -> float | None:
        """One probe: RTT in ms, or None if it failed (engine_http.probe_rtt)."""
        assert self._session is not None
        url = f"http://{b.address}{path or self.cfg.probe_path(b)}"
        return await probe_rtt(self._session, url, self.timeout_s(b.id))

    async def _probe_loop(self, b: Backend) -> None:
        path = self.cfg.probe_path(b)
        reference = PROBE_PATH[b.engine]
        pairs: deque[tuple[float, float]] = deque(maxlen=COMPARE_PAIRS)
        poked = self._pokes.setdefault(b.id, asyncio.Event())
        while True:
            poked.clear()
            rtt_ms = await self.probe_once(b, path)
            if rtt_ms is not None and self._models_unread(b):
                # an engine that was not up when the router started (or was added) answers:
                # what it serves is read before it counts as healthy, not an interval later
                await self._read_models(b)
            if rtt_ms is not None and b.id not in self._scheduling_answered:
                await self._read_scheduling(b)
            state = self.router.backends.get(b.id)
            if state is None:  # removed while the probe was out
                return
            was_suspect = state.health.suspect
            self.router.inputs.record_probe(b.id, rtt_ms)
            now_suspect = state.health.suspect
            if now_suspect != was_suspect:
                log.warning(
                    "backend %s %s",
                    b.id,
                    "suspect: probes fail" if now_suspect else "healthy again",
                )
            if path != reference and rtt_ms is not None and b.id not in self.slow_paths:
                ref_ms = await self.probe_once(b, reference)
                if ref_ms is not None:
                    pairs.append((rtt_ms, ref_ms))
                    self._check_path(b, path, reference, pairs)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(poked.wait(), self.cfg.probes.interval_s)

    def _check_path(
        self, b: Backend, path: str, reference: str, pairs: deque[tuple[float, float]]
    ) -> None:
        if len(pairs) < COMPARE_PAIRS or b.id in self.slow_paths:
            return
        probe_ms = statistics.median(p for p, _ in pairs)
        ref_ms = statistics.median(r for _, r in pairs)
        if probe_ms > SLOWER_FACTOR * ref_ms + SLOWER_MARGIN_MS:
            self.slow_paths[b.id] = path
            log.warning(
                "backend %s: probes of %s answer in %.0f ms, %s in %.0f ms: %s makes the "
                "engine work, so its RTT includes the engine's queue; set probes.path to a "
                "path the engine answers without work (empty: the engine's own, %s)",
                b.id,
                path,
                probe_ms,
                reference,
                ref_ms,
                path,
                reference,
            )

    async def _metrics_loop(self, b: Backend) -> None:
        assert self._aux is not None
        pool_said = False  # whether its KV pool (or that it has none) was logged
        while True:
            try:
                report = await read_engine_report(self._aux, b.address, self.cfg.probes.timeout_s)
                new_pool = self.router.inputs.record_engine_report(b.id, report)
                state = self.router.backends.get(b.id)
                if state is not None and (new_pool or not pool_said):
                    log.log(*kv_pool_note(state))
                    pool_said = True
            except NoMetricsPage:
                if not pool_said:
                    log.warning(
                        "backend %s has no /metrics (SGLang: start it with "
                        "--enable-metrics): no engine load reports, and its KV pool is "
                        "backends[].kv_capacity_tokens or the engine profile's",
                        b.id,
                    )
                    pool_said = True
            except (*UNREACHABLE, MetricsError) as e:
                # The last report stands until it is stale: then the router's own count.
                log.debug("metrics of %s: %s", b.id, e)
            await asyncio.sleep(self.cfg.probes.metrics_interval_s)

    async def _models_loop(self, b: Backend, read: bool = False) -> None:
        """What the engine serves (`/v1/models`): read when the backend is added (unless
        `read`, just done) and every models_interval_s, so an adapter loaded at run time
        is routed to within one interval."""
        if read:
            await asyncio.sleep(self.cfg.probes.models_interval_s)
        while True:
            await self._read_models(b)
            await self._read_scheduling(b)  # an engine restarted with other flags
            await asyncio.sleep(self.cfg.probes.models_interval_s)

    def _models_unread(self, b: Backend) -> bool:
        state = self.router.backends.get(b.id)
        return (
            self.cfg.probes.models_interval_s > 0
            and state is not None
            and state.engine.discovered is None
        )

    async def _read_models(self, b: Backend) -> None:
        """One read of the engine's models; an answer that cannot be read (or none within
        probes.timeout_s) leaves what was known."""
        assert self._aux is not None
        try:
            served = await read_served_models(self._aux, b.address, self.cfg.probes.timeout_s)
            if self.router.inputs.record_models(b.id, served):
                log.info("backend %s serves %s", b.id, ", ".join(sorted(served.names)))
        except (*UNREACHABLE, ValueError) as e:
            log.debug("models of %s: %s", b.id, e)

    async def _read_scheduling(self, b: Backend) -> None:
        """One read of an SGLang engine's priority scheduling (/server_info), unless the
        config turns writing off; vLLM reports none. A change is logged."""
        if b.engine is not EngineKind.SGLANG or b.priority_scheduling is PriorityScheduling.OFF:
            return
        assert self._aux is not None
        try:
            scheduling = await read_scheduling(self._aux, b.address, self.cfg.probes.timeout_s)
            error = ""
            self._scheduling_answered.add(b.id)
        except UNREACHABLE as e:
            log.debug("server_info of %s: %s", b.id, e)
            return  # what was known stands; the next probe that answers reads it again
        except ValueError as e:  # an answer, not one the router can read
            self._scheduling_answered.add(b.id)
            scheduling, error = None, str(e) or type(e).__name__
        if self.router.inputs.record_scheduling(b.id, scheduling, error):
            state = self.router.backends.get(b.id)
            if state is not None:
                log.info("backend %s: priority %s", b.id, state.priority.reason)
