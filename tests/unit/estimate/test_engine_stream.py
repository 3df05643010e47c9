"""How far an engine's KV-event stream is trusted (warm, unsupported, unknown parents), and
small pages keyed every granule."""

import random

import pytest

from ext_proc.estimate.engine_index import EngineBlocks, chain_keys
from ext_proc.estimate.kv_coarse import COARSE_TOKENS
from ext_proc.estimate.stream_health import (
    NO_PARENTS,
    REUSED_HASHES,
    UNSUPPORTED_MIN_STORES,
    WARM_AGREEMENTS,
)
from ext_proc.feeds.kv_events import BlockRemoved, BlockStored, EventBatch, KvEvent

BS = 16
TOKENS = list(range(100, 164))


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = BS) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, "GPU")


def batch(seq: int, *events: KvEvent, rank: int | None = 0) -> EventBatch:
    return EventBatch("", seq, 1000.0 + seq, tuple(events), rank)


def test_a_stream_first_heard_mid_way_is_warming_until_its_predictions_agree() -> None:
    e = EngineBlocks()
    assert e.history_complete  # nothing heard yet: taken as fresh
    # vLLM published the parent once, before the router listened (block_pool.py)
    e.apply(batch(7, stored([12], 11, TOKENS[16:32])))
    assert not e.history_complete
    h = e.health
    assert (h.unknown_parents, h.unknown_parent_blocks) == (1, 1)
    assert h.recent_unknown_parents(1007.0) == 1 and h.recent_unknown_parents(1007.0 + 61) == 0
    e.expect("nothing", 0)
    e.settle("nothing", 0)  # both 0: says nothing either way
    for i in range(WARM_AGREEMENTS):
        assert not e.history_complete and h.agreements == i
        e.expect(f"r{i}", 32)
        e.settle(f"r{i}", 32 + 10)  # within one block
    assert e.history_complete
    e.apply(batch(8, stored([14], 13, TOKENS[48:64])))  # still counted once warm
    assert h.unknown_parents == 2 and e.history_complete


def test_a_disagreement_starts_the_count_again() -> None:
    e = EngineBlocks()
    e.apply(batch(3, stored([11], None, TOKENS[:16])))
    for rid, expected, reported in (("a", 16, 16), ("b", 16, 16), ("c", 0, 48), ("d", 16, 16)):
        e.expect(rid, expected)
        e.settle(rid, reported)
    assert e.health.agreements == 1 and not e.history_complete
    e.settle("never-expected", 16)  # a request sent while not warming, or twice
    assert e.health.agreements == 1


def test_a_stream_from_seq_0_on_every_rank_starts_complete() -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored([11], None, TOKENS[:16]), rank=0))
    e.apply(batch(0, stored([21], None, TOKENS[:16]), rank=1))
    assert e.history_complete
    e.apply(batch(4, stored([31], None, TOKENS[:16]), rank=2))  # a rank first heard late
    assert not e.history_complete
    e.reset()  # events lost: history lost
    e.apply(batch(9, stored([41], None, TOKENS[:16])))
    assert not e.history_complete


def test_unchained_pages_are_an_unsupported_stream() -> None:
    e = EngineBlocks()
    # SGLang before its events were chained: one page an event, never a parent
    for i in range(UNSUPPORTED_MIN_STORES):
        assert e.unsupported is None
        start = i % 4 * 16
        e.apply(batch(i, stored([1000 + i], None, TOKENS[start : start + 16])))
    assert e.unsupported == NO_PARENTS
    e.reset()  # a restart may be an upgrade
    assert e.unsupported is None


def test_hashes_of_page_contents_alone_are_an_unsupported_stream() -> None:
    """Content-only hashes: the same page under two prefixes is one hash twice."""
    e = EngineBlocks()
    shared = TOKENS[48:64]
    for i in range(UNSUPPORTED_MIN_STORES):
        head = [i] * 16
        e.apply(batch(i, stored([5000 + i], None, head), stored([77], 5000 + i, shared)))
    assert e.unsupported == REUSED_HASHES


def test_a_chained_stream_is_supported() -> None:
    e = EngineBlocks()
    for i in range(UNSUPPORTED_MIN_STORES):
        parent = None if i == 0 else i
        start = i % 4 * 16
        e.apply(batch(i, stored([i + 1], parent, TOKENS[start : start + 16])))
    assert e.unsupported is None and e.health.stores == UNSUPPORTED_MIN_STORES


IDS = list(range(1, 101))  # 100 tokens, SGLang's page size 1


def one_a_page(ids: list[int], first_hash: int = 1, parent: int | None = None) -> list[KvEvent]:
    events: list[KvEvent] = []
    for i, t in enumerate(ids):
        events.append(stored([first_hash + i], parent, [t], size=1))
        parent = first_hash + i
    return events


def test_small_pages_are_keyed_every_granule() -> None:
    coalesced = EngineBlocks()
    coalesced.apply(batch(0, stored(IDS, None, IDS, size=1)))
    assert coalesced.key_sizes == (COARSE_TOKENS,) and coalesced.block_size == 1
    keys = chain_keys(IDS, COARSE_TOKENS)
    assert coalesced.cached_tokens(keys, max_tokens=99) == 96 and coalesced.blocks == 3
    e = EngineBlocks()
    e.apply(batch(0, *one_a_page(IDS)))  # the same pages, one event each
    assert e.cached_tokens(keys, max_tokens=99) == 96
    # another prompt sharing the first 70 tokens continues from inside a granule
    other = [*IDS[:70], *range(500, 530)]
    e.apply(batch(1, *one_a_page(other[70:], first_hash=200, parent=70)))
    assert e.cached_tokens(chain_keys(other, COARSE_TOKENS), max_tokens=99) == 96
    # SGLang evicts leaves first: the page completing a granule takes the granule along
    e.apply(batch(2, BlockRemoved(tuple(range(100, 96, -1)))))
    assert e.cached_tokens(keys, max_tokens=99) == 96
    e.apply(batch(3, BlockRemoved((96,))))
    assert e.cached_tokens(keys, max_tokens=99) == 64
    assert e.cached_tokens(chain_keys(other, COARSE_TOKENS), max_tokens=99) == 96


@pytest.mark.parametrize("size", [1, 8, 16])
def test_the_granule_is_the_block_size_from_16_tokens(size: int) -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored(list(range(1, 64 // size + 1)), None, TOKENS, size=size)))
    assert e.key_sizes == ((COARSE_TOKENS,) if size < 16 else (size,))
    assert e.cached_tokens(chain_keys(TOKENS, e.key_sizes[0])) == 64


@pytest.mark.parametrize("page", [1, 4])
def test_a_chain_split_anywhere_keys_as_the_whole_prompt(page: int) -> None:
    """Whatever events a chain of pages arrives in, and wherever a branch leaves it, the
    granule keys are those of the whole prompt."""
    rng = random.Random(page)
    for _ in range(20):
        ids = [rng.randrange(50_000) for _ in range(page * rng.randrange(20, 60))]
        e, start, seq = EngineBlocks(), 0, 0
        pages = len(ids) // page
        while start < pages:
            n = rng.randrange(1, 12)
            hashes = list(range(start + 1, min(start + n, pages) + 1))
            tokens = ids[start * page : (start + len(hashes)) * page]
            e.apply(batch(seq, stored(hashes, start or None, tokens, size=page)))
            start, seq = start + len(hashes), seq + 1
        whole = len(ids) // COARSE_TOKENS * COARSE_TOKENS
        assert e.cached_tokens(chain_keys(ids, COARSE_TOKENS)) == whole
        # a branch off any page: the shared part, then its own tokens
        at = rng.randrange(1, pages)
        tail = [rng.randrange(50_000, 60_000) for _ in range(page * 20)]
        own = list(range(10_000, 10_020))
        e.apply(batch(seq, stored(own, at, tail, size=page)))
        branch = ids[: at * page] + tail
        expected = len(branch) // COARSE_TOKENS * COARSE_TOKENS
        assert e.cached_tokens(chain_keys(branch, COARSE_TOKENS)) == expected


def test_a_stream_whose_stores_all_find_their_parents_for_a_minute_warms_without_reports() -> None:
    """The live router hears no engine reports: stores under known parents for a minute
    of the engine's time mean the blind spot no longer touches the traffic."""
    from ext_proc.estimate.stream_health import QUIET_STORES, UNKNOWN_RECENT_S

    e = EngineBlocks()
    ts0 = 2000.0

    def store(seq: int, ts: float, parent: int | None, h: int) -> None:
        e.apply(EventBatch("", seq, ts, (stored([h], parent, TOKENS[:16]),), 0))

    store(5, ts0, 77, 1)  # heard mid-way, under a parent cached before the router listened
    assert not e.history_complete
    step_s = UNKNOWN_RECENT_S / QUIET_STORES
    for i in range(QUIET_STORES):  # fresh prompts: each chain starts at its root
        store(6 + i, ts0 + 1 + i * step_s / 2, None, 100 + i)
    assert not e.history_complete  # enough stores, but only half a minute of them
    store(6 + QUIET_STORES, ts0 + 2 + UNKNOWN_RECENT_S / 2, 99, 500)  # another blind reuse
    seq = 7 + QUIET_STORES
    for i in range(QUIET_STORES):  # a minute of stores since that one, all placed
        assert not e.history_complete
        store(seq + i, ts0 + 3 + UNKNOWN_RECENT_S / 2 + i * step_s * 1.01, None, 1000 + i)
    assert e.history_complete
