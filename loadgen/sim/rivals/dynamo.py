"""Dynamo's KV router (ai-dynamo/dynamo, Rust), its default cost.

Sources (ai-dynamo/dynamo lib/kv-router/src/scheduling/, /work/shared/peer-routers.md §3):
- selector.rs `DefaultWorkerSelector::select_worker`: per worker
  logit = overlap_score_weight · prefill_blocks + decode_blocks, where
  prefill_blocks = (its active prefill tokens + ISL - overlap·B) / B and decode_blocks =
  its active blocks plus the request's blocks it does not hold yet; temperature 0:
  the least logit, ties to the worker with the smallest KV tree (indexer blocks), then at
  random (`softmax_sample`). Defaults: overlap_score_weight 1, router_temperature 0
  (the survey's later form, s_p·max(0, (A_p + ISL)/B - c·overlap) + decode blocks +
  w_r·requests, with c = s_p = 1, w_r = 0 and no decay, is the same sum).
- sequence.rs `ActiveSequences`: the router's own books per worker: each request routed
  there holds its prompt blocks (counted once per worker) until it is freed at its end;
  its new tokens (ISL - overlap·B) count as active prefill until `mark_prefill_completed`,
  at its first token.
- The overlap is the engine's own cache as its KV events tell (the indexer), in the
  engine's blocks (B = its block size), a WAN half-trip after the engine changed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ext_proc.vocab.events import Closed, FirstByte
from ext_proc.vocab.policy import Choice
from ext_proc.vocab.types import Candidate, RouteRequest, Weights
from loadgen.sim.rivals.base import RivalPolicy, register_rival


@dataclass(frozen=True)
class DynamoParams:
    overlap_score_weight: float = 1.0


@dataclass
class _Books:
    """One worker's active sequences."""

    # block -> requests holding it
    blocks: dict[int, int] = field(default_factory=dict)
    prefill_tokens: int = 0


@register_rival("dynamo_kv")
class DynamoKv(RivalPolicy):
    """Dynamo's KV router with its defaults (overlap credit 1, temperature 0)."""

    name = "dynamo_kv"
    kv_events = True

    def __init__(self, rng: random.Random, params: DynamoParams | None = None) -> None:
        super().__init__(rng)
        self.p = params or DynamoParams()
        # The indexer: each worker's cached blocks, from its KV events.
        self.cached: dict[str, set[int]] = {}
        self.books: dict[str, _Books] = {}
        # request -> (worker, its blocks, its prefill tokens still active)
        self._active: dict[str, tuple[str, list[int], int]] = {}

    def on_kv_events(self, backend: str, changes: Sequence[tuple[Any, ...]]) -> None:
        held = self.cached.setdefault(backend, set())
        for change in changes:
            if change[0] == "stored":
                held.add(change[1])
            elif change[0] == "removed":
                held.discard(change[1])
            elif change[0] == "cleared":
                held.clear()

    def overlap(self, backend: str, keys: Sequence[int]) -> int:
        """Leading blocks the worker's cache holds."""
        held = self.cached.get(backend, set())
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def logits(
        self, keys: Sequence[int], isl: int, servers: Sequence[str]
    ) -> tuple[dict[str, float], dict[str, int]]:
        """Each worker's logit, and its overlap in blocks."""
        bt = self.view.engine_block_tokens()
        logits: dict[str, float] = {}
        overlaps: dict[str, int] = {}
        for s in servers:
            books = self.books.get(s) or _Books()
            overlaps[s] = ov = self.overlap(s, keys)
            prefill = books.prefill_tokens + max(0, isl - ov * bt)
            new_blocks = sum(1 for k in keys if k not in books.blocks)
            decode = len(books.blocks) + new_blocks
            logits[s] = self.p.overlap_score_weight * prefill / bt + decode
        return logits, overlaps

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], weights: Weights | None
    ) -> Choice:
        prompt = self.view.prompt(request.request_id)
        bt = self.view.engine_block_tokens()
        keys = list(self.view.engine_keys(request.request_id))[: prompt.input_tokens // bt]
        servers = [c.backend_id for c in candidates]
        logits, overlaps = self.logits(keys, prompt.input_tokens, servers)
        best = min(logits.values())
        tied = [s for s in servers if logits[s] == best]
        if len(tied) > 1:
            sizes = {s: len(self.cached.get(s, ())) for s in tied}
            if len(set(sizes.values())) > 1:
                tied = [min(tied, key=lambda s: sizes[s])]
        chosen = self.rng.choice(tied)
        prefill = max(0, prompt.input_tokens - overlaps[chosen] * bt)
        books = self.books.setdefault(chosen, _Books())
        for k in keys:
            books.blocks[k] = books.blocks.get(k, 0) + 1
        books.prefill_tokens += prefill
        self._active[request.request_id] = (chosen, keys, prefill)
        return Choice(chosen, logits)

    def _prefill_done(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is not None and active[2]:
            worker, keys, prefill = active
            self.books[worker].prefill_tokens -= prefill
            self._active[request_id] = (worker, keys, 0)

    def on_first_byte(self, e: FirstByte) -> None:
        self._prefill_done(e.request_id)

    def on_close(self, e: Closed) -> None:
        self._prefill_done(e.request_id)
        active = self._active.pop(e.request_id, None)
        if active is None:
            return
        worker, keys, _ = active
        blocks = self.books[worker].blocks
        for k in keys:
            blocks[k] -= 1
            if not blocks[k]:
                del blocks[k]
