"""What each engine really holds in its prefix cache, from its own KV events.

The engines' block hashes are their own (SGLang chains SHA-256 over a page's tokens; vLLM
seeds its hash per process), so they are not compared with anything the router computes.
Each `BlockStored` carries its blocks' token ids and its parent's hash: the router keys
every block by its own chain over those token ids (`chain_keys`), the same chain it
computes over a request's token ids, and remembers which engine hash stands for which of
its keys, so a later `BlockRemoved` (hashes only) can be applied. Events are applied in
order; a gap in a publisher's sequence numbers or a sequence that goes backwards (the
engine restarted) makes the state untrustworthy: `apply` says so and the caller replays
or resets.

Pure: no sockets, no clock of its own.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.feeds.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ext_proc.prompt.tokens import TokenIds

# Weight of a block held on a slower tier: it is brought back to the GPU instead of
# recomputed, cheaper than a miss but not free (SGLang HiCache, vLLM CPU offload).
TIER_WEIGHT = {None: 1.0, "GPU": 1.0, "CPU": 0.5, "CPU_PINNED": 0.5, "DISK": 0.25}
OTHER_TIER_WEIGHT = 0.25


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The router's key of every full block of `token_ids`: a hash of the previous key and
    the block's tokens (Python's SipHash of the packed ids: process-local, which is all an
    in-memory index needs)."""
    keys: list[int] = []
    ends = range(block_size, len(token_ids) + 1, block_size)
    if isinstance(token_ids, TokenIds):  # already packed: slice the bytes (same values)
        packed, step = token_ids.packed, 8 * block_size
        for end in ends:
            parent = hash((parent, packed[8 * end - step : 8 * end]))
            keys.append(parent)
        return keys
    for end in ends:
        parent = hash((parent, array("q", token_ids[end - block_size : end]).tobytes()))
        keys.append(parent)
    return keys


@dataclass
class Applied:
    """What applying a batch found: a gap or a restart means events were lost."""

    gap: bool = False
    restarted: bool = False
    unknown_parents: int = 0


class EngineBlocks:
    """One engine's blocks, as its events describe them."""

    def __init__(self) -> None:
        # Engine hash -> the router's key, and the key -> the block's tier weight.
        self._by_engine_hash: dict[int, int] = {}
        self._held: dict[int, float] = {}
        self.block_size: int | None = None
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.gaps = 0
        self.resets = 0

    @property
    def blocks(self) -> int:
        return len(self._held)

    def reset(self) -> None:
        """Forget everything (the engine restarted, or events were lost unrecoverably)."""
        self._by_engine_hash.clear()
        self._held.clear()
        self.last_seq = None
        self.resets += 1

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one batch in order. A batch after a gap is not applied (the caller replays
        from `last_seq + 1` or resets); one whose sequence goes back means a restart: the
        state is reset and the batch applied to the fresh state."""
        out = Applied()
        if self.last_seq is not None:
            if batch.seq <= self.last_seq:
                out.restarted = True
                self.reset()
            elif batch.seq > self.last_seq + 1:
                out.gap = True
                self.gaps += 1
                return out
        self.last_seq, self.last_ts = batch.seq, batch.ts
        for e in batch.events:
            if isinstance(e, BlockStored):
                out.unknown_parents += self._store(e)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    key = self._by_engine_hash.pop(h, None)
                    if key is not None:
                        self._held.pop(key, None)
            elif isinstance(e, AllBlocksCleared):
                self._by_engine_hash.clear()
                self._held.clear()
        return out

    def _store(self, e: BlockStored) -> int:
        if e.block_size <= 0 or len(e.token_ids) != len(e.block_hashes) * e.block_size:
            return 0  # not a full-block event: nothing to key it by
        self.block_size = e.block_size
        if e.parent_block_hash is None:
            parent = 0
        elif e.parent_block_hash in self._by_engine_hash:
            parent = self._by_engine_hash[e.parent_block_hash]
        else:
            return 1  # its prefix was never seen: no request could match past it
        keys = chain_keys(e.token_ids, e.block_size, parent)
        weight = TIER_WEIGHT.get(e.medium, OTHER_TIER_WEIGHT)
        for h, key in zip(e.block_hashes, keys, strict=True):
            self._by_engine_hash[h] = key
            self._held[key] = weight
        return 0

    def apply_keyed(self, block_size: int, changes: Sequence[tuple[object, ...]]) -> None:
        """Changes from an engine whose blocks are already keyed as the caller keys
        prompts (the simulator's engine models: trace block ids): ("stored", key, parent),
        ("removed", key), ("cleared",)."""
        self.block_size = block_size
        for change in changes:
            if change[0] == "stored":
                key = int(change[1])  # type: ignore[call-overload]
                self._by_engine_hash[key] = key
                self._held[key] = 1.0
            elif change[0] == "removed":
                key = int(change[1])  # type: ignore[call-overload]
                self._by_engine_hash.pop(key, None)
                self._held.pop(key, None)
            else:
                self._by_engine_hash.clear()
                self._held.clear()

    def cached_tokens(self, keys: Sequence[int]) -> float:
        """Tokens of the leading blocks the engine holds (weighted by tier), for a prompt
        keyed with `chain_keys` at this engine's block size."""
        bs = self.block_size or 0
        total = 0.0
        for key in keys:
            weight = self._held.get(key)
            if weight is None:
                break
            total += weight * bs
        return total
