"""The rivals' text tree stand-in: match rate over the prompt's characters, the deepest
node's tenants, LRU eviction shared or per tenant."""

from __future__ import annotations

import pytest

from loadgen.sim.rivals.base import Prompt
from loadgen.sim.rivals.trees import TextTree


def prompt(blocks: list[int], tokens: int | None = None) -> Prompt:
    return Prompt(tuple(blocks), 512, tokens if tokens is not None else 512 * len(blocks), 1, None)


def test_the_match_rate_counts_tokens_and_the_deepest_nodes_tenants() -> None:
    tree = TextTree()
    tree.insert(prompt([1, 2]), "a", 0.0)
    tree.insert(prompt([1, 3]), "b", 1.0)
    m = tree.match(prompt([1, 2, 4], 1300))
    assert m.rate == pytest.approx(1024 / 1300) and m.tenants == {"a"}
    m = tree.match(prompt([1, 5]))
    assert m.rate == 0.5 and m.tenants == {"a", "b"}
    assert tree.match(prompt([9])).rate == 0.0 and not tree.match(prompt([9])).tenants


def test_a_partial_last_block_counts_its_own_tokens() -> None:
    tree = TextTree()
    tree.insert(prompt([1, 2], 600), "a", 0.0)
    assert tree.tenant_chars() == {"a": 600 * 4}


def test_shared_eviction_drops_the_least_recent_first_leaves_before_parents() -> None:
    tree = TextTree()
    tree.insert(prompt([1, 2]), "a", 0.0)
    tree.insert(prompt([3]), "b", 5.0)
    tree.evict(2 * 2048, per_tenant=False)
    # a's leaf (2) went before its root block (1), both stamped 0
    assert tree.match(prompt([1, 2])).rate == 0.5 and tree.match(prompt([3])).rate == 1.0
    tree.evict(0, per_tenant=False)
    assert len(tree) == 0


def test_per_tenant_eviction_leaves_the_others() -> None:
    tree = TextTree()
    tree.insert(prompt([1, 2, 3]), "a", 0.0)
    tree.insert(prompt([1]), "b", 0.0)
    tree.evict(2048, per_tenant=True)
    assert tree.tenant_chars() == {"a": 2048, "b": 2048}
    assert tree.match(prompt([1])).tenants == {"a", "b"}
