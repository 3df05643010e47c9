"""The offline simulator: a trace replayed on a virtual clock through the very same router
(policy, prefix index, queue estimate, probes' arithmetic) and the very same engine model
as the live emulated fleet, with the WAN's RTT profile. Deterministic for a given seed.

Per request: it arrives at the proxy at its (scaled) trace time; the router decides; it
reaches the engine one WAN half-trip later; the engine model schedules it; each token
travels back one half-trip. The router sees the first token (TTFT) and the completion
(E2E, and the engine's cached-token count) when they reach the proxy, as live.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from emulator.model import EngineModel
from emulator.stack import DEFAULT_REGIONS
from emulator.wan import DelayModel, DelaySettings, rtt_profile_ms
from ext_proc.config import Config, config_from_dict
from ext_proc.engine_index import EngineBlocks
from ext_proc.lifecycle import Status
from ext_proc.parse import COMPLETIONS, LlmRequest
from ext_proc.policy import RouteRequest
from ext_proc.profile import DEFAULT_PROFILE, load_profile
from ext_proc.router import Router, build_router
from loadgen.results import RequestResult
from loadgen.traces import TraceRequest

_ARRIVE, _AT_ENGINE, _STEP, _FIRST_BYTE, _DONE, _PROBE, _KV_EVENTS = range(7)

# Called after each completion with (request result, the router): the tuner's hook.
CompletionHook = Callable[[RequestResult, Router], None]


@dataclass
class SimSettings:
    policy: str = "gorgo"
    time_scale: float = 1.0
    rtt_profile: str = "network"
    engine_profile: str = DEFAULT_PROFILE
    seed: int = 0
    regions: Sequence[str] = tuple(r.id for r in DEFAULT_REGIONS)
    # Extra router config (weights, routing, probes), merged into the generated config.
    router: dict[str, Any] = field(default_factory=dict)
    # Tune the weights online: "off", "paired" or "paper" (the router config's tuner mode).
    tune: str = "off"
    # "approximate": the router's own estimate of what each engine caches; "precise": the
    # engines' own cache changes reach it (as KV events would, one WAN half-trip later).
    prefix_state: str = "approximate"
    # Routers deciding side by side (replicas, or one per region's front door), each with
    # its own state; a session always goes through the same one (crc32 of its key). With
    # precise state they all see every engine's cache changes; approximate, each knows only
    # what it dispatched.
    routers: int = 1

    def config(self) -> Config:
        raw: dict[str, Any] = {
            "policy": self.policy,
            "seed": self.seed,
            "backends": [
                {
                    "id": r,
                    "address": f"127.0.0.1:{18101 + i}",
                    "rtt_prior_ms": rtt_profile_ms(self.rtt_profile, r)[0],
                    "engine_profile": self.engine_profile,
                }
                for i, r in enumerate(self.regions)
            ],
        }
        raw["tuner"] = {"mode": self.tune}
        raw.update(self.router)
        return config_from_dict(raw)


@dataclass
class SimResult:
    settings: SimSettings
    requests: list[RequestResult]
    itl_ms: list[float]
    router: Router


def _sub_blocks(ids: Sequence[int], per_block: int, salt: int) -> list[int]:
    """Finer blocks of a trace's blocks: trace id k names its block and whole prefix, so
    (k, j) names sub-block j likewise. Tuples of ints hash the same in every process."""
    return [hash((k, j, salt)) for k in ids for j in range(per_block)]


class Simulation:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        settings: SimSettings,
        hook: CompletionHook | None = None,
    ) -> None:
        self.trace = trace
        self.s = settings
        self.hook = hook
        self.now_s = 0.0
        cfg = settings.config()
        rng = random.Random(settings.seed)
        # The service's own factory, on the virtual clock (it draws the policy's and the
        # tuner's RNGs from `rng` first).
        self.router = build_router(cfg, lambda: self.now_s, rng)
        profile = load_profile(settings.engine_profile)
        self.engines = {
            r: EngineModel(profile, random.Random(rng.random())) for r in settings.regions
        }
        self.links = {
            r: DelayModel(
                DelaySettings(*rtt_profile_ms(settings.rtt_profile, r)), random.Random(rng.random())
            )
            for r in settings.regions
        }
        self.engine_block_tokens = profile.block_tokens
        # More routers draw their RNGs after the engines', so one router runs as before.
        self.routers = [self.router] + [
            build_router(cfg, lambda: self.now_s, random.Random(rng.random()))
            for _ in range(settings.routers - 1)
        ]
        self._router_of: dict[str, Router] = {}
        if settings.prefix_state == "precise":
            for r in settings.regions:
                self.engines[r].cache.events = []
                for router in self.routers:
                    router.engine_blocks[r] = EngineBlocks()
                    router.precise.add(r)
        self.router_block_tokens = cfg.routing.block_tokens
        self.probe_interval_s = cfg.probes.interval_s
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.results: dict[str, RequestResult] = {}
        self._arrival_s: dict[str, float] = {}
        self._last_emit_s: dict[str, float] = {}
        self.itl_ms: list[float] = []

    def _push(self, t: float, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _schedule_step(self, backend: str) -> None:
        t = self.engines[backend].next_event_s()
        if t is not None:
            self._push(t, _STEP, (backend, t))

    def run(self) -> SimResult:
        for r in self.trace:
            self._push(r.arrival_s * self.s.time_scale, _ARRIVE, r)
        for b in self.s.regions:
            self._push(0.0, _PROBE, b)
        pending = len(self.trace)
        while self._events and pending:
            t, _, kind, data = heapq.heappop(self._events)
            self.now_s = t
            if kind == _ARRIVE:
                self._arrive(data)
            elif kind == _AT_ENGINE:
                backend, r = data
                engine = self.engines[backend]
                blocks = _sub_blocks(r.block_ids, r.block_tokens // self.engine_block_tokens, 0)
                engine.submit(r.id, r.input_tokens, r.output_tokens, blocks, t)
                self._publish_cache_changes(backend, t)
                self._schedule_step(backend)
            elif kind == _STEP:
                backend, due = data
                if self.engines[backend].next_event_s() != due:
                    continue  # replanned since: a newer event stands for this engine
                self._step(backend, t)
            elif kind == _FIRST_BYTE:
                # a one-token answer's completion can reach the proxy first: then no router
                # holds it any more
                if (router := self._router_of.get(data)) is not None:
                    router.first_byte(data)
            elif kind == _DONE:
                self._done(data)
                pending -= 1
            elif kind == _PROBE:
                link = self.links[data]
                rtt_ms = link.sample_rtt_ms()
                for router in self.routers:
                    router.record_probe(data, rtt_ms)
                self._push(t + self.probe_interval_s, _PROBE, data)
            elif kind == _KV_EVENTS:
                backend, changes = data
                for router in self.routers:
                    router.engine_blocks[backend].apply_keyed(self.engine_block_tokens, changes)
        ordered = [self.results[r.id] for r in self.trace]
        return SimResult(self.s, ordered, self.itl_ms, self.router)

    def _publish_cache_changes(self, backend: str, t: float) -> None:
        """Precise mode: the engine's cache changes reach the router a half-trip later (the
        mean: no draw, so the seeded delays of requests stay what they are)."""
        cache = self.engines[backend].cache
        if cache.events:
            one_way_s = rtt_profile_ms(self.s.rtt_profile, backend)[0] / 2000
            self._push(t + one_way_s, _KV_EVENTS, (backend, cache.events))
            cache.events = []

    def _arrive(self, r: TraceRequest) -> None:
        llm = LlmRequest(COMPLETIONS, ("",), (r.input_tokens,), r.output_tokens, True, None, None)
        per = max(1, r.block_tokens // self.router_block_tokens)
        blocks = _sub_blocks(r.block_ids, per, 1)[: r.input_tokens // self.router_block_tokens]
        engine_keys = None
        if self.s.prefix_state == "precise":
            per_engine = r.block_tokens // self.engine_block_tokens
            engine_keys = _sub_blocks(r.block_ids, per_engine, 0)
        router = self.routers[zlib.crc32((r.session or r.id).encode()) % len(self.routers)]
        self._router_of[r.id] = router
        d = router.decide(RouteRequest(r.id, llm, r.session, blocks, engine_keys))
        self.results[r.id] = RequestResult(
            r.id,
            d.backend,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            predicted_cached_tokens=d.chosen.cached_tokens,
        )
        self._arrival_s[r.id] = self.now_s
        one_way_s = self.links[d.backend].one_way_delay_s()
        self._push(self.now_s + one_way_s, _AT_ENGINE, (d.backend, r))

    def _step(self, backend: str, t: float) -> None:
        link = self.links[backend]
        for e in self.engines[backend].advance(t):
            res = self.results[e.rid]
            if e.index == 0:
                at_proxy_s = t + link.one_way_delay_s()
                res.ttft_ms = (at_proxy_s - self._arrival_s[e.rid]) * 1000
                res.cached_tokens = e.cached_tokens
                self._push(at_proxy_s, _FIRST_BYTE, e.rid)
            else:
                self.itl_ms.append((t - self._last_emit_s[e.rid]) * 1000)
            self._last_emit_s[e.rid] = t
            if e.finished:
                done_s = t + link.one_way_delay_s()
                res.e2e_ms = max(res.ttft_ms or 0.0, (done_s - self._arrival_s[e.rid]) * 1000)
                self._push(max(done_s, t), _DONE, e.rid)
        self._publish_cache_changes(backend, t)
        self._schedule_step(backend)

    def _done(self, rid: str) -> None:
        res = self.results[rid]
        self._router_of.pop(rid).close(rid, Status.OK, res.e2e_ms, cached_tokens=res.cached_tokens)
        del self._last_emit_s[rid]
        if self.hook is not None:
            self.hook(res, self.router)


def simulate(
    trace: Sequence[TraceRequest], settings: SimSettings, hook: CompletionHook | None = None
) -> SimResult:
    return Simulation(trace, settings, hook).run()
