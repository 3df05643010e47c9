"""Pages under 16 tokens (SGLang's default is 1), keyed every `COARSE_TOKENS` tokens
(`CoarseGroup`): a request's keys and the engine's pages alike, so a 32k-token prompt costs
~1k hashes, not 32k, and a chain of pages is stored with a few dict updates, not a few
Python steps a page.

A store's pages are one run: its parent's coarse key and tokens since it, its own tokens,
and the coarse keys it completes. A page stands for its run and its place in it; the page
that completes a granule holds the granule's key. SGLang evicts leaves first
(python/sglang/srt/mem_cache/radix_cache.py evict), so the page a granule ends on goes
before the pages under it: its removal drops the granule.

Pure.
"""

from __future__ import annotations

from array import array
from itertools import islice, repeat
from typing import Any

from ext_proc.estimate.chain import Extras, keyed_block
from ext_proc.estimate.kv_groups import KvGroup, holder_bit
from ext_proc.feeds.kv_events import BlockStored

# Pages under this many tokens are keyed coarser (per-token hashing is what costs).
FINE_BLOCK_TOKENS = 16
# The coarse granule: a prediction undercounts by less than this (32 tokens is ~1.5 % of
# a 2k-token prompt; 1k hashes for a 32k-token one).
COARSE_TOKENS = 32
# Re-stored pages compared with what they stood for before, per store (one differing
# shows hashes that are not chained; comparing a 32k-page host copy whole would cost).
REUSE_SAMPLES = 4


def key_tokens_for(block_size: int) -> int:
    """The granule the router keys a group of this block size at."""
    if block_size >= FINE_BLOCK_TOKENS:
        return block_size
    return block_size * -(-COARSE_TOKENS // block_size)


def make_group(block_size: int, kind: str | None, window_tokens: int | None) -> KvGroup:
    if key_tokens_for(block_size) == block_size:
        return KvGroup(block_size, kind, window_tokens)
    return CoarseGroup(block_size, kind, window_tokens, key_tokens_for(block_size))


class _Run:
    """One store's pages: `buf` the tokens since the parent's last coarse key (packed as
    the request side packs them) then the store's; `anchors` the coarse key before the
    run, then each one it completes; `index` each page's place."""

    __slots__ = ("anchors", "buf", "first", "granule", "index", "page")

    def __init__(self, anchor: int, partial: bytes, packed: bytes, page: int, granule: int):
        self.buf = partial + packed
        self.first = len(partial) // 8  # tokens before the run's first page
        self.page, self.granule = page, granule
        g8 = 8 * granule
        self.anchors = [anchor]
        for end in range(g8, len(self.buf) + 1, g8):
            self.anchors.append(hash((self.anchors[-1], self.buf[end - g8 : end])))
        self.index: dict[int, int] = {}

    def state(self, i: int) -> tuple[int, bytes]:
        """The coarse key page i extends and its tokens since (b"": it completed it)."""
        end = self.first + (i + 1) * self.page
        done = end // self.granule
        return self.anchors[done], self.buf[8 * done * self.granule : 8 * end]

    def completes(self, i: int) -> int | None:
        end = self.first + (i + 1) * self.page
        return None if end % self.granule else self.anchors[end // self.granule]


class CoarseGroup(KvGroup):
    """A group of small pages, keyed every `key_tokens` (see the module's docstring)."""

    def _key_of(self, h: int, page: Any) -> int | None:
        return page.completes(page.index[h])  # type: ignore[no-any-return]

    def _state(self, rank: int, h: int) -> tuple[int, bytes] | None:
        run = self._page(rank, h)
        return None if run is None else run.state(run.index[h])

    def store(self, rank: int, e: BlockStored, seed: int, extras: list[Extras] | None) -> int:
        if e.parent_block_hash is None:
            parent: tuple[int, bytes] | None = (seed, b"")
        else:
            parent = self._state(rank, e.parent_block_hash)
        if parent is None:
            return -1 if not self.add_medium(rank, e) else 0
        anchor, partial = parent
        if extras is not None:
            # multimodal pages (SGLang publishes none): unmatchable from the run's start
            anchor = keyed_block(anchor, partial, tuple(extras))
        run = _Run(
            anchor, partial, array("q", e.token_ids).tobytes(), self.block_size, self.key_tokens
        )
        hashes, index = e.block_hashes, run.index
        index.update(zip(hashes, range(len(hashes)), strict=True))
        pages = self._pages.setdefault(rank, {})
        # a few of the pages stored before (a host copy, a split): under the same key?
        known = list(islice(pages.keys() & index.keys(), REUSE_SAMPLES))
        reused = sum(1 for h in known if self._state(rank, h) != run.state(index[h]))
        pages.update(zip(hashes, repeat(run)))
        retired = self._retired.get(rank)
        if retired:
            for h in hashes:
                retired.pop(h, None)
        bit, held = holder_bit(rank, e.medium), self.held
        skip = -(run.first + self.block_size) % self.key_tokens // self.block_size
        for i in range(skip, len(hashes), self.key_tokens // self.block_size):
            key = run.completes(i)
            if key is not None:
                held[key] = held.get(key, 0) | bit
        return reused
