"""The simulator's side of a rival policy: the rival built for the settings, and `RivalFeed`,
its view of the simulation (base.RivalView: the request's trace row, the engines' keys and
sizes) and the timing of what it hears: each engine's load read at the rival's poll interval
and answered a WAN half-trip later, the engines' KV events likewise, on the virtual clock."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

from emulator.engine.model.scheduler import EngineModel
from emulator.rivals.fronts import default_throughput_tok_s
from ext_proc.core.router import Router
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.events import Closed, Listener
from loadgen.sim.rivals.base import EngineLoad, Prompt, RivalPolicy
from loadgen.sim.rivals.names import is_rival
from loadgen.sim.settings import PROXY, SimSettings
from loadgen.traces.request import TraceRequest


def rival_for(policy: str, seed: int, routers: int, front_doors: int) -> RivalPolicy | None:
    """The rival router's rule named `policy` (None: a product policy), with its own RNG."""
    if not is_rival(policy):
        return None
    from loadgen.sim.rivals.catalog import make_rival

    if routers != 1 or front_doors:
        raise ValueError(f"policy {policy}: one router, no front doors")
    return make_rival(policy, random.Random(f"peer:{seed}"))


def waiting_uncached_tokens(m: EngineModel) -> int:
    """Prompt tokens not yet prefilled and not from the cache: the waiting requests' whole
    prompts (matched only at admission here) and what the admitted ones have left (SGLang
    scheduler get_num_waiting_uncached_tokens)."""
    waiting = sum(r.input_tokens - r.cached_tokens for r in m.waiting)
    return waiting + sum(r.input_tokens - r.prefilled_tokens for r in m.prefilling)


class Simulated(Protocol):
    """What the feed reads of the simulation (loadgen.sim.simulate.Simulation)."""

    @property
    def now_s(self) -> float: ...

    @property
    def s(self) -> SimSettings: ...

    @property
    def router(self) -> Router: ...

    @property
    def engines(self) -> Mapping[str, EngineModel]: ...

    @property
    def kv_capacity_tokens(self) -> Mapping[str, int]: ...

    @property
    def engine_block_tokens(self) -> Mapping[str, int]: ...

    def at(self, t_s: float, change: Callable[[], None]) -> None: ...

    def engine_keys(self, r: TraceRequest) -> list[int]: ...


class RivalFeed(Listener):
    """base.RivalView over a running simulation, and the timing of the rival's polls and KV
    events (`at`: the simulation's timed calls). It hears the router's closes after the
    rival, to forget the request's row."""

    def __init__(self, rival: RivalPolicy, sim: Simulated) -> None:
        self.rival, self._sim = rival, sim
        self._profile = load_profile(sim.s.router_profile_of(sim.s.regions[0]))
        self._block_tokens = sim.engine_block_tokens[sim.s.regions[0]]
        # Each request's trace row while the rival may ask for it.
        self.rows: dict[str, TraceRequest] = {}
        # Per engine: (when it was last read, tokens it had emitted then).
        self._last: dict[str, tuple[float, int]] = {}
        if rival.kv_events:
            if len(set(sim.engine_block_tokens.values())) > 1:
                raise ValueError(f"{rival.name}: the fleet's block_tokens must agree")
            for m in sim.engines.values():
                m.cache.events = []
        rival.bind(self)
        sim.router.subscribe(self)

    def on_close(self, e: Closed) -> None:
        self.rows.pop(e.request_id, None)

    def _one_way_s(self, backend: str) -> float:
        return self._sim.s.rtt_ms(PROXY, backend)[0] / 2000

    # -- timing ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.rival.poll_interval_s is not None:
            for b in self._sim.engines:
                self._sim.at(0.0, partial(self._poll, b))

    def _poll(self, backend: str) -> None:
        now_s, interval_s = self._sim.now_s, self.rival.poll_interval_s
        assert interval_s is not None
        load = self.read(backend, now_s)
        self._sim.at(now_s + self._one_way_s(backend), lambda: self.rival.on_poll(backend, load))
        self._sim.at(now_s + interval_s, partial(self._poll, backend))

    def kv_events(self, backend: str, t: float, changes: Sequence[tuple[Any, ...]]) -> None:
        """The engine's cache changed at t: the rival hears it a half-trip later."""
        if self.rival.kv_events:
            heard_s = t + self._one_way_s(backend)
            self._sim.at(heard_s, lambda: self.rival.on_kv_events(backend, changes))

    def read(self, backend: str, now_s: float) -> EngineLoad:
        """The engine's load now; its generation rate is the tokens it emitted since the
        previous reading, over the time between."""
        m = self._sim.engines[backend]
        emitted = m.stats.tokens_emitted
        then_s, then_emitted = self._last.get(backend, (now_s, emitted))
        self._last[backend] = (now_s, emitted)
        rate = (emitted - then_emitted) / (now_s - then_s) if now_s > then_s else 0.0
        return EngineLoad(
            waiting_reqs=m.num_queued,
            running_reqs=m.num_started,
            kv_usage=m.held_tokens / self._sim.kv_capacity_tokens[backend],
            gen_throughput_tok_s=rate,
            waiting_uncached_tokens=waiting_uncached_tokens(m) if self.rival.poll_tokens else 0,
        )

    # -- base.RivalView --------------------------------------------------------------------

    def now_s(self) -> float:
        return self._sim.now_s

    def prompt(self, request_id: str) -> Prompt:
        r = self.rows[request_id]
        return Prompt(
            tuple(r.block_ids), r.block_tokens, r.input_tokens, r.output_tokens, r.session
        )

    def engine_keys(self, request_id: str) -> Sequence[int]:
        return self._sim.engine_keys(self.rows[request_id])

    def engine_block_tokens(self) -> int:
        return self._block_tokens

    def kv_capacity_tokens(self, backend: str) -> int:
        return self._sim.kv_capacity_tokens[backend]

    def region_of(self, backend: str) -> str:
        return self._sim.s.backends.get(backend, backend)

    def decode_throughput_tok_s(self) -> float:
        # the same figure the live bench gives SMG's --least-load-default-throughput
        return default_throughput_tok_s(self._profile)
