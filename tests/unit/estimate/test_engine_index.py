"""The router's view of what an engine holds, from its KV events."""

from ext_proc.estimate.engine_index import EngineBlocks, chain_keys
from ext_proc.feeds.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)
from ext_proc.prompt.tokens import APPROX
from ext_proc.vocab.types import Status
from tests.builders import chat, make_router

BS = 16


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str | None = "GPU"
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium)


def batch(seq: int, *events: KvEvent, rank: int | None = 0, part: int = 0) -> EventBatch:
    return EventBatch("", seq, 1000.0 + seq, tuple(events), rank, part)


TOKENS = list(range(100, 164))  # four blocks of 16
KEYS = chain_keys(TOKENS, BS)


def test_stores_chain_by_token_ids_and_removals_apply_by_engine_hash() -> None:
    e = EngineBlocks()
    # two events: the first two blocks, then two more continuing from the second
    e.apply(batch(0, stored([11, 12], None, TOKENS[:32])))
    e.apply(batch(1, stored([13, 14], 12, TOKENS[32:64])))
    assert e.blocks == 4 and e.cached_tokens(KEYS) == 64
    assert e.cached_tokens(chain_keys([*TOKENS[:32], *[0] * 32], BS)) == 32  # diverges after 2
    e.apply(batch(2, BlockRemoved((13,))))  # the engine evicted the third block
    assert e.cached_tokens(KEYS) == 32  # the fourth is unreachable without the third
    e.apply(batch(3, AllBlocksCleared()))
    assert e.blocks == 0 and e.cached_tokens(KEYS) == 0


def test_the_same_tokens_under_another_prefix_do_not_match() -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored([1], None, [9] * 16), stored([2], 1, TOKENS[:16])))
    assert e.cached_tokens(chain_keys(TOKENS[:16], BS)) == 0  # a prefix, not a bag of blocks


def test_a_gap_is_not_applied_and_a_restart_resets() -> None:
    e = EngineBlocks()
    assert not e.apply(batch(0, stored([11], None, TOKENS[:16]))).gap
    lost = e.apply(batch(2, stored([12], 11, TOKENS[16:32])))  # seq 1 never arrived
    assert lost.gap and e.blocks == 1 and e.gaps == 1 and e.last_seq == 0
    again = e.apply(batch(0, stored([21], None, TOKENS[:16])))  # seq back to 0: a restart
    assert again.restarted and e.resets == 1 and e.blocks == 1 and e.last_seq == 0


def test_an_unknown_parent_is_counted_not_guessed() -> None:
    e = EngineBlocks()
    assert e.apply(batch(0, stored([12], 11, TOKENS[16:32]))).unknown_parents == 1
    assert e.blocks == 0


def test_each_dp_rank_counts_its_own_sequence() -> None:
    """One publisher per DP rank, each from 0 (SGLang disaggregation/kv_events.py): one
    rank's numbers are neither a restart nor a gap of another's."""
    e = EngineBlocks()
    e.apply(batch(5, stored([11], None, TOKENS[:16]), rank=0))
    other = e.apply(batch(2, stored([21], None, TOKENS[:16]), rank=1))
    assert not other.restarted and not other.gap
    assert not e.apply(batch(6, stored([12], 11, TOKENS[16:32]), rank=0)).restarted
    assert e.resets == 0 and e.gaps == 0
    assert (e.last_seq_of(0), e.last_seq_of(None), e.last_seq_of(1)) == (6, 6, 2)
    lost = e.apply(batch(4, stored([22], 21, TOKENS[16:32]), rank=1))  # rank 1 lost seq 3
    assert lost.gap and e.gaps == 1 and e.last_seq_of(1) == 2 and e.last_seq_of(0) == 6
    assert e.cached_tokens(KEYS) == 32  # rank 0's blocks stand
    # a rank that restarts forgets its own blocks only
    assert e.apply(batch(0, rank=1)).restarted and e.resets == 1
    assert e.cached_tokens(KEYS) == 32 and e.last_seq_of(0) == 6


def test_one_rank_evicting_a_block_leaves_another_ranks_copy() -> None:
    # SGLang's page hashes are the same on every rank (mem_cache/utils.py): two DP ranks
    # caching one prompt publish the same hashes, each for its own cache
    e = EngineBlocks()
    e.apply(batch(0, stored([11, 12], None, TOKENS[:32]), rank=0))
    e.apply(batch(0, stored([11, 12], None, TOKENS[:32]), rank=1))
    e.apply(batch(1, BlockRemoved((12,)), rank=1))
    assert e.cached_tokens(KEYS) == 32
    e.apply(batch(1, BlockRemoved((12,)), rank=0))
    assert e.cached_tokens(KEYS) == 16


def test_a_later_part_continues_its_batch() -> None:
    e = EngineBlocks()
    e.apply(batch(3, stored([11], None, TOKENS[:16])))
    rest = e.apply(batch(3, stored([12], 11, TOKENS[16:32]), part=1))
    assert not rest.restarted and not rest.gap and e.resets == 0
    assert e.cached_tokens(KEYS) == 32
    # the rest of a batch whose first part was refused (a gap) is refused too
    assert e.apply(batch(5, stored([13], 12, TOKENS[32:48]))).gap
    e.apply(batch(5, stored([14], 13, TOKENS[48:64]), part=1))
    assert e.cached_tokens(KEYS) == 32 and e.last_seq_of(0) == 3


def test_a_block_weighs_as_its_best_medium_and_each_medium_goes_alone() -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored([11, 12], None, TOKENS[:32])))
    # HiCache backs the node up to the host: it is still on the GPU (hiradix_cache.py)
    e.apply(batch(1, stored([11, 12], None, TOKENS[:32], "CPU")))
    assert e.cached_tokens(KEYS) == 32
    # the GPU copy of the second block is evicted; the host still holds it
    e.apply(batch(2, BlockRemoved((12,), "GPU")))
    assert e.cached_tokens(KEYS) == 16 + 0.5 * 16
    e.apply(batch(3, BlockRemoved((12,), "CPU")))
    assert e.cached_tokens(KEYS) == 16
    e.apply(batch(4, BlockRemoved((11,), None)))  # no medium said: the device
    assert e.cached_tokens(KEYS) == 0.5 * 16 and e.blocks == 1


def test_a_store_without_tokens_adds_its_medium_to_known_blocks() -> None:
    # vLLM's CPU offload may publish a stored block without its token ids
    # (v1/simple_kv_offload/manager.py): the router knows the hash already
    e = EngineBlocks()
    e.apply(batch(0, stored([11, 12], None, TOKENS[:32])))
    e.apply(batch(1, BlockStored((12,), None, (), BS, "CPU")))
    e.apply(batch(2, BlockRemoved((12,), "GPU")))
    assert e.cached_tokens(KEYS) == 16 + 0.5 * 16 and e.skipped_stores == 1


def group(hashes: list[int], tokens: list[int], size: int, idx: int, kind: str) -> BlockStored:
    return BlockStored(
        tuple(hashes), None, tuple(tokens), size, "GPU", group_idx=idx, spec_kind=kind
    )


def test_kv_cache_groups_keep_their_own_block_size() -> None:
    """A hybrid model (vLLM): full attention in 16-token blocks, Mamba state every 32
    tokens. A hit needs both: attention from the start, the state at the hit's end."""
    e = EngineBlocks()
    e.apply(
        batch(
            0,
            group([1, 2], TOKENS[:32], 16, 0, "full_attention"),
            group([9], TOKENS[:32], 32, 1, "mamba"),
        )
    )
    keys = {16: chain_keys(TOKENS[:33], 16), 32: chain_keys(TOKENS[:33], 32)}
    assert e.key_sizes == (16, 32) and e.block_size == 16
    assert e.cached_tokens(keys, max_tokens=32) == 32
    e.apply(batch(1, BlockRemoved((9,), group_idx=1)))  # the state evicted: nothing resumes
    assert e.cached_tokens(keys, max_tokens=32) == 0
    assert e.cached_tokens(keys[16]) == 0 and e.blocks == 2


def test_a_sliding_window_group_hits_where_its_window_is_held() -> None:
    # vLLM keys both groups' blocks with the same hashes; removals name their group
    e = EngineBlocks()
    e.apply(
        batch(
            0,
            group([1, 2, 3, 4], TOKENS, 16, 0, "full_attention"),
            group([1, 2, 3, 4], TOKENS, 16, 1, "sliding_window"),
        )
    )
    keys = chain_keys([*TOKENS, 0], 16)
    assert e.cached_tokens(keys, 64) == 64
    # blocks that slid out of the window are freed first, then evicted
    e.apply(batch(1, BlockRemoved((1, 2), group_idx=1)))
    assert e.cached_tokens(keys, 64) == 64
    e.apply(batch(2, BlockRemoved((4,), group_idx=1)))  # the window ends at block 3 now
    assert e.cached_tokens(keys, 64) == 48


def test_an_adapters_blocks_match_only_that_adapter() -> None:
    e = EngineBlocks()
    lora = BlockStored(
        (1, 2), None, tuple(TOKENS[:32]), BS, lora_name="sql", extra_keys=(("sql",), ("sql",))
    )
    e.apply(batch(0, lora))
    assert e.lora_names == {"sql"}
    assert e.cached_tokens(chain_keys(TOKENS[:32], BS, e.seed_for("sql", None))) == 32
    for other in ("base-model", "other-adapter", None):  # never named: the base model
        assert e.cached_tokens(chain_keys(TOKENS[:32], BS, e.seed_for(other, None))) == 0
    # a child of an adapter's block is the adapter's too
    e.apply(batch(1, BlockStored((3,), 2, tuple(TOKENS[32:48]), BS, lora_name="sql")))
    assert e.cached_tokens(chain_keys(TOKENS, BS, e.seed_for("sql", None))) == 48


def test_a_salted_chain_matches_only_its_salt() -> None:
    # vLLM: the salt is in the first block's extra keys only (kv_cache_utils.py)
    e = EngineBlocks()
    e.apply(batch(0, BlockStored((1, 2), None, tuple(TOKENS[:32]), BS, extra_keys=(("s1",), None))))
    assert e.cached_tokens(chain_keys(TOKENS[:32], BS, e.seed_for(None, "s1"))) == 32
    assert e.cached_tokens(chain_keys(TOKENS[:32], BS, e.seed_for(None, "s2"))) == 0
    assert e.cached_tokens(chain_keys(TOKENS[:32], BS)) == 0
    # an adapter's salted chain: the name first, then the salt
    e.apply(
        batch(
            1,
            BlockStored(
                (5,), None, tuple(TOKENS[:16]), BS, lora_name="sql", extra_keys=(("sql", "s1"),)
            ),
        )
    )
    assert e.cached_tokens(chain_keys(TOKENS[:16], BS, e.seed_for("sql", "s1"))) == 16


def test_multimodal_blocks_are_stored_but_no_text_request_matches_them() -> None:
    e = EngineBlocks()
    image = BlockStored((1, 2), None, tuple(TOKENS[:32]), BS, extra_keys=((("img", 3),), None))
    e.apply(batch(0, image))
    assert e.blocks == 2 and e.cached_tokens(chain_keys(TOKENS[:32], BS)) == 0


def test_the_simulators_keyed_changes_still_apply() -> None:
    e = EngineBlocks()
    e.apply_keyed(4, [("stored", 7, None), ("stored", 8, 7), ("removed", 8)])
    assert e.cached_tokens([7, 8]) == 4 and e.key_sizes == (4,)
    e.apply_keyed(4, [("cleared",)])
    assert e.blocks == 0


def test_the_router_uses_the_engines_state_while_its_stream_is_up() -> None:
    backends = [
        {"id": b, "address": f"127.0.0.1:{i + 1}", "kv_events": {"endpoint": f"tcp://*:{5557 + i}"}}
        for i, b in enumerate(("a", "b", "c"))
    ]
    r, clock = make_router("gorgo", backends=backends)
    req = chat("a long shared document " * 200)
    assert req.llm is not None and isinstance(req.llm.prompts[0], str)
    ids = APPROX.ids(req.llm.prompts[0])
    n_blocks = (len(ids) - 1) // 64
    # engine b reports holding the prompt's blocks (64-token pages)
    hashes = list(range(1, n_blocks + 1))
    r.inputs.apply_kv_events(
        "b",
        EventBatch(
            "",
            0,
            0.0,
            (BlockStored(tuple(hashes), None, tuple(ids[: n_blocks * 64]), 64, "GPU"),),
            0,
        ),
    )
    # stream down: the router's own (empty) estimate stands
    cached = {
        c.backend_id: c.cached_tokens
        for c in r.features.candidates(req, r.features.prompt_blocks(req))
    }
    assert cached == {"a": 0, "b": 0, "c": 0}
    for b in ("a", "b", "c"):
        r.inputs.set_event_stream(b, True)
    cached = {
        c.backend_id: c.cached_tokens
        for c in r.features.candidates(req, r.features.prompt_blocks(req))
    }
    assert cached["b"] == n_blocks * 64 and cached["a"] == cached["c"] == 0
    assert r.snapshot()["backends"]["b"]["prefix_state"] == "precise"
    # a dispatch counts optimistically where it went, until the engine says otherwise
    d = r.decide(chat("another text entirely " * 100))
    r.close(d.request_id, Status.OK)
    other = chat("another text entirely " * 100)
    c = {
        x.backend_id: x.cached_tokens
        for x in r.features.candidates(other, r.features.prompt_blocks(other))
    }
    assert c[d.backend] > 0
    clock.advance(r.cfg.routing.optimistic_ttl_s + 1)  # never confirmed by an event
    c = {
        x.backend_id: x.cached_tokens
        for x in r.features.candidates(other, r.features.prompt_blocks(other))
    }
    assert c[d.backend] == 0
    r.inputs.set_event_stream("b", False)
    assert r.snapshot()["backends"]["b"]["prefix_state"] == "approximate"


def test_packed_token_ids_chain_to_the_same_keys() -> None:
    """A tokenized prompt carries its packed ids; hashing those bytes gives the very keys
    the engine's token_ids give (they must match the engine's blocks)."""
    from ext_proc.prompt.tokens import TokenIds

    ids = [(7 * i * i + 3) % 151_000 for i in range(1000)]
    assert chain_keys(TokenIds(ids), 64) == chain_keys(ids, 64)
    assert len(chain_keys(TokenIds(ids), 64)) == 15
