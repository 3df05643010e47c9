"""What the simulator tells a peer policy (base.PeerView), read off the simulation: the
request's trace row, the engines' keys and sizes, and an engine's load as a poll reads it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from emulator.engine.model import EngineModel
from loadgen.sim.peers.base import EngineLoad, Prompt

if TYPE_CHECKING:
    from loadgen.sim.simulate import Simulation


def waiting_uncached_tokens(m: EngineModel) -> int:
    """Prompt tokens not yet prefilled and not from the cache: the waiting requests' whole
    prompts (matched only at admission here) and what the admitted ones have left (SGLang
    scheduler get_num_waiting_uncached_tokens)."""
    waiting = sum(r.input_tokens - r.cached_tokens for r in m.waiting)
    return waiting + sum(r.input_tokens - r.prefilled_tokens for r in m.prefilling)


class LoadReader:
    """An engine's load as a peer's poll reads it; the generation rate is the tokens the
    engine emitted since this reader's previous reading, over the time between."""

    def __init__(self, with_tokens: bool) -> None:
        self.with_tokens = with_tokens
        self._last: dict[str, tuple[float, int]] = {}

    def read(self, backend: str, m: EngineModel, capacity_tokens: int, now_s: float) -> EngineLoad:
        emitted = m.stats.tokens_emitted
        then_s, then_emitted = self._last.get(backend, (now_s, emitted))
        self._last[backend] = (now_s, emitted)
        rate = (emitted - then_emitted) / (now_s - then_s) if now_s > then_s else 0.0
        return EngineLoad(
            waiting_reqs=m.num_queued,
            running_reqs=m.num_started,
            kv_usage=m.held_tokens / capacity_tokens,
            gen_throughput_tok_s=rate,
            waiting_uncached_tokens=waiting_uncached_tokens(m) if self.with_tokens else 0,
        )


class SimPeerView:
    """base.PeerView over a running Simulation."""

    def __init__(self, sim: Simulation) -> None:
        self._sim = sim

    def now_s(self) -> float:
        return self._sim.now_s

    def prompt(self, request_id: str) -> Prompt:
        r = self._sim.trace_row(request_id)
        return Prompt(
            tuple(r.block_ids), r.block_tokens, r.input_tokens, r.output_tokens, r.session
        )

    def engine_keys(self, request_id: str) -> Sequence[int]:
        return self._sim.engine_keys(self._sim.trace_row(request_id))

    def engine_block_tokens(self) -> int:
        return self._sim.engine_block_tokens[self._sim.s.regions[0]]

    def kv_capacity_tokens(self, backend: str) -> int:
        return self._sim.kv_capacity_tokens[backend]

    def decode_throughput_tok_s(self) -> float:
        profile = self._sim.router_profile
        batch = int(profile.max_running_requests)
        # batch requests, each 2048 tokens of context, one token each a decode step
        step_ms = float(profile.decode_ms(batch, batch * 2048))
        return round(batch / step_ms * 1e3, 1)
