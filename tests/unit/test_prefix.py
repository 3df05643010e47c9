"""The prefix index against a brute-force reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.estimate.prefix import PrefixIndex, as_hashes

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
def test_index_agrees_with_brute_force(ops: list[tuple[str, int, int]], cap_blocks: int) -> None:
    caps = {"a": cap_blocks * BT, "b": 2 * cap_blocks * BT, "c": 5 * BT}
    idx = PrefixIndex(caps, BT)
    ref = Reference(caps)
    for step, (backend, family, n) in enumerate(ops):
        prompt = chain(family, n)
        assert idx.match(as_hashes(prompt)) == ref.match(prompt)
        idx.insert(backend, as_hashes(prompt), float(step))
        ref.insert(backend, prompt, float(step))
        for b in caps:
            assert idx.size_blocks(b) == len(ref.blocks[b]) <= caps[b] // BT


def test_one_lookup_answers_every_backend() -> None:
    idx = PrefixIndex({"a": 10_000, "b": 10_000}, BT)
    idx.insert("a", as_hashes(chain(1, 10)), 0.0)
    idx.insert("b", as_hashes(chain(1, 4) + chain(2, 6)), 0.0)
    assert idx.match(as_hashes(chain(1, 10))) == {"a": 10, "b": 4}


def test_trim_drops_blocks_not_used_since() -> None:
    idx = PrefixIndex({"a": 10_000}, BT)
    idx.insert("a", as_hashes(chain(1, 5)), 1.0)
    idx.insert("a", as_hashes(chain(2, 5)), 2.0)
    idx.insert("a", as_hashes(chain(3, 5)), 3.0)
    assert idx.trim("a", 2.0) == 10
    assert idx.match(as_hashes(chain(3, 5)))["a"] == 5
    assert idx.match(as_hashes(chain(2, 5)))["a"] == 0


def test_memory_is_16_bytes_per_block() -> None:
    idx = PrefixIndex({"a": 1 << 30}, BT)
    idx.insert("a", as_hashes(list(range(5000))), 0.0)
    assert idx.memory_bytes() == 16 * 5000


def test_negative_python_hashes_round_trip() -> None:
    idx = PrefixIndex({"a": 10_000}, BT)
    blocks = [-5, 2**63 - 1, -(2**63)]
    idx.insert("a", as_hashes(blocks), 0.0)
    assert idx.match(as_hashes(blocks)) == {"a": 3}
    assert as_hashes(blocks).dtype == np.uint64
