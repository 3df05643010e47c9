"""Engines' KV cache events: what blocks an engine really holds, as it publishes them.

Wire format (the same for SGLang and vLLM; `../shared/real-engines.md`, SGLang's
python/sglang/srt/disaggregation/kv_events.py, vLLM's vllm/distributed/kv_events.py):
ZMQ PUB, one multipart message per batch of three frames: the topic, the sequence number
as 8 bytes big-endian (restarting at 0 when the engine restarts), and a msgpack payload
`[timestamp, [event, ...], data_parallel_rank]`. An event is a map with a "type" key
(vLLM, and SGLang since 2026) or a tagged array whose first item is the type (SGLang
before): `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, ...), `BlockRemoved` (block_hashes, medium), `AllBlocksCleared`. Apply them in
order: a node split is a BlockRemoved followed by a BlockStored of the same pages.

`decode_message` is pure; `subscribe` is the thin async shell around a ZMQ SUB socket.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

log = logging.getLogger("gorgo.kv_events")

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
# Field order of SGLang's tagged-array encoding (after the tag).
_ARRAY_FIELDS = {
    BLOCK_STORED: (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    BLOCK_REMOVED: ("block_hashes", "medium"),
    ALL_BLOCKS_CLEARED: (),
}


class KvEventError(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    # Where the blocks live: "GPU" (None: not said, i.e. the device), "CPU" or a disk tier.
    medium: str | None = None
    lora_id: int | None = None
    # vLLM: the adapter's name, the per-block extra hash inputs (LoRA name, multimodal
    # (identifier, offset) pairs, cache_salt; one entry or None per block), and the KV
    # cache group the blocks belong to with its spec kind (hybrid models; vLLM's
    # vllm/distributed/kv_events.py).
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    topic: str
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None
    # A long batch is decoded and applied in parts (the event loop is not held for the
    # whole of it): part 0 carries the sequence check, later parts continue that batch.
    part: int = 0


def _hash(value: Any) -> int:
    """A block hash as an int: engines send int64/uint64, some versions raw digest bytes."""
    if isinstance(value, bool):
        raise KvEventError(f"block hash: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value[:8], "big", signed=True)
    raise KvEventError(f"block hash: expected an integer, got {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KvEventError("block_hashes: expected a list")
    return tuple(_hash(v) for v in value)


def _event(raw: Any) -> KvEvent | None:
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind, values = raw[0], raw[1:]
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), values, strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        kind, fields = raw["type"], raw
    else:
        raise KvEventError(f"event: expected a map with 'type' or a tagged array, got {raw!r}")
    if kind == BLOCK_STORED:
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids") or ()
        return BlockStored(
            _hashes(fields.get("block_hashes")),
            None if parent is None else _hash(parent),
            tuple(int(t) for t in tokens),
            int(fields.get("block_size") or 0),
            fields.get("medium"),
            fields.get("lora_id"),
        )
    if kind == BLOCK_REMOVED:
        return BlockRemoved(_hashes(fields.get("block_hashes")), fields.get("medium"))
    if kind == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    log.debug("kv event of unknown type %r ignored", kind)
    return None


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """One published message (topic, sequence number, payload) -> its events, in order."""
    if len(frames) != 3:
        raise KvEventError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KvEventError(f"sequence number: expected 8 bytes, got {len(seq)}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise KvEventError(f"payload: not msgpack: {e}") from e
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise KvEventError("payload: expected [timestamp, events, dp_rank]")
    ts, raw_events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) > 2 else None
    if not isinstance(raw_events, list | tuple):
        raise KvEventError("payload: events: expected a list")
    events = tuple(e for e in map(_event, raw_events) if e is not None)
    return EventBatch(
        topic.decode("utf-8", "replace"),
        int.from_bytes(seq, "big", signed=True),
        float(ts),
        events,
        dp_rank if isinstance(dp_rank, int) else None,
    )


def subscriber_address(endpoint: str, host: str) -> tuple[str, bool]:
    """Where a subscriber goes for an engine's publisher endpoint, and whether it binds.
    `tcp://*:P` makes the engine bind: the subscriber connects to host:P. A concrete
    address makes the engine connect: the subscriber binds it (one socket can then
    collect several engines)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"kv events endpoint: expected tcp://HOST:PORT, got {endpoint!r}")
    if parts.hostname in ("*", None) or endpoint.startswith("tcp://*"):
        return f"tcp://{host}:{parts.port}", False
    return endpoint, True


async def subscribe(
    endpoint: str, host: str = "127.0.0.1", topic: str = ""
) -> AsyncIterator[EventBatch]:
    """Every batch an engine publishes at `endpoint` (its --kv-events-config endpoint),
    decoded; undecodable messages are logged and skipped. Runs until cancelled."""
    import zmq
    import zmq.asyncio

    address, bind = subscriber_address(endpoint, host)
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                yield decode_message(frames)
            except KvEventError as e:
                log.warning("kv events from %s: %s", address, e)
    finally:
        sock.close()
