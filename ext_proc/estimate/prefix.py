"""Which prompt prefixes a backend probably holds in its KV cache (one `PrefixCache` per
backend, in its record of the fleet).

The router cannot see the engines' caches, so it keeps its own estimate from its own
decisions: a prompt's block hashes are inserted for the chosen backend at dispatch
(optimistically: the prefill will compute them), each backend's share is bounded by a
token capacity mirroring the engine's KV pool (least recently used blocks go first), and a
backend's entries are trimmed when its engine reports fewer cached tokens than predicted.

Storage: a sorted numpy array of block hashes and a parallel array of
recency ticks, 16 bytes per cached block. A lookup is one vectorized binary search over the
whole prompt: no per-block Python work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Hashes = npt.NDArray[np.uint64]


def as_hashes(blocks: Sequence[int]) -> Hashes:
    """Block hashes (Python ints, possibly negative) as the index's uint64 array."""
    return np.array(blocks, dtype=np.int64).view(np.uint64) if blocks else _EMPTY


_EMPTY: Hashes = np.zeros(0, dtype=np.uint64)


def leading_true(hit: npt.NDArray[np.bool_]) -> int:
    """How many leading entries of a boolean array are true."""
    return len(hit) if hit.all() else int(np.argmin(hit))


# Stamp step between consecutive blocks of one prompt: orders them, far below any clock
# difference that matters.
_DEPTH_S = 1e-9


class PrefixCache:
    """One backend's cached blocks, bounded by a token capacity mirroring its engine's KV
    pool (least recently used blocks go first)."""

    __slots__ = ("block_tokens", "capacity_blocks", "keys", "stamps")

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        self.keys: Hashes = _EMPTY
        # When each block was last used (s). Within one prompt deeper blocks get slightly
        # older stamps, so a prefix's tail is evicted before its head.
        self.stamps: npt.NDArray[np.float64] = np.zeros(0, dtype=np.float64)

    def set_capacity(self, capacity_tokens: int) -> None:
        """A new capacity; a smaller one evicts at the next insert (least recent first)."""
        self.capacity_blocks = max(1, capacity_tokens // self.block_tokens)

    def _positions(self, query: Hashes) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        if not len(self.keys):
            return np.zeros(len(query), dtype=np.intp), np.zeros(len(query), dtype=bool)
        # the array's own methods: numpy's module functions add a wrapper call each, and
        # this runs per backend per request
        pos = self.keys.searchsorted(query)
        np.minimum(pos, len(self.keys) - 1, out=pos)
        return pos, self.keys[pos] == query

    def _keep(self, mask: npt.NDArray[np.bool_]) -> None:
        self.keys, self.stamps = self.keys[mask], self.stamps[mask]

    def match(self, blocks: Hashes) -> int:
        """How many leading blocks of the prompt it holds."""
        n = len(self.keys)
        if not len(blocks) or not n:
            return 0
        # Most backends do not hold a given prompt at all: one scalar probe settles it.
        first = blocks[0]
        i = int(self.keys.searchsorted(first))
        if i < n and self.keys[i] == first:
            return leading_true(self._positions(blocks)[1])
        return 0

    def last_used_s(self, blocks: Hashes) -> npt.NDArray[np.float64]:
        """When it last used each of these blocks (held ones only, in order)."""
        pos, hit = self._positions(blocks)
        return self.stamps[pos[: leading_true(hit)]]

    def insert(self, blocks: Hashes, now_s: float) -> None:
        """A prompt was dispatched here: it will hold these blocks."""
        if not len(blocks):
            return
        stamps = now_s - _DEPTH_S * np.arange(len(blocks), dtype=np.float64)
        pos, hit = self._positions(blocks)
        self.stamps[pos[hit]] = stamps[hit]  # touch what is already there
        new = ~hit
        if new.any():
            keys = np.concatenate([self.keys, blocks[new]])
            all_stamps = np.concatenate([self.stamps, stamps[new]])
            self.keys, first = np.unique(keys, return_index=True)  # sorted, no duplicates
            self.stamps = all_stamps[first]
        over = len(self.keys) - self.capacity_blocks
        if over > 0:  # least recently used first
            keep = np.ones(len(self.keys), dtype=bool)
            keep[np.argpartition(self.stamps, over - 1)[:over]] = False
            self._keep(keep)

    def forget(self, blocks: Hashes, used_at_s: float) -> int:
        """A dispatch that inserted these blocks at used_at_s never reached a prefill (the
        engine refused the request, or it went elsewhere): drop those not used since.
        Returns how many."""
        pos, hit = self._positions(blocks)
        stale = np.zeros(len(self.keys), dtype=bool)
        stale[pos[hit]] = self.stamps[pos[hit]] <= used_at_s
        self._keep(~stale)
        return int(stale.sum())

    def trim(self, used_before_s: float) -> int:
        """The engine no longer had a block last used at used_before_s: an LRU cache
        evicts older blocks first, so drop every block not used since. Returns how many."""
        stale = self.stamps <= used_before_s
        self._keep(~stale)
        return int(stale.sum())

    @property
    def size_blocks(self) -> int:
        return len(self.keys)

    @property
    def memory_bytes(self) -> int:
        return self.keys.nbytes + self.stamps.nbytes
