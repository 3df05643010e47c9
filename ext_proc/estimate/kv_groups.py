"""One KV cache group's blocks, as an engine's events describe them (`KvGroup`), and the
prompt's hit across a hybrid model's groups (`hybrid_hit_tokens`).

Who holds a block: a bit per (DP rank, medium). Each DP rank is its own engine with its
own cache, and one block may be held on the GPU and on a slower tier at once (SGLang's
HiCache backs a GPU node up to the host and later evicts either copy alone:
python/sglang/srt/mem_cache/hiradix_cache.py; vLLM's CPU offload, its `medium`). A
removal clears its own rank's and medium's bit only; a block is gone when no bit is left,
and it weighs as its best medium. Pages under 16 tokens are keyed coarser
(`kv_coarse.CoarseGroup`).

Pure.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from math import lcm
from typing import Any

from ext_proc.estimate.chain import Extras, chain_keys, keyed_block
from ext_proc.feeds.kv_events import BlockStored

# Removed pages remembered per rank, for children stored under them later (a node split
# re-stores pages under a removed parent; a sliding-window group frees old blocks first).
RETIRED_PAGES = 1 << 14

# Media by the bit they take; "STORAGE" is vLLM's disk tier, "DISK" SGLang's.
_MEDIUM_BIT = {None: 0, "GPU": 0, "CPU": 1, "CPU_PINNED": 1, "DISK": 2, "STORAGE": 2}
_OTHER_MEDIUM = 3
_MEDIA = 4
# A block held on a slower tier is brought back instead of recomputed: cheaper than a
# miss, not free.
MEDIUM_WEIGHT = (1.0, 0.5, 0.25, 0.25)
# Ranks beyond this share bits (modulo): far more DP ranks than one backend has.
MAX_RANKS = 64
_ANY_OF_MEDIUM = [sum(1 << (r * _MEDIA + m) for r in range(MAX_RANKS)) for m in range(_MEDIA)]

# How vLLM finds a group's hit (vllm/v1/core/single_type_kv_cache_manager.py): full
# attention from the start; a sliding window at the last run covering the window; Mamba
# at the last block holding its state. Encoder and cross attention cache no prompt prefix.
FULL, SLIDING, MAMBA, NONE = "full", "sliding", "mamba", "none"
_KINDS = {
    "sliding_window": SLIDING,
    "sliding_window_mla": SLIDING,
    "swa": SLIDING,
    "mamba": MAMBA,
    "encoder_only_attention": NONE,
    "cross_attention": NONE,
}


def holder_bit(rank: int, medium: str | None) -> int:
    return 1 << ((rank % MAX_RANKS) * _MEDIA + _MEDIUM_BIT.get(medium, _OTHER_MEDIUM))


def rank_bits(rank: int) -> int:
    return ((1 << _MEDIA) - 1) << ((rank % MAX_RANKS) * _MEDIA)


_weights: dict[int, float] = {}


def weight_of(holders: int) -> float:
    """A block's weight: its best medium's (memoized: few distinct holder sets occur)."""
    w = _weights.get(holders)
    if w is None:
        w = next((MEDIUM_WEIGHT[m] for m in range(_MEDIA) if holders & _ANY_OF_MEDIUM[m]), 0.0)
        _weights[holders] = w
    return w


class KvGroup:
    """One KV cache group: its block size and kind, who holds each of its keys, and per
    DP rank what each engine hash stands for (its key; `kv_coarse.CoarseGroup` for
    pages keyed coarser)."""

    def __init__(
        self,
        block_size: int,
        kind: str | None = None,
        window_tokens: int | None = None,
        key_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.spec_kind = kind
        self.kind = _KINDS.get(kind or "", FULL)
        self.key_tokens = key_tokens or block_size
        # A sliding-window hit needs this many blocks in a row (vLLM: cdiv(window - 1,
        # block_size)); a window not said: one.
        self.window_keys = max(1, -(-((window_tokens or 2) - 1) // self.key_tokens))
        self.held: dict[int, int] = {}
        self._pages: dict[int, dict[int, Any]] = {}
        self._retired: dict[int, OrderedDict[int, Any]] = {}

    def _page(self, rank: int, h: int) -> Any:
        pages = self._pages.get(rank)
        page = None if pages is None else pages.get(h)
        if page is None and (retired := self._retired.get(rank)) is not None:
            page = retired.get(h)
        return page

    def _key_of(self, h: int, page: Any) -> int | None:
        """The key the page of engine hash h holds (None: none)."""
        return int(page)

    def store(self, rank: int, e: BlockStored, seed: int, extras: list[Extras] | None) -> int:
        """Key a full-block event under its parent. Returns how many of its hashes were
        already known under another key (an engine whose hashes are not chained), or -1
        when the parent is unknown (nothing stored)."""
        if e.parent_block_hash is None:
            parent = seed
        else:
            parent = self._page(rank, e.parent_block_hash)
            if parent is None:
                return -1 if not self.add_medium(rank, e) else 0
        if extras is None:
            keys = chain_keys(e.token_ids, self.block_size, parent)
        else:
            packed, step = array("q", e.token_ids).tobytes(), 8 * self.block_size
            keys, key = [], parent
            for i, x in enumerate(extras):
                key = keyed_block(key, packed[i * step : (i + 1) * step], x)
                keys.append(key)
        pages = self._pages.setdefault(rank, {})
        retired = self._retired.get(rank)
        bit = holder_bit(rank, e.medium)
        held = self.held
        reused = 0
        for h, key in zip(e.block_hashes, keys, strict=True):
            old = pages.get(h)
            if old is None:
                if retired:
                    retired.pop(h, None)
            elif old != key:
                reused += 1
            pages[h] = key
            held[key] = held.get(key, 0) | bit
        return reused

    def add_medium(self, rank: int, e: BlockStored) -> bool:
        """A store the router cannot key (no tokens, another block size, an unknown
        parent) of blocks it already knows: they are now held on e.medium too. Returns
        whether every hash was known."""
        pages = [(h, self._page(rank, h)) for h in e.block_hashes]
        if not pages or any(p is None for _, p in pages):
            return False
        bit = holder_bit(rank, e.medium)
        self._pages.setdefault(rank, {}).update(pages)
        for h, page in pages:
            key = self._key_of(h, page)
            if key is not None:
                self.held[key] = self.held.get(key, 0) | bit
        return True

    def remove(self, rank: int, hashes: Sequence[int], medium: str | None) -> None:
        """The rank dropped these blocks from `medium` (None: the device)."""
        pages = self._pages.get(rank)
        if not pages:
            return
        bit, mine = holder_bit(rank, medium), rank_bits(rank)
        retired = self._retired.setdefault(rank, OrderedDict())
        for h in hashes:
            page = pages.get(h)
            if page is None:
                continue
            key = self._key_of(h, page)
            holders = self.held.get(key, 0) & ~bit if key is not None else 0
            if key is not None:
                if holders:
                    self.held[key] = holders
                else:
                    self.held.pop(key, None)
            if not holders & mine:  # this rank holds it nowhere now
                del pages[h]
                retired[h] = page
                if len(retired) > RETIRED_PAGES:
                    retired.popitem(last=False)

    def clear_rank(self, rank: int) -> None:
        """The rank's cache was cleared (AllBlocksCleared), or its state is forgotten."""
        self._pages.pop(rank, None)
        self._retired.pop(rank, None)
        mine = rank_bits(rank)
        for key in [k for k, v in self.held.items() if v & mine]:
            holders = self.held[key] & ~mine
            if holders:
                self.held[key] = holders
            else:
                del self.held[key]

    def apply_keyed(self, change: tuple[object, ...]) -> None:
        """A change from an engine whose blocks are keyed as the caller keys prompts."""
        pages = self._pages.setdefault(0, {})
        if change[0] == "stored":
            key = int(change[1])  # type: ignore[call-overload]
            pages[key] = key
            self.held[key] = self.held.get(key, 0) | holder_bit(0, None)
        elif change[0] == "removed":
            key = int(change[1])  # type: ignore[call-overload]
            pages.pop(key, None)
            self.held.pop(key, None)
        else:
            self.clear_rank(0)

    # -- a prompt's hit ---------------------------------------------------------------

    def leading(self, keys: Sequence[int], limit: int) -> int:
        """Leading keys held, at most `limit`."""
        held, n = self.held, 0
        for key in keys[:limit]:
            if key not in held:
                break
            n += 1
        return n

    def weighted(self, keys: Sequence[int], n: int) -> float:
        """Tokens of the first n keys, each by its best medium."""
        held = self.held
        return sum(weight_of(held[k]) for k in keys[:n]) * self.key_tokens

    def hit_tokens(self, keys: Sequence[int], limit_tokens: int, align: int) -> int:
        """The group's hit in tokens within `limit_tokens`, on a multiple of `align` (vLLM's
        find_longest_cache_hit per manager, at the router's keys)."""
        kt, held = self.key_tokens, self.held
        n = min(len(keys), limit_tokens // kt)
        if self.kind == FULL:
            return self.leading(keys, n) * kt // align * align
        run = 0
        for i in range(n - 1, -1, -1):
            if keys[i] not in held:
                run = 0
                continue
            if run == 0 and (i + 1) * kt % align:
                continue  # a hit must end on the alignment
            run += 1
            if self.kind == MAMBA or run >= self.window_keys:
                return (i + run) * kt
        return run * kt // align * align  # vLLM: the leading run when no window fits


def hybrid_hit_tokens(
    groups: Sequence[KvGroup], keys_of: Callable[[KvGroup], Sequence[int]], max_tokens: int
) -> float:
    """A prompt's cached tokens on a hybrid model: what every group hits at once. vLLM's
    HybridKVCacheCoordinator.find_longest_cache_hit (vllm/v1/core/kv_cache_coordinator.py)
    lets each group accept the candidate length or cut it, until none cuts, at the lcm of
    the groups' block sizes; full attention is downward-closed, so its cut stands. The
    weight is the first full-attention group's (its blocks' media).

    Not imitated, as the events do not tell: EAGLE's dropped last block; fine-grained
    partial hits (their partial-block stores are not keyed); a sliding window's size
    (the event type carries none yet: one block is taken to cover it); blocks a
    sliding-window group skips (vLLM's block_mask: such a store names fewer hashes than
    blocks and is not keyed)."""
    live = [g for g in groups if g.kind != NONE]
    if not live:
        return 0.0
    align = lcm(*(g.key_tokens for g in live))
    limit = min(max_tokens, max(len(keys_of(g)) * g.key_tokens for g in live))
    limit = limit // align * align
    while True:
        hit = limit
        for g in live:
            hit = min(hit, g.hit_tokens(keys_of(g), hit, align))
        if hit >= limit:
            break
        limit = hit
    primary = next((g for g in live if g.kind == FULL), None)
    if primary is None:
        return float(limit)
    return primary.weighted(keys_of(primary), limit // primary.key_tokens)
