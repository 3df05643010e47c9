"""Each backend's prefix cache against a brute-force reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.estimate.prefix import PrefixCache, as_hashes

BT = 16


class Reference:
    """Plain dicts: block -> last-used stamp, per backend; LRU with the same tie rule
    (deeper blocks of one prompt are older)."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = caps
        self.blocks: dict[str, dict[int, float]] = {b: {} for b in caps}

    def match(self, prompt: list[int]) -> dict[str, int]:
        out = {}
        for b, held in self.blocks.items():
            n = 0
            while n < len(prompt) and prompt[n] in held:
                n += 1
            out[b] = n
        return out

    def insert(self, b: str, prompt: list[int], now: float) -> None:
        held = self.blocks[b]
        for depth, h in enumerate(prompt):
            held[h] = now - 1e-9 * depth
        while len(held) > self.caps[b] // BT:
            del held[min(held, key=lambda k: held[k])]


def chain(family: int, n: int) -> list[int]:
    return [family * 1000 + i for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.integers(0, 12)),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 30),
)
def test_caches_agree_with_brute_force(ops: list[tuple[str, int, int]], cap_blocks: int) -> None:
    caps = {"a": cap_blocks * BT, "b": 2 * cap_blocks * BT, "c": 5 * BT}
    caches = {b: PrefixCache(cap, BT) for b, cap in caps.items()}
    ref = Reference(caps)
    for step, (backend, family, n) in enumerate(ops):
        prompt = chain(family, n)
        assert {b: c.match(as_hashes(prompt)) for b, c in caches.items()} == ref.match(prompt)
        caches[backend].insert(as_hashes(prompt), float(step))
        ref.insert(backend, prompt, float(step))
        for b in caps:
            assert caches[b].size_blocks == len(ref.blocks[b]) <= caps[b] // BT


def test_a_match_counts_only_the_leading_blocks() -> None:
    cache = PrefixCache(10_000, BT)
    cache.insert(as_hashes(chain(1, 4) + chain(2, 6)), 0.0)
    assert cache.match(as_hashes(chain(1, 10))) == 4
    assert cache.match(as_hashes([])) == 0


def test_trim_drops_blocks_not_used_since() -> None:
    cache = PrefixCache(10_000, BT)
    cache.insert(as_hashes(chain(1, 5)), 1.0)
    cache.insert(as_hashes(chain(2, 5)), 2.0)
    cache.insert(as_hashes(chain(3, 5)), 3.0)
    assert cache.trim(2.0) == 10
    assert cache.match(as_hashes(chain(3, 5))) == 5
    assert cache.match(as_hashes(chain(2, 5))) == 0


def test_a_smaller_capacity_evicts_the_least_recent_at_the_next_insert() -> None:
    cache = PrefixCache(10 * BT, BT)
    cache.insert(as_hashes(chain(1, 5)), 1.0)
    cache.insert(as_hashes(chain(2, 5)), 2.0)
    cache.set_capacity(6 * BT)
    assert cache.size_blocks == 10
    cache.insert(as_hashes(chain(3, 1)), 3.0)
    assert cache.size_blocks == 6
    assert cache.match(as_hashes(chain(1, 5))) == 0 and cache.match(as_hashes(chain(2, 5))) == 5


def test_memory_is_16_bytes_per_block() -> None:
    cache = PrefixCache(1 << 30, BT)
    cache.insert(as_hashes(list(range(5000))), 0.0)
    assert cache.memory_bytes == 16 * 5000


def test_negative_python_hashes_round_trip() -> None:
    cache = PrefixCache(10_000, BT)
    blocks = [-5, 2**63 - 1, -(2**63)]
    cache.insert(as_hashes(blocks), 0.0)
    assert cache.match(as_hashes(blocks)) == 3
    assert as_hashes(blocks).dtype == np.uint64
