"""The router's view of what an engine holds, from its KV events."""

from ext_proc.core.types import Status
from ext_proc.estimate.engine_index import EngineBlocks, chain_keys
from ext_proc.feeds.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ext_proc.prompt.tokens import APPROX
from tests.builders import chat, make_router

BS = 4


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium)


def batch(seq: int, *events: object) -> EventBatch:
    return EventBatch("", seq, 1000.0 + seq, tuple(events), 0)  # type: ignore[arg-type]


TOKENS = list(range(100, 116))  # four blocks of four


def test_stores_chain_by_token_ids_and_removals_apply_by_engine_hash() -> None:
    e = EngineBlocks()
    # two events: the first two blocks, then two more continuing from the second
    e.apply(batch(0, stored([11, 12], None, TOKENS[:8])))
    e.apply(batch(1, stored([13, 14], 12, TOKENS[8:16])))
    keys = chain_keys(TOKENS, BS)
    assert e.blocks == 4 and e.cached_tokens(keys) == 16
    assert e.cached_tokens(chain_keys([*TOKENS[:8], 0, 0, 0, 0], BS)) == 8  # diverges after 2
    e.apply(batch(2, BlockRemoved((13,))))  # the engine evicted the third block
    assert e.cached_tokens(keys) == 8  # the fourth is unreachable without the third
    e.apply(batch(3, AllBlocksCleared()))
    assert e.blocks == 0 and e.cached_tokens(keys) == 0


def test_the_same_tokens_under_another_prefix_do_not_match() -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored([1], None, [9, 9, 9, 9]), stored([2], 1, TOKENS[:4])))
    assert e.cached_tokens(chain_keys(TOKENS[:4], BS)) == 0  # a prefix, not a bag of blocks


def test_a_gap_is_not_applied_and_a_restart_resets() -> None:
    e = EngineBlocks()
    assert not e.apply(batch(0, stored([11], None, TOKENS[:4]))).gap
    lost = e.apply(batch(2, stored([12], 11, TOKENS[4:8])))  # seq 1 never arrived
    assert lost.gap and e.blocks == 1 and e.gaps == 1 and e.last_seq == 0
    again = e.apply(batch(0, stored([21], None, TOKENS[:4])))  # seq back to 0: a restart
    assert again.restarted and e.resets == 1 and e.blocks == 1 and e.last_seq == 0


def test_an_unknown_parent_is_counted_not_guessed() -> None:
    e = EngineBlocks()
    assert e.apply(batch(0, stored([12], 11, TOKENS[4:8]))).unknown_parents == 1
    assert e.blocks == 0


def test_slower_tiers_count_for_less() -> None:
    e = EngineBlocks()
    e.apply(batch(0, stored([11], None, TOKENS[:4]), stored([12], 11, TOKENS[4:8], "CPU")))
    assert e.cached_tokens(chain_keys(TOKENS[:8], BS)) == 4 + 0.5 * 4


def test_the_router_uses_the_engines_state_while_its_stream_is_up() -> None:
    backends = [
        {"id": b, "address": f"127.0.0.1:{i + 1}", "kv_events": {"endpoint": f"tcp://*:{5557 + i}"}}
        for i, b in enumerate(("a", "b", "c"))
    ]
    r, clock = make_router("gorgo", backends=backends)
    req = chat("a long shared document " * 200)
    assert req.llm is not None and isinstance(req.llm.prompts[0], str)
    ids = APPROX.ids(req.llm.prompts[0])
    n_blocks = len(ids) // 64
    # engine b reports holding the prompt's blocks (64-token pages)
    hashes = list(range(1, n_blocks + 1))
    r.apply_kv_events(
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
    cached = {c.backend_id: c.cached_tokens for c in r.candidates(req, r.prompt_blocks(req))}
    assert cached == {"a": 0, "b": 0, "c": 0}
    for b in ("a", "b", "c"):
        r.set_event_stream(b, True)
    cached = {c.backend_id: c.cached_tokens for c in r.candidates(req, r.prompt_blocks(req))}
    assert cached["b"] == n_blocks * 64 and cached["a"] == cached["c"] == 0
    assert r.snapshot()["backends"]["b"]["prefix_state"] == "precise"
    # a dispatch counts optimistically where it went, until the engine says otherwise
    d = r.decide(chat("another text entirely " * 100))
    r.close(d.request_id, Status.OK)
    other = chat("another text entirely " * 100)
    c = {x.backend_id: x.cached_tokens for x in r.candidates(other, r.prompt_blocks(other))}
    assert c[d.backend] > 0
    clock.advance(r.cfg.routing.optimistic_ttl_s + 1)  # never confirmed by an event
    c = {x.backend_id: x.cached_tokens for x in r.candidates(other, r.prompt_blocks(other))}
    assert c[d.backend] == 0
    r.set_event_stream("b", False)
    assert r.snapshot()["backends"]["b"]["prefix_state"] == "approximate"


def test_packed_token_ids_chain_to_the_same_keys() -> None:
    """A tokenized prompt carries its packed ids; hashing those bytes gives the very keys
    the engine's token_ids give (they must match the engine's blocks)."""
    from ext_proc.prompt.tokens import TokenIds

    ids = [(7 * i * i + 3) % 151_000 for i in range(1000)]
    assert chain_keys(TokenIds(ids), 64) == chain_keys(ids, 64)
    assert len(chain_keys(TokenIds(ids), 64)) == 15
