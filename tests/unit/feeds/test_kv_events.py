"""Decoding the engines' KV events as they put them on the wire: vLLM's maps with their
LoRA, extra-key and KV-cache-group fields, SGLang's tagged arrays and tagged maps, EAGLE's
bigram token ids, malformed events, and long page-size-1 batches decoded in parts."""

import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from ext_proc.config.kv_endpoints import connect_address, subscriber_address
from ext_proc.estimate.engine_index import chain_keys
from ext_proc.feeds.kv_events import (
    SKIP_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    decode_message,
    decode_parts,
    offset_port,
)
from ext_proc.vocab.backend import KvEventsMode
from tests.builders import make_router
from tests.fuzz.runner import CORPORA

CORPUS = CORPORA / "kv_events"
KV_BACKEND = {"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}

VLLM = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def frames(events: list[Any], seq: int = 7, rank: Any = 0, ts: Any = 1.5) -> list[bytes]:
    payload: list[Any] = [ts, events] if rank == "absent" else [ts, events, rank]
    return [b"kv", seq.to_bytes(8, "big", signed=True), msgpack.packb(payload)]


def page_size_1(tokens: list[int], first_hash: int = 1000) -> list[dict[str, Any]]:
    """SGLang at its default page size: one BlockStored per token, each chained to the last."""
    return [
        {
            "type": "BlockStored",
            "block_hashes": [first_hash + i],
            "parent_block_hash": None if i == 0 else first_hash + i - 1,
            "token_ids": [t],
            "block_size": 1,
            "lora_id": None,
            "medium": "GPU",
        }
        for i, t in enumerate(tokens)
    ]


def parts_of(message: list[bytes], max_events: int, dp_rank: int | None = None) -> list[EventBatch]:
    return [p for p in decode_parts(message, max_events, dp_rank) if p is not None]


def test_vllm_fields_are_decoded_from_the_real_engine() -> None:
    row = json.loads((VLLM / "kv_events.jsonl").read_text().splitlines()[0])
    message = [b"", int(row["seq"]).to_bytes(8, "big"), base64.b64decode(row["payload_b64"])]
    (e, *_) = decode_message(message).events
    assert isinstance(e, BlockStored)
    # what the real vLLM sent: one full-attention group, no LoRA, no extra keys per block
    assert (e.group_idx, e.spec_kind, e.lora_name, e.medium) == (0, "full_attention", None, "GPU")
    assert e.extra_keys == (None,) * len(e.block_hashes) and len(e.block_hashes) == 13


def test_vllm_lora_and_extra_keys_per_block() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],  # vLLM's hashes are unsigned 64-bit
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": 3,
        "medium": "CPU",
        "lora_name": "sql-adapter",
        "extra_keys": [["sql-adapter", ["mm-abc", 0]], None],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "group_idx": 1}
    batch = decode_message(frames([stored, removed]))
    assert batch.events == (
        BlockStored(
            (2**64 - 1, 5),
            None,
            (1, 2, 3, 4),
            2,
            "CPU",
            3,
            "sql-adapter",
            (("sql-adapter", ("mm-abc", 0)), None),
            1,
            "sliding_window",
        ),
        BlockRemoved((5,), "CPU", 1),
    )
    assert (batch.seq, batch.ts, batch.dp_rank, batch.skipped) == (7, 1.5, 0, 0)


def test_sglang_tagged_arrays_and_tagged_maps_decode_alike() -> None:
    arrays = [
        ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
        ["BlockStored", [13], 12, [5, 6], 2, None],  # older: no medium
        ["BlockRemoved", [11, 12], "GPU"],
        ["BlockRemoved", [13]],
        ["AllBlocksCleared"],
    ]
    stored = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    names = {"BlockStored": stored, "BlockRemoved": ["block_hashes", "medium"]}
    maps = [
        dict(type=a[0], **dict(zip(names.get(str(a[0]), []), a[1:], strict=False))) for a in arrays
    ]
    expected = (
        BlockStored((11, 12), None, (1, 2, 3, 4), 2, "GPU"),
        BlockStored((13,), 12, (5, 6), 2, None),
        BlockRemoved((11, 12), "GPU"),
        BlockRemoved((13,)),
        AllBlocksCleared(),
    )
    assert decode_message(frames(arrays)).events == expected
    assert decode_message(frames(maps)).events == expected


def test_eagle_bigram_token_ids_decode_as_the_pages_tokens() -> None:
    # SGLang with EAGLE publishes each page's tokens as (token, next token) pairs; the page
    # holds the first of each pair (mem_cache/events.py)
    raw = [10, 11, 12, 13, 14]
    bigrams = [[raw[j], raw[j + 1]] for j in range(4)]
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None}
    event |= {"token_ids": bigrams, "block_size": 2, "lora_id": None, "medium": "GPU"}
    (e,) = decode_message(frames([event])).events
    assert isinstance(e, BlockStored)
    assert e.token_ids == (10, 11, 12, 13) and e.block_size == 2


def test_a_malformed_event_is_skipped_and_counted_not_fatal() -> None:
    good = page_size_1([5, 6])
    bad = [
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": [1], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2, 3]], "block_size": 1},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": "1"},
        {"no": "type"},
        42,
    ]
    batch = decode_message(frames([good[0], *bad, good[1]]))
    assert batch.skipped == len(bad)
    hashes = [e.block_hashes for e in batch.events if isinstance(e, BlockStored)]
    assert hashes == [(1000,), (1001,)]
    # an event of a type not known is ignored, not counted as malformed
    assert decode_message(frames([{"type": "BlockMoved"}])).events == ()
    # a message that is not a batch at all is an error of the message
    for message in (
        [b"", b"\0" * 8],
        [b"", b"\0" * 4, msgpack.packb([1.0, []])],
        [b"", b"\0" * 8, b"\xc1"],
        [b"", b"\0" * 8, msgpack.packb({"ts": 1})],
        [b"", b"\0" * 8, msgpack.packb([1.0])],
        [b"", b"\0" * 8, msgpack.packb(["now", []])],
        [b"", b"\0" * 8, msgpack.packb([1.0, {"a": 1}])],
        [b"", b"\0" * 8, msgpack.packb([1.0, [1, 2]])[:-1]],  # truncated
    ):
        with pytest.raises(KvEventError):
            decode_message(message)


def test_the_dp_rank_is_the_payloads_else_the_publishers() -> None:
    assert decode_message(frames([], rank=3), dp_rank=1).dp_rank == 3
    assert decode_message(frames([], rank=None), dp_rank=1).dp_rank == 1
    assert decode_message(frames([], rank="absent"), dp_rank=2).dp_rank == 2
    assert decode_message(frames([], rank="absent")).dp_rank is None
    # an empty batch is still one part: its sequence number counts
    assert [(p.seq, p.part) for p in parts_of(frames([], seq=4), 8)] == [(4, 0)]


def test_a_long_page_size_1_batch_decodes_in_parts_of_one_chain_each() -> None:
    tokens = list(range(500, 500 + 32_768))
    message = frames(page_size_1(tokens), seq=9, rank="absent")
    steps = list(decode_parts(message, 256, dp_rank=2))
    parts = [p for p in steps if p is not None]
    # the DP rank comes after the events: they are skipped over first, a few steps
    assert steps.index(parts[0]) == 32_768 // SKIP_EVENTS
    assert [p.part for p in parts] == list(range(128))
    assert {(p.seq, p.dp_rank, p.ts, p.topic) for p in parts} == {(9, 2, 1.5, "kv")}
    # each part's 256 page events are one BlockStored continuing the previous part's chain
    for i, p in enumerate(parts):
        (e,) = p.events
        assert isinstance(e, BlockStored)
        assert e.block_hashes == tuple(range(1000 + 256 * i, 1256 + 256 * i))
        assert e.parent_block_hash == (None if i == 0 else 1000 + 256 * i - 1)
        assert e.token_ids == tuple(tokens[256 * i : 256 * (i + 1)])
    # the same keys as the events one by one would give
    whole = decode_message(message)
    assert len(whole.events) == 32_768 and whole.dp_rank is None
    joined = [t for p in parts for e in p.events if isinstance(e, BlockStored) for t in e.token_ids]
    assert chain_keys(joined, 1) == chain_keys(tokens, 1)


def test_a_chain_breaks_where_the_events_say_so() -> None:
    events: list[Any] = page_size_1([1, 2, 3])
    events.insert(2, {"type": "BlockRemoved", "block_hashes": [1000]})
    events.append({**page_size_1([4], 1003)[0], "parent_block_hash": 1002, "medium": "CPU"})
    events.append(page_size_1([5], 2000)[0])  # a new chain (parent None)
    events.append({**page_size_1([6], 2001)[0], "parent_block_hash": 2000})
    (part,) = parts_of(frames(events), 64)
    assert [(type(e).__name__, getattr(e, "token_ids", None)) for e in part.events] == [
        ("BlockStored", (1, 2)),
        ("BlockRemoved", None),
        ("BlockStored", (3,)),
        ("BlockStored", (4,)),  # another medium
        ("BlockStored", (5, 6)),
    ]
    # parts never coalesce across their boundary: a part holds at most max_events
    assert [len(p.events) for p in parts_of(frames(page_size_1([1, 2, 3, 4, 5])), 2)] == [1, 1, 1]


def test_dp_rank_endpoints_and_bind_or_connect() -> None:
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_port("tcp://10.0.0.5:5557", 1) == "tcp://10.0.0.5:5558"
    assert offset_port("tcp://*:0", 2) == "tcp://*:0"  # vLLM leaves port 0 to the OS
    assert offset_port("", 2) == ""
    connect, bind = KvEventsMode.CONNECT, KvEventsMode.BIND
    # connect (the engine binds): the endpoint's own host, or `*` = the backend's host
    assert subscriber_address("tcp://*:5557", connect, "10.1.1.1") == ("tcp://10.1.1.1:5557", False)
    assert subscriber_address("tcp://10.0.0.5:5557", connect, "wan-a") == (
        "tcp://10.0.0.5:5557",
        False,
    )
    assert subscriber_address("tcp://[fd00::5]:5557", connect, "x") == (
        "tcp://[fd00::5]:5557",
        False,
    )
    # bind (the engine connects to us): as written, `*` = every interface
    assert subscriber_address("tcp://10.0.0.5:5557", bind, "x") == ("tcp://10.0.0.5:5557", True)
    assert subscriber_address("tcp://*:5557", bind, "10.1.1.1") == ("tcp://*:5557", True)
    # the replay ROUTER is bound by the engine in either mode
    assert connect_address("tcp://*:5558", "10.1.1.1") == "tcp://10.1.1.1:5558"
    assert connect_address("tcp://engine-a:5558", "wan-a") == "tcp://engine-a:5558"


def test_the_event_stream_reaches_an_engine_behind_a_wan_link() -> None:
    """Traffic through a WAN link or proxy (address), the events from the engine's own
    host and port, with several routers connecting: nothing is inferred from the host."""
    from ext_proc.config.load import config_from_dict

    raw = {
        "id": "us",
        "address": "wan-us:31000",
        "kv_events": {"endpoint": "tcp://sglang-us:5557", "replay_endpoint": "tcp://*:5558"},
    }
    (b,) = config_from_dict({"backends": [raw]}).backends
    assert b.kv_events.mode is KvEventsMode.CONNECT  # the default: the engine binds
    assert subscriber_address(b.kv_events.endpoint, b.kv_events.mode, "wan-us") == (
        "tcp://sglang-us:5557",
        False,
    )
    assert connect_address(offset_port(b.kv_events.replay_endpoint, 1), "wan-us") == (
        "tcp://wan-us:5559"
    )
    bound = config_from_dict(
        {"backends": [{**raw, "kv_events": {"endpoint": "tcp://0.0.0.0:5557", "mode": "bind"}}]}
    )
    assert bound.backends[0].kv_events.mode is KvEventsMode.BIND


def test_the_dp_ranks_key_is_checked_at_load() -> None:
    from ext_proc.config.load import config_from_dict
    from ext_proc.vocab.params import ConfigError

    def kv(**keys: Any) -> dict[str, Any]:
        return {"backends": [{"id": "a", "address": "h:1", "kv_events": keys}]}

    default = config_from_dict(kv(endpoint="tcp://*:5557")).backends[0].kv_events
    assert default.dp_ranks == 1
    four = config_from_dict(kv(endpoint="tcp://*:65532", dp_ranks=4)).backends[0].kv_events
    assert four.dp_ranks == 4
    with pytest.raises(ConfigError, match=r"backends\[0\]\.kv_events\.dp_ranks: must be >= 1"):
        config_from_dict(kv(endpoint="tcp://*:5557", dp_ranks=0))
    with pytest.raises(ConfigError, match=r"replay_endpoint: DP rank r .* at most 65532"):
        config_from_dict(kv(endpoint="tcp://*:1", replay_endpoint="tcp://*:65535", dp_ranks=4))


def test_a_sliding_windows_size_and_sglangs_cache_salt_are_decoded() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
        "cache_salt": "tenant-a",
    }
    (e,) = decode_message(frames([stored])).events
    assert isinstance(e, BlockStored)
    assert (e.spec_kind, e.sliding_window, e.cache_salt) == ("sliding_window", 128, "tenant-a")
    # a chain of them decoded in parts keeps both
    chain = [stored, {**stored, "block_hashes": [6], "parent_block_hash": 5}]
    (part,) = parts_of(frames(chain), 128)
    (joined,) = part.events
    assert isinstance(joined, BlockStored) and joined.block_hashes == (5, 6)
    assert (joined.sliding_window, joined.cache_salt) == (128, "tenant-a")


def test_a_payload_keyed_by_a_list_is_refused_as_no_batch() -> None:
    """Found by fuzzing (tests/fuzz/kv_events.py): a msgpack map keyed by a list in the
    payload's header raised TypeError out of the subscriber instead of KvEventError. The
    file is the fuzz input: a shape byte (0: three frames), the sequence number, the
    payload."""
    data = (CORPUS / "finding-unhashable-map-key").read_bytes()
    frames = [b"kv", data[1:9], data[9:]]
    with pytest.raises(KvEventError, match="payload"):
        next(decode_parts(frames))
    with pytest.raises(KvEventError):
        decode_message(frames)
    keyed_by_a_list = msgpack.packb([1.0, [], {"x": 1}]).replace(b"\x81\xa1x", b"\x81\x91\x01")
    with pytest.raises(KvEventError):
        decode_message([b"kv", bytes(8), keyed_by_a_list])


def test_a_block_whose_extra_keys_hold_a_map_is_skipped() -> None:
    """Found by fuzzing (tests/fuzz/kv_events.py, the long run): a BlockStored whose
    extra_keys held a map reached the router's block index, where hashing it raised
    TypeError out of the subscriber; such an event is skipped (and counted) now, and the
    index takes the rest of the message."""
    data = (CORPUS / "finding-map-in-extra-keys").read_bytes()
    frames = [b"kv", data[1:9], data[9:]]
    batch = decode_message(frames)
    assert batch.skipped >= 1
    for e in batch.events:
        if isinstance(e, BlockStored) and e.extra_keys is not None:
            hash(e.extra_keys)  # what the index does with them
    r, _ = make_router("gorgo", backends=[KV_BACKEND])
    r.inputs.set_event_stream("a", True)
    for part in decode_parts(frames, 3, 0):
        if part is not None:
            r.inputs.apply_kv_events("a", part)


def test_a_token_id_past_int64_skips_its_event() -> None:
    """Found by fuzzing (tests/fuzz/kv_events.py, a one-second run in make test): a token
    id past int64 (msgpack carries uint64) raised OverflowError where the block index
    packs the ids; such an event is skipped and counted."""
    data = (CORPUS / "finding-token-id-past-int64").read_bytes()
    frames = [b"kv", data[1:9], data[9:]]
    batch = decode_message(frames)
    assert (batch.events, batch.skipped) == ((), 1)
    r, _ = make_router("gorgo", backends=[KV_BACKEND])
    r.inputs.set_event_stream("a", True)
    r.inputs.apply_kv_events("a", batch)
