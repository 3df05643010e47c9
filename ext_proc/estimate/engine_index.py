"""What each engine really holds in its prefix cache, from its own KV events.

The engines' block hashes are their own (SGLang chains SHA-256 over a page's tokens; vLLM
seeds its hash per process), so they are not compared with anything the router computes.
Each `BlockStored` carries its blocks' token ids and its parent's hash: the router keys
every block by its own chain over those token ids (`chain_keys`), the same chain it
computes over a request's token ids, and remembers which engine hash stands for which of
its keys, so a later `BlockRemoved` (hashes only) can be applied.

- Sequence numbers are per publisher: a data-parallel engine has one per DP rank, each
  counting from 0 (SGLang: python/sglang/srt/disaggregation/kv_events.py; vLLM the same),
  each a cache of its own. A gap in a rank's sequence, or one that goes back (that rank
  restarted), makes its state untrustworthy: `apply` says so and the caller replays or
  resets. A batch's later parts (`EventBatch.part`) continue its first.
- KV cache groups (vLLM's hybrid models: full attention beside sliding-window or Mamba
  layers, each group its own block size; vllm/v1/core/kv_cache_coordinator.py) are kept
  apart (`kv_groups.KvGroup`), and a prompt's hit is what every group hits at once.
- A chain's namespace (adapter, cache salt) and the blocks no text request can reach
  (multimodal): `chain.namespace_seed`, `chain.event_extras`. A request's adapter is its
  model name when this engine's events have named that adapter (vLLM's lora_name is the
  adapter's served name, None for the base model; vllm/v1/core/block_pool.py
  _build_block_stored_event), else the base model: a request for an adapter no event
  has named yet is keyed as the base model until that adapter's first store is heard.
- Who holds a block, per DP rank and medium; how far the stream can be trusted (warm,
  unsupported, unknown parents): `stream_health.StreamHealth`.

Pure: no sockets, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from ext_proc.estimate.chain import chain_keys, event_extras, namespace_seed
from ext_proc.estimate.kv_coarse import make_group
from ext_proc.estimate.kv_groups import KvGroup, hybrid_hit_tokens
from ext_proc.estimate.stream_health import StreamHealth
from ext_proc.feeds.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)

__all__ = ["Applied", "EngineBlocks", "chain_keys"]

# Adapter names remembered per engine, at most (a deployment serves a handful).
MAX_LORA_NAMES = 256


@dataclass
class Applied:
    """What applying a batch found: a gap or a restart means events were lost."""

    gap: bool = False
    restarted: bool = False
    unknown_parents: int = 0


def _chainable(e: BlockStored) -> bool:
    return (
        e.extra_keys is None
        and e.block_size > 0
        and len(e.token_ids) == len(e.block_hashes) * e.block_size > 0
    )


def _same_kind(a: BlockStored, b: BlockStored) -> bool:
    return (a.block_size, a.medium, a.lora_name, a.group_idx, a.spec_kind) == (
        b.block_size,
        b.medium,
        b.lora_name,
        b.group_idx,
        b.spec_kind,
    )


def coalesced(events: Sequence[KvEvent]) -> Iterator[KvEvent]:
    """The events, consecutive stores along one chain as one: SGLang publishes a page an
    event (python/sglang/srt/mem_cache/events.py), and keyed together they are the same
    blocks under the same keys at a fraction of the cost."""
    run: list[BlockStored] = []
    for e in events:
        if run and isinstance(e, BlockStored):
            last = run[-1]
            if (
                e.parent_block_hash == last.block_hashes[-1]
                and _chainable(e)
                and _same_kind(e, last)
            ):
                run.append(e)
                continue
        if run:
            yield _merged(run)
            run = []
        if isinstance(e, BlockStored) and _chainable(e):
            run = [e]
        else:
            yield e
    if run:
        yield _merged(run)


def _merged(run: list[BlockStored]) -> BlockStored:
    if len(run) == 1:
        return run[0]
    first = run[0]
    return replace(
        first,
        block_hashes=tuple(chain.from_iterable(e.block_hashes for e in run)),
        token_ids=tuple(chain.from_iterable(e.token_ids for e in run)),
    )


class EngineBlocks:
    """One engine's blocks, as its events describe them."""

    def __init__(self) -> None:
        self._groups: dict[int, KvGroup] = {}
        self._seqs: dict[int, int] = {}
        self.last_ts: float | None = None
        self.gaps = 0
        self.resets = 0
        # Stores the index could not key (another block size than their group's, no
        # token ids), and the adapters the events named.
        self.skipped_stores = 0
        self.lora_names: set[str] = set()
        self.health = StreamHealth()

    # -- what it shows ----------------------------------------------------------------

    @property
    def blocks(self) -> int:
        return sum(len(g.held) for g in self._groups.values())

    @property
    def groups(self) -> list[tuple[int, KvGroup]]:
        return sorted(self._groups.items())

    @property
    def block_size(self) -> int | None:
        """The engine's block size (a hybrid model's: its first group's)."""
        return self.groups[0][1].block_size if self._groups else None

    @property
    def key_sizes(self) -> tuple[int, ...]:
        """The granules a prompt is keyed at to be matched here (one per group's size)."""
        return tuple(sorted({g.key_tokens for g in self._groups.values()}))

    @property
    def tolerance_tokens(self) -> int:
        """One block, as a prediction is judged (the coarsest granule)."""
        return max(self.key_sizes, default=0)

    @property
    def last_seqs(self) -> dict[int, int]:
        """The last sequence number applied, per DP rank."""
        return dict(self._seqs)

    def last_seq_of(self, rank: int | None) -> int | None:
        """The last sequence number applied from the publisher of `rank` (None: 0)."""
        return self._seqs.get(rank or 0)

    @property
    def last_seq(self) -> int | None:
        """Rank 0's, or the one publisher's (see `last_seq_of` for a DP engine)."""
        if len(self._seqs) == 1:
            return next(iter(self._seqs.values()))
        return self._seqs.get(0)

    @property
    def history_complete(self) -> bool:
        return self.health.complete

    @property
    def unsupported(self) -> str | None:
        return self.health.unsupported

    def seed_for(self, model: str | None, salt: str | None) -> int:
        """The namespace a request for `model` with `salt` is keyed in here."""
        lora = model if model is not None and model in self.lora_names else None
        return namespace_seed(lora, salt)

    # -- applying events --------------------------------------------------------------

    def reset(self, rank: int | None = None) -> None:
        """Forget the rank's (None: every rank's) blocks: that engine restarted, or its
        events were lost unrecoverably."""
        if rank is None:
            self._groups.clear()
            self._seqs.clear()
        else:
            for g in self._groups.values():
                g.clear_rank(rank)
            self._seqs.pop(rank, None)
        self.health.forget(rank)
        self.resets += 1

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one batch in order. A batch after a gap in its rank's sequence is not
        applied (the caller replays from `last_seq_of(rank) + 1` or resets); one whose
        sequence goes back means that rank restarted: its state is reset and the batch
        applied to the fresh state. A later part of a batch is applied only after its
        first part was."""
        out = Applied()
        rank = batch.dp_rank or 0
        last = self._seqs.get(rank)
        if batch.part > 0:
            if last != batch.seq:
                return out
        elif last is None or batch.seq <= last:
            if last is not None:
                out.restarted = True
                self.reset(rank)
            self.health.first_batch(rank, batch.seq)
        elif batch.seq > last + 1:
            out.gap = True
            self.gaps += 1
            return out
        self._seqs[rank] = batch.seq
        self.last_ts = batch.ts
        for e in coalesced(batch.events):
            if isinstance(e, BlockStored):
                out.unknown_parents += self._store(rank, e, batch.ts)
            elif isinstance(e, BlockRemoved):
                # vLLM names the group (a hash may be in several: kv_cache_utils.py
                # make_block_hash_with_group_id); without a group, any holds it.
                if e.group_idx is None:
                    targets = list(self._groups.values())
                else:
                    g = self._groups.get(e.group_idx)
                    targets = [] if g is None else [g]
                for target in targets:
                    target.remove(rank, e.block_hashes, e.medium)
            elif isinstance(e, AllBlocksCleared):
                for g in self._groups.values():
                    g.clear_rank(rank)
        return out

    def _store(self, rank: int, e: BlockStored, ts: float) -> int:
        """Key one store; 1 if its parent is unknown (its blocks are dropped)."""
        if e.lora_name is not None and len(self.lora_names) < MAX_LORA_NAMES:
            self.lora_names.add(e.lora_name)
        full = e.block_size > 0 and len(e.token_ids) == len(e.block_hashes) * e.block_size
        gid = e.group_idx or 0
        g = self._groups.get(gid)
        if g is None and full and e.block_hashes:
            window = e.sliding_window
            g = self._groups[gid] = make_group(e.block_size, e.spec_kind, window)
        salt, extras = event_extras(e)
        if (
            g is None
            or not full
            or e.block_size != g.block_size
            or (extras is not None and len(extras) != len(e.block_hashes))
        ):
            # vLLM's partial-block entries, an offload tier's own block size, a store
            # without token ids: the blocks it names that are known get its medium.
            self.skipped_stores += 1
            if g is not None:
                g.add_medium(rank, e)
            self.health.stored(e, ts, odd_size=g is not None and e.block_size != g.block_size)
            return 0
        reused = g.store(rank, e, namespace_seed(e.lora_name, salt), extras)
        self.health.stored(e, ts, reused=max(0, reused))
        if reused < 0:
            self.health.unknown_parent(ts, len(e.block_hashes))
            return 1
        return 0

    def apply_keyed(self, block_size: int, changes: Sequence[tuple[object, ...]]) -> None:
        """Changes from an engine whose blocks are already keyed as the caller keys
        prompts (the simulator's engine models: trace block ids): ("stored", key, parent),
        ("removed", key), ("cleared",)."""
        g = self._groups.get(0)
        if g is None or g.block_size != block_size:
            g = self._groups[0] = KvGroup(block_size, key_tokens=block_size)
        for change in changes:
            g.apply_keyed(change)

    # -- a prompt's hit ---------------------------------------------------------------

    def cached_tokens(
        self, keys: Sequence[int] | Mapping[int, Sequence[int]], max_tokens: int | None = None
    ) -> float:
        """Tokens of the prompt the engine would hit, weighted by the media holding them:
        `keys`, the prompt keyed with `chain_keys` at each of `key_sizes` (by size), or
        one list for every group; at most `max_tokens` (vLLM hits at most the prompt's
        length - 1: vllm/v1/core/kv_cache_manager.py get_computed_blocks)."""

        def keys_of(g: KvGroup) -> Sequence[int]:
            if isinstance(keys, Mapping):
                return keys.get(g.key_tokens, ())
            return keys

        groups = [g for _, g in self.groups]
        limit = max_tokens if max_tokens is not None else 1 << 62
        if len(groups) == 1:
            g = groups[0]
            ks = keys_of(g)
            return g.weighted(ks, g.leading(ks, limit // g.key_tokens))
        return hybrid_hit_tokens(groups, keys_of, limit)

    # -- warm-up ----------------------------------------------------------------------

    def expect(self, request_id: str, tokens: int) -> None:
        """While warming: a precise prediction's cached tokens for a request sent here."""
        self.health.expect(request_id, tokens)

    def settle(self, request_id: str, reported_tokens: int | None) -> None:
        """The request closed with the engine's cached-token report (None: none)."""
        self.health.settle(request_id, reported_tokens, self.tolerance_tokens)

    def as_json(self, wall_s: float) -> dict[str, Any]:
        """For /state: the groups, sequence numbers per rank, warm-up and stream health."""
        h = self.health
        return {
            "groups": [
                {
                    "group": gid,
                    "kind": g.spec_kind,
                    "block_size": g.block_size,
                    "key_tokens": g.key_tokens,
                    "blocks": len(g.held),
                }
                for gid, g in self.groups
            ],
            "last_seq": {str(r): s for r, s in sorted(self._seqs.items())},
            "history": "complete" if h.complete else "warming",
            "warm_agreements": h.agreements,
            "unknown_parents": {
                "total": h.unknown_parents,
                "recent": h.recent_unknown_parents(wall_s),
                "blocks_dropped": h.unknown_parent_blocks,
            },
            "skipped_stores": self.skipped_stores,
            "unsupported": h.unsupported,
            "lora_names": sorted(self.lora_names),
        }
