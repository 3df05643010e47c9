"""The twin's KV events as SGLang publishes them at page size 1 (its default): one
BlockStored per page before SGLang coalesced its queue, one per chain after; DP ranks on
their own ports."""

from typing import Any

from emulator.engine.kv_publisher import KvEventEmitter, KvEventsConfig, offset_port, page_hash


class Captured:
    """A publisher that keeps what it is given (no socket)."""

    def __init__(self, cfg: KvEventsConfig) -> None:
        self.cfg = cfg
        self.batches: list[list[Any]] = []

    def publish(self, events: list[Any]) -> None:
        self.batches.append(events)


def emitted(per_page_events: bool) -> list[Any]:
    cfg = KvEventsConfig(endpoint="tcp://*:1", per_page_events=per_page_events)
    pub = Captured(cfg)
    emitter = KvEventEmitter(pub, block_tokens=1)  # type: ignore[arg-type]
    tokens = [7, 8, 9, 10]
    emitter.register([101, 102, 103, 104], tokens)
    emitter.emit([("stored", 101, None), ("stored", 102, 101), ("stored", 103, 102)])
    emitter.emit([("stored", 104, 103)])
    return pub.batches


def test_page_size_1_one_block_stored_per_token_chained() -> None:
    first, second = emitted(per_page_events=True)
    hashes = [page_hash(None, [7])]
    for t in (8, 9, 10):
        hashes.append(page_hash(hashes[-1], [t]))
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in first] == [
        ([hashes[0]], None, [7]),
        ([hashes[1]], hashes[0], [8]),
        ([hashes[2]], hashes[1], [9]),
    ]
    assert [(e["block_hashes"], e["parent_block_hash"]) for e in second] == [
        ([hashes[3]], hashes[2])
    ]
    assert {e["block_size"] for e in first + second} == {1}
    # coalesced (SGLang since it merges its queue): the three pages are one event
    (merged,), _ = emitted(per_page_events=False)
    assert merged["block_hashes"] == hashes[:3] and merged["token_ids"] == [7, 8, 9]


def test_dp_ranks_publish_on_their_own_ports() -> None:
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("tcp://127.0.0.1:5557", 1) == "tcp://127.0.0.1:5558"
    assert KvEventsConfig.parse('{"per_page_events": true}', "sglang").per_page_events  # type: ignore[union-attr]
