"""Which prompt prefixes each backend probably holds in its KV cache.

The router cannot see the engines' caches, so it keeps its own estimate from its own
decisions: a prompt's block hashes are inserted for the chosen backend at dispatch
(optimistically: the prefill will compute them), each backend's share is bounded by a
token capacity mirroring the engine's KV pool (least recently used blocks go first), and a
backend's entries are trimmed when its engine reports fewer cached tokens than predicted.

Storage per backend: a sorted numpy array of block hashes and a parallel array of
recency ticks, 16 bytes per cached block. A lookup is one vectorized binary search per
backend over the whole prompt: no per-block Python work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

Hashes = npt.NDArray[np.uint64]


def as_hashes(blocks: Sequence[int]) -> Hashes:
    """Block hashes (Python ints, possibly negative) as the index's uint64 array."""
    return np.array(blocks, dtype=np.int64).view(np.uint64) if blocks else _EMPTY


_EMPTY: Hashes = np.zeros(0, dtype=np.uint64)


class _BackendBlocks:
    __slots__ = ("keys", "stamps")

    def __init__(self) -> None:
        self.keys: Hashes = _EMPTY
        # When each block was last used (s). Within one prompt deeper blocks get slightly
        # older stamps, so a prefix's tail is evicted before its head.
        self.stamps: npt.NDArray[np.float64] = np.zeros(0, dtype=np.float64)

    def positions(self, query: Hashes) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        if not len(self.keys):
            return np.zeros(len(query), dtype=np.intp), np.zeros(len(query), dtype=bool)
        pos = np.searchsorted(self.keys, query)
        pos = np.minimum(pos, len(self.keys) - 1)
        return pos, self.keys[pos] == query

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        self.keys, self.stamps = self.keys[mask], self.stamps[mask]


def _leading_true(hit: npt.NDArray[np.bool_]) -> int:
    return len(hit) if hit.all() else int(np.argmin(hit))


# Stamp step between consecutive blocks of one prompt: orders them, far below any clock
# difference that matters.
_DEPTH_S = 1e-9


class PrefixIndex:
    def __init__(self, backend_capacity_tokens: dict[str, int], block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = {
            b: max(1, c // block_tokens) for b, c in backend_capacity_tokens.items()
        }
        self._backends = {b: _BackendBlocks() for b in backend_capacity_tokens}

    def add_backend(self, backend: str, capacity_tokens: int) -> None:
        """A new backend, holding nothing yet (a known one starts empty again)."""
        self.capacity_blocks[backend] = max(1, capacity_tokens // self.block_tokens)
        self._backends[backend] = _BackendBlocks()

    def set_capacity(self, backend: str, capacity_tokens: int) -> None:
        """A new capacity; a smaller one evicts at the next insert (least recent first)."""
        self.capacity_blocks[backend] = max(1, capacity_tokens // self.block_tokens)

    def remove_backend(self, backend: str) -> None:
        self.capacity_blocks.pop(backend, None)
        self._backends.pop(backend, None)

    def match(self, blocks: Hashes) -> dict[str, int]:
        """Per backend, how many leading blocks of the prompt it holds (one pass each)."""
        if not len(blocks):
            return dict.fromkeys(self._backends, 0)
        out = {}
        for b, s in self._backends.items():
            # Most backends do not hold a given prompt at all: one scalar probe settles it.
            n = len(s.keys)
            i = int(np.searchsorted(s.keys, blocks[0])) if n else 0
            out[b] = (
                _leading_true(s.positions(blocks)[1]) if i < n and s.keys[i] == blocks[0] else 0
            )
        return out

    def last_used_s(self, backend: str, blocks: Hashes) -> npt.NDArray[np.float64]:
        """When backend last used each of these blocks (held ones only, in order)."""
        s = self._backends[backend]
        pos, hit = s.positions(blocks)
        return s.stamps[pos[: _leading_true(hit)]]

    def insert(self, backend: str, blocks: Hashes, now_s: float) -> None:
        """The prompt was dispatched to backend: it will hold these blocks."""
        if not len(blocks):
            return
        s = self._backends[backend]
        stamps = now_s - _DEPTH_S * np.arange(len(blocks), dtype=np.float64)
        pos, hit = s.positions(blocks)
        s.stamps[pos[hit]] = stamps[hit]  # touch what is already there
        new = ~hit
        if new.any():
            keys = np.concatenate([s.keys, blocks[new]])
            all_stamps = np.concatenate([s.stamps, stamps[new]])
            s.keys, first = np.unique(keys, return_index=True)  # sorted, no duplicates
            s.stamps = all_stamps[first]
        over = len(s.keys) - self.capacity_blocks[backend]
        if over > 0:  # least recently used first
            keep = np.ones(len(s.keys), dtype=bool)
            keep[np.argpartition(s.stamps, over - 1)[:over]] = False
            s.keep(keep)

    def trim(self, backend: str, used_before_s: float) -> int:
        """The engine no longer had a block last used at used_before_s: an LRU cache
        evicts older blocks first, so drop every block not used since. Returns how many."""
        s = self._backends[backend]
        stale = s.stamps <= used_before_s
        s.keep(~stale)
        return int(stale.sum())

    def size_blocks(self, backend: str) -> int:
        return len(self._backends[backend].keys)

    def memory_bytes(self) -> int:
        return sum(s.keys.nbytes + s.stamps.nbytes for s in self._backends.values())

    def backends(self) -> Iterable[str]:
        return self._backends.keys()
