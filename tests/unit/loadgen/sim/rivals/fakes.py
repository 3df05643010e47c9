"""A RivalView with behaviour for the rival policies' tests: a clock to move, prompts to
register, engine keys as the simulator derives them."""

from __future__ import annotations

from collections.abc import Sequence

from ext_proc.vocab.types import Candidate, RouteRequest
from loadgen.sim.rivals.base import Prompt
from tests.builders import candidate


class FakeView:
    def __init__(
        self,
        block_tokens: int = 512,
        engine_block_tokens: int = 64,
        capacity_tokens: int = 640_000,
        throughput_tok_s: float = 3000.0,
    ) -> None:
        self.t = 0.0
        self.block_tokens = block_tokens
        self.engine_bt = engine_block_tokens
        self.capacity = capacity_tokens
        self.throughput = throughput_tok_s
        self.prompts: dict[str, Prompt] = {}

    def now_s(self) -> float:
        return self.t

    def prompt(self, request_id: str) -> Prompt:
        return self.prompts[request_id]

    def engine_keys(self, request_id: str) -> Sequence[int]:
        p = self.prompts[request_id]
        per = self.block_tokens // self.engine_bt
        return [hash((k, j, 0)) for k in p.blocks for j in range(per)]

    def engine_block_tokens(self) -> int:
        return self.engine_bt

    def kv_capacity_tokens(self, backend: str) -> int:
        return self.capacity

    def decode_throughput_tok_s(self) -> float:
        return self.throughput

    def region_of(self, backend: str) -> str:
        """A P/D fleet's names: `{region}-prefill` and `{region}-decode`, else the id."""
        return backend.removesuffix("-prefill").removesuffix("-decode")

    def request(
        self,
        rid: str,
        blocks: Sequence[int],
        input_tokens: int | None = None,
        session: str | None = None,
    ) -> RouteRequest:
        """Register a prompt of these trace blocks (full ones unless input_tokens says)."""
        n = input_tokens if input_tokens is not None else len(blocks) * self.block_tokens
        self.prompts[rid] = Prompt(tuple(blocks), self.block_tokens, n, 10, session)
        return RouteRequest(rid, None, session)


def fleet(**in_flight: int) -> list[Candidate]:
    """Candidates with these requests in flight (only what a rival reads)."""
    return [candidate(b, in_flight=n) for b, n in in_flight.items()]
