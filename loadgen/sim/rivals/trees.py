"""The rivals' own ideas of what each engine caches, built from what they routed.

`TextTree`: SMG's and vllm-router's approximate radix tree over the request text (messages
joined by spaces, characters, not tokens), one per model with a set of tenants (workers)
per node, each tenant stamped when it last used the node; evicted least recently used at an
interval down to a size. The simulator has no text: a trace block stands for its text (an
id names the block and everything before it, as a tree path does), ~4 characters a token
(ext_proc.prompt.tokens.BYTES_PER_TOKEN). So a match is counted in whole trace blocks (512
tokens for the Mooncake trace) where a real character tree matches to the character; the
engines' caches in the simulator are keyed by the same blocks, so no real reuse is missed.

`LruBlocks`: llm-d's approximate prefix index (approx-prefix-cache-producer, indexer.go):
per server an LRU of prompt-block hashes it was sent, and for each hash the servers holding
it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ext_proc.prompt.tokens import BYTES_PER_TOKEN
from loadgen.sim.rivals.base import Prompt


@dataclass
class _Node:
    chars: int
    depth: int
    # tenant -> when it last used this node (virtual seconds)
    tenants: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TreeMatch:
    """A prefix match: the share of the prompt's characters matched, and the tenants of the
    deepest matched node (empty when nothing matched)."""

    rate: float
    tenants: frozenset[str]


class TextTree:
    """One model's approximate text tree (SMG policies/tree.rs, vllm-router src/tree.rs)."""

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}

    def match(self, prompt: Prompt) -> TreeMatch:
        """Walk the prompt down the tree: the matched share of its characters (matched /
        input, as both routers' `match_rate`) and the tenants of the deepest node reached."""
        matched = 0
        tenants: frozenset[str] = frozenset()
        for i, block in enumerate(prompt.blocks):
            node = self._nodes.get(block)
            if node is None:
                break
            matched += prompt.block_len(i)
            tenants = frozenset(node.tenants)
        rate = matched / prompt.input_tokens if prompt.input_tokens else 0.0
        return TreeMatch(rate, tenants)

    def insert(self, prompt: Prompt, tenant: str, now_s: float) -> None:
        """The prompt's text under `tenant`, every node on its path stamped now."""
        for i, block in enumerate(prompt.blocks):
            node = self._nodes.get(block)
            if node is None:
                node = self._nodes[block] = _Node(prompt.block_len(i) * BYTES_PER_TOKEN, i)
            node.tenants[tenant] = now_s

    def tenant_chars(self) -> dict[str, int]:
        """Characters each tenant holds."""
        out: dict[str, int] = {}
        for node in self._nodes.values():
            for t in node.tenants:
                out[t] = out.get(t, 0) + node.chars
        return out

    def evict(self, max_chars: int, per_tenant: bool) -> None:
        """Least recently used first (leaves before their parents at equal stamps) until
        the tree holds at most `max_chars`, counted over all tenants (SMG 1.13: "shared
        across all workers") or per tenant (vllm-router: `evict_tenant_by_size`)."""
        held = self.tenant_chars()
        total = sum(held.values())
        if (max(held.values(), default=0) if per_tenant else total) <= max_chars:
            return
        entries = sorted(
            (stamp, -node.depth, block, tenant)
            for block, node in self._nodes.items()
            for tenant, stamp in node.tenants.items()
        )
        for _, _, block, tenant in entries:
            if per_tenant:
                if held[tenant] <= max_chars:
                    continue
            elif total <= max_chars:
                break
            node = self._nodes[block]
            del node.tenants[tenant]
            held[tenant] -= node.chars
            total -= node.chars
            if not node.tenants:
                del self._nodes[block]

    def __len__(self) -> int:
        return len(self._nodes)


class LruBlocks:
    """llm-d's approximate prefix index: per server an LRU of `capacity` block hashes."""

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per server, how many of the leading blocks it holds (matchLongestPrefix: from
        the first block on, each server holding a block counts it, until a block no server
        holds)."""
        out: dict[str, int] = {}
        for h in hashes:
            servers = self._holders.get(h)
            if not servers:
                break
            for s in servers:
                out[s] = out.get(s, 0) + 1
        return out

    def add(self, hashes: Iterable[int], server: str, capacity: int) -> None:
        """The server was sent these blocks (PreRequest); the least recent go past
        `capacity`."""
        lru = self._lru.setdefault(server, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(server)
                if len(lru) > capacity:
                    old, _ = lru.popitem(last=False)
                    holders = self._holders[old]
                    holders.discard(server)
                    if not holders:
                        del self._holders[old]

    def size(self, server: str) -> int:
        return len(self._lru.get(server, ()))
