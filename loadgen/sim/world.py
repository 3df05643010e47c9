"""What a simulation runs on, as its settings make it (loadgen.sim.simulate.Simulation runs
the events over it): each front door's routers, built by the service's own factory on the
virtual clock, and their directors; a rival router's rule in the router's place; one
engine model per backend (one per region, two with P/D); the WAN links between the doors
and the backends; what each engine serves and how it keys its blocks. Everything random
is drawn from the settings' seed in one order, so one seed makes one world.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence

from emulator.engine.disagg.prebuilt import PrebuiltModel
from emulator.engine.model.scheduler import EngineModel
from emulator.wan import DelayModel, DelaySettings
from ext_proc.core.build import build_router
from ext_proc.core.router import Router
from ext_proc.director.recipe import Director
from ext_proc.estimate.profile import EngineProfile, load_profile
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.server_info import EngineScheduling
from loadgen.sim.classes import engine_priorities
from loadgen.sim.models import cache_salt, default_model, max_loras, names_models, served_models
from loadgen.sim.rivals.feed import rival_for
from loadgen.sim.settings import SimSettings
from loadgen.traces.request import TraceRequest


def sub_blocks(ids: Sequence[int], per_block: int, salt: int | tuple[int, int]) -> list[int]:
    """Finer blocks of a trace's blocks: trace id k names its block and whole prefix, so
    (k, j) names sub-block j likewise. Tuples of ints hash the same in every process."""
    return [hash((k, j, salt)) for k in ids for j in range(per_block)]


def _engines(
    settings: SimSettings, profiles: dict[str, EngineProfile], rng: random.Random
) -> dict[str, EngineModel]:
    """One engine model per backend (SGLang's scheduler), each with an RNG drawn in turn;
    a P/D fleet's decode engines start requests on KV that arrived (PrebuiltModel)."""
    return {
        b: (PrebuiltModel if settings.pd and settings.role_of(b) == "decode" else EngineModel)(
            profiles[b],
            random.Random(rng.random()),
            max_loras(settings.fleet, r),
            settings.pd_protocol if settings.pd else "sglang",
            settings.engine_priority,
        )
        for b, r in settings.backends.items()
    }


def preempted(engines: Iterable[EngineModel]) -> dict[str, int]:
    """Preemptions over the engines, by the priority the requests carried."""
    total: Counter[str] = Counter()
    for e in engines:
        total.update(e.stats.preempted_by_priority)
    return dict(sorted(total.items()))


class SimWorld:
    """The simulated routers, engines and links, and the virtual clock they all read
    (`now_s`, moved by the simulation's events)."""

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self.now_s = 0.0
        doors = settings.doors
        cfg = settings.config(doors[0])
        rng = random.Random(settings.seed)
        # A rival router's rule (loadgen/sim/rivals) in the router's place: it chooses,
        # and hears the lifecycle as its own books would; its RNG is its own.
        self.rival = rival_for(
            settings.policy, settings.seed, settings.routers, settings.front_doors
        )
        # The service's own factory, on the virtual clock (it draws the policy's and the
        # tuner's RNGs from `rng` first).
        rivals = () if self.rival is None else (self.rival,)
        self.router = build_router(
            cfg, lambda: self.now_s, rng, listeners=rivals, policy=self.rival
        )
        backends = settings.backends
        profiles = {b: load_profile(settings.engine_profile_of(r)) for b, r in backends.items()}
        fleet = settings.fleet
        self.engines = _engines(settings, profiles, rng)
        # The priority each class's requests carry to the engine (its own scheduling).
        self.class_priority = engine_priorities(settings.classes, settings.engine_priority)
        # What each engine serves (sim/models.py); with models in the fleet file, its blocks
        # are keyed by the model asked for (an adapter shares no cache with its base).
        self.served = {b: served_models(fleet, r) for b, r in backends.items()}
        self.by_model = names_models(fleet)
        self.default_model = default_model(list(self.served.values()))
        self.links: dict[tuple[str, str], DelayModel] = {}
        self.routers_at: dict[str, list[Router]] = {}
        for door in doors:
            self.links.update(
                (
                    (door, b),
                    DelayModel(
                        DelaySettings(*settings.rtt_ms(door, b)), random.Random(rng.random())
                    ),
                )
                for b in backends
            )
            # Later routers draw their RNGs after the engines', so one router runs as before.
            if door == doors[0]:
                extra = [
                    build_router(cfg, lambda: self.now_s, random.Random(rng.random()))
                    for _ in range(settings.routers - 1)
                ]
                self.routers_at[door] = [self.router, *extra]
            else:
                door_cfg = settings.config(door)
                self.routers_at[door] = [
                    build_router(door_cfg, lambda: self.now_s, random.Random(rng.random()))
                    for _ in range(settings.routers)
                ]
        self.routers = [router for rs in self.routers_at.values() for router in rs]
        # Each router's recipe for a request (the live service's own: director.recipe);
        # sharing dispatches, one release per backend until the bus confirms it.
        shared = settings.share_dispatches and len(self.routers) > 1
        self.directors = {id(router): Director(router, shared) for router in self.routers}
        prio = settings.engine_priority  # as SGLang's /server_info tells it (auto)
        told = None if prio is None else EngineScheduling(True, prio.low_values_first)
        for router in self.routers:  # as discovery reads each engine's /v1/models at start
            for b in backends:
                router.inputs.record_models(b, self.served[b])
                if told is not None:
                    router.inputs.record_scheduling(b, told)
        # Per engine: a fleet's profiles may cache at other granularities and pool sizes.
        self.engine_block_tokens = {r: p.block_tokens for r, p in profiles.items()}
        self.kv_capacity_tokens = {r: p.kv_capacity_tokens for r, p in profiles.items()}
        if settings.prefix_state == "precise":
            # One request's engine keys serve every candidate (RouteRequest.engine_keys).
            if len(set(self.engine_block_tokens.values())) > 1:
                raise ValueError("prefix_state precise: the fleet's block_tokens must agree")
            for b in backends:
                self.engines[b].cache.events = []
                for router in self.routers:
                    router.inputs.expect_engine_events(b)
        self.router_block_tokens = cfg.routing.block_tokens
        self.probe_interval_s = cfg.probes.interval_s
        self.metrics_interval_s = cfg.probes.metrics_interval_s

    def engine_keys(self, r: TraceRequest) -> list[int]:
        """The request's prompt blocks as every engine keys them."""
        per_engine = r.block_tokens // self.engine_block_tokens[self.s.regions[0]]
        return sub_blocks(r.block_ids, per_engine, self.engine_salt(r))

    def engine_salt(self, r: TraceRequest) -> int | tuple[int, int]:
        """What the request's engine blocks are keyed with: its model's namespace when the
        fleet names models (one salt for every engine: precise mode's keys serve all)."""
        return (0, cache_salt(r.model or self.default_model)) if self.by_model else 0

    def report(self, backend: str) -> EngineReport:
        """The engine's load now, as its /metrics says it (emulator/engine/status.py)."""
        m = self.engines[backend]
        kv_use = m.held_tokens / self.kv_capacity_tokens[backend]
        return EngineReport(m.num_queued, m.num_started, kv_use)

    def one_way_s(self, door: str, backend: str) -> float:
        """The mean half-trip (no draw: the seeded delays of requests stay what they are)."""
        return self.s.rtt_ms(door, backend)[0] / 2000
