"""The engine model's radix prefix cache over chained block hashes (emulator/engine/model/
uses it; the engine's KV events are what it records)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class _Node:
    parent: int | None
    children: int = 0
    refs: int = 0
    last_used_s: float = 0.0


class PrefixCache:
    """Blocks keyed by chained hash (a hash names a block *and* its whole prefix), so the
    dict is a radix tree over blocks: a node's parent is the block before it."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.nodes: dict[int, _Node] = {}
        # When not None, what changes is recorded here in order, for the engine's KV
        # events: ("stored", hash, parent), ("removed", hash), ("cleared",).
        self.events: list[tuple[Any, ...]] | None = None
        # Eviction candidates (unpinned leaves), oldest first; stale entries are skipped.
        self._lru: list[tuple[float, int, int]] = []
        self._seq = 0
        # Nodes some request holds (refs > 0), kept as they change: the evictable count
        # is read at every load poll (a rival router's scrape every 50 ms in the simulator).
        self._pinned = 0

    @property
    def tokens(self) -> int:
        return len(self.nodes) * self.block_tokens

    @property
    def evictable_tokens(self) -> int:
        return (len(self.nodes) - self._pinned) * self.block_tokens

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks are cached."""
        n = 0
        for h in blocks:
            if h not in self.nodes:
                break
            n += 1
        return n

    def acquire(self, blocks: Sequence[int], now_s: float, parent: int | None = None) -> None:
        """Insert what is missing and pin the path (a request is using it). `blocks`
        continue the path after `parent` (None: from the root)."""
        for h in blocks:
            node = self.nodes.get(h)
            if node is None:
                node = _Node(parent)
                self.nodes[h] = node
                if parent is not None:
                    self.nodes[parent].children += 1
                if self.events is not None:
                    self.events.append(("stored", h, parent))
            if not node.refs:
                self._pinned += 1
            node.refs += 1
            node.last_used_s = now_s
            parent = h

    def release(self, blocks: Sequence[int], now_s: float) -> None:
        for h in blocks:
            node = self.nodes.get(h)
            if node is None:
                continue
            node.refs -= 1
            if not node.refs:
                self._pinned -= 1
            node.last_used_s = now_s
            self._maybe_candidate(h, node)

    def evict(self, need_tokens: int) -> int:
        """Evict unpinned leaves, least recently used first, until need_tokens are freed
        or nothing more can go. Returns tokens freed."""
        freed = 0
        while freed < need_tokens and self._lru:
            last_used_s, _, h = heapq.heappop(self._lru)
            node = self.nodes.get(h)
            if node is None or node.refs or node.children or node.last_used_s != last_used_s:
                continue  # stale entry
            del self.nodes[h]
            freed += self.block_tokens
            if self.events is not None:
                self.events.append(("removed", h))
            if node.parent is not None:
                parent = self.nodes[node.parent]
                parent.children -= 1
                self._maybe_candidate(node.parent, parent)
        return freed

    def clear_unpinned(self) -> int:
        mark = None if self.events is None else len(self.events)
        freed = 0
        while True:
            got = self.evict(len(self.nodes) * self.block_tokens or 1)
            freed += got
            if not got:
                break
        if mark is not None and self.events is not None and not self.nodes:
            del self.events[mark:]  # everything went: one event says so
            self.events.append(("cleared",))
        return freed

    def _maybe_candidate(self, h: int, node: _Node) -> None:
        if node.refs == 0 and node.children == 0:
            self._seq += 1
            heapq.heappush(self._lru, (node.last_used_s, self._seq, h))
