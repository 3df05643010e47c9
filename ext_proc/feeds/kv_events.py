"""Engines' KV cache events: what blocks an engine really holds, as it publishes them.

Wire format (the same for SGLang and vLLM; `../shared/real-engines.md`, SGLang's
python/sglang/srt/disaggregation/kv_events.py, vLLM's vllm/distributed/kv_events.py):
ZMQ PUB, one multipart message per batch of three frames: the topic, the sequence number
as 8 bytes big-endian (restarting at 0 when the engine restarts; one sequence per DP
rank's publisher), and a msgpack payload `[timestamp, [event, ...], data_parallel_rank]`.
An event is a map with a "type" key (vLLM, and SGLang since 2026) or a tagged array whose
first item is the type (SGLang before): `BlockStored` (block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, ...), `BlockRemoved` (block_hashes, medium),
`AllBlocksCleared`. Apply them in order: a node split is a BlockRemoved followed by a
BlockStored of the same pages.

SGLang's default page size 1 makes a 32k-token prompt ~32k events in one batch:
`decode_parts` decodes a message a step at a time, so the caller can yield to its event
loop between parts; `decode_message` decodes it whole. An event that cannot be read is
skipped and counted (`EventBatch.skipped`), never fatal to its batch. Pure: no sockets.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

log = logging.getLogger("gorgo.kv_events")

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
# Field order of SGLang's tagged-array encoding (after the tag): msgspec array_like
# structs, trailing defaults left out (python/sglang/srt/disaggregation/kv_events.py).
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
# Events off the wire per decoded part: one SGLang page-size-1 event decodes in ~4 us here
# and a part's chain applies in well under that per block, so a part holds the event loop
# ~0.5 ms and a decision waits for a part or two (loadgen/bench/router/kv_burst.py: 256 added
# ~3.5 ms at p50, 128 ~1 ms).
PART_EVENTS = 128
# The batch's DP rank comes after its events: they are skipped over first (~0.1 us each,
# no objects built), this many a step (~0.25 ms).
SKIP_EVENTS = 2048


class KvEventError(ValueError):
    """A message that is not a KV event batch, or an event that is not a KV event."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks the engine cached: `block_hashes` in chain order after `parent_block_hash`
    (None: none given), `block_size` tokens each, their tokens in `token_ids`."""

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
    # vLLM's sliding-window groups name their window (kv_cache_spec_sliding_window);
    # SGLang's events carry the request's cache_salt by name.
    sliding_window: int | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks the engine evicted, from `medium` (None: the device)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine (the DP rank that sent the batch) dropped every block it cached: what the
    router knew that rank to hold is forgotten."""

    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """One message of an engine's KV events (or one part of a long one), applied in order:
    `seq` its publisher's sequence number (a gap: events lost; back to 0: a restart), `ts`
    the engine's timestamp in seconds, `dp_rank` the data-parallel rank that sent it."""

    topic: str
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None
    # A long batch is decoded and applied in parts (the event loop is not held for the
    # whole of it): part 0 carries the sequence check, later parts continue that batch.
    part: int = 0
    # Events of this part that could not be read (malformed, or of a shape not known).
    skipped: int = 0


# Token ids are packed as int64 for block keys (ext_proc/estimate/chain.py).
MAX_TOKEN_ID = 2**63 - 1


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
    if all(type(v) is int for v in value):  # the usual case, at a fraction of the cost
        return tuple(value)
    return tuple(_hash(v) for v in value)


def _tokens(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise KvEventError("token_ids: expected a list")
    if value and isinstance(value[0], list | tuple):
        # EAGLE: SGLang's radix tree keys position j by the bigram (token j, token j+1) and
        # publishes the pairs as the page's token_ids; the page holds token j's KV, the
        # pair's first (python/sglang/srt/mem_cache/events.py record_store,
        # mem_cache/utils.py convert_to_bigram_key).
        if not all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
            raise KvEventError("token_ids: expected integers or (token, next) pairs")
        value = [p[0] for p in value]
    if not all(type(t) is int for t in value):
        raise KvEventError("token_ids: expected integers")
    if value and not 0 <= min(value) <= max(value) <= MAX_TOKEN_ID:
        # found by fuzzing: an id past int64 raised OverflowError in the block index
        raise KvEventError("token_ids: an id out of range")
    return tuple(value)


def _optional(fields: dict[str, Any], key: str, kind: type) -> Any:
    value = fields.get(key)
    if value is None or type(value) is kind:
        return value
    raise KvEventError(f"{key}: expected {kind.__name__} or nil, got {type(value).__name__}")


def _frozen(value: Any) -> object:
    if isinstance(value, dict):  # no hash input (found by fuzzing: unhashable in the index)
        raise KvEventError("extra_keys: a map is no block's hash input")
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def _extra_keys(value: Any) -> tuple[tuple[object, ...] | None, ...] | None:
    # vLLM: one entry per block, None or the block's extra hash inputs (untagged).
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
        v is None or isinstance(v, list | tuple) for v in value
    ):
        raise KvEventError("extra_keys: expected a list of lists or nils")
    return tuple(None if v is None else tuple(_frozen(x) for x in v) for v in value)


# A BlockStored's fields in its constructor's order: kept as a plain tuple while events
# are chained (a frozen dataclass costs ~2 us to build, most of an event's decoding).
_Stored = tuple[
    tuple[int, ...],
    int | None,
    tuple[int, ...],
    int,
    str | None,
    int | None,
    str | None,
    tuple[tuple[object, ...] | None, ...] | None,
    int | None,
    str | None,
    int | None,
    str | None,
]


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind, values = raw[0], raw[1:]
        return kind, dict(zip(_ARRAY_FIELDS.get(kind, ()), values, strict=False))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"], raw
    raise KvEventError(f"event: expected a map with 'type' or a tagged array, got {raw!r}")


def _stored(fields: dict[str, Any]) -> _Stored:
    parent = fields.get("parent_block_hash")
    return (
        _hashes(fields.get("block_hashes")),
        None if parent is None else _hash(parent),
        _tokens(fields.get("token_ids")),
        _optional(fields, "block_size", int) or 0,
        _optional(fields, "medium", str),
        _optional(fields, "lora_id", int),
        _optional(fields, "lora_name", str),
        _extra_keys(fields.get("extra_keys")),
        _optional(fields, "group_idx", int),
        _optional(fields, "kv_cache_spec_kind", str),
        _optional(fields, "kv_cache_spec_sliding_window", int),
        _optional(fields, "cache_salt", str),
    )


def _other(kind: str, fields: dict[str, Any]) -> KvEvent | None:
    if kind == BLOCK_REMOVED:
        return BlockRemoved(
            _hashes(fields.get("block_hashes")),
            _optional(fields, "medium", str),
            _optional(fields, "group_idx", int),
        )
    if kind == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    log.debug("kv event of unknown type %r ignored", kind)
    return None


def _full(s: _Stored) -> bool:
    # What the index can key (engine_index keys full blocks only).
    return s[3] > 0 and len(s[2]) == len(s[0]) * s[3]


def _kind_of(s: _Stored) -> tuple[object, ...]:
    # Block size, medium, LoRA id and name, KV cache group, spec kind, window and salt.
    return (s[3], s[4], s[5], s[6], s[8], s[9], s[10], s[11])


class _Chain:
    """Consecutive BlockStored events along one chain, as one event (SGLang coalesces its
    own queue so: python/sglang/srt/mem_cache/events.py enqueue). Applied, they are the
    same blocks under the same keys; a page-size-1 prompt is one event, not one a token."""

    def __init__(self, first: _Stored) -> None:
        self.first = first
        self.kind = _kind_of(first) if _full(first) and first[0] else None
        self.hashes = list(first[0])
        self.tokens = list(first[2])
        self.extra: list[tuple[object, ...] | None] | None = (
            None if first[7] is None else list(first[7])
        )

    def take(self, s: _Stored) -> bool:
        if (
            self.kind is None
            or s[1] is None
            or s[1] != self.hashes[-1]
            or not _full(s)
            or _kind_of(s) != self.kind
        ):
            return False
        if self.extra is not None or s[7] is not None:
            if self.extra is None:
                self.extra = [None] * len(self.hashes)
            self.extra.extend(s[7] or [None] * len(s[0]))
        self.hashes.extend(s[0])
        self.tokens.extend(s[2])
        return True

    def event(self) -> BlockStored:
        if len(self.hashes) == len(self.first[0]):
            return BlockStored(*self.first)
        extra = None if self.extra is None else tuple(self.extra)
        f = self.first
        return BlockStored(tuple(self.hashes), f[1], tuple(self.tokens), *f[3:7], extra, *f[8:])


def _unpacker(payload: bytes, start: int = 0) -> msgpack.Unpacker:
    # Read through a file object, 64 KiB at a time: feeding a 4 MB payload whole would copy
    # it in one go (~1 ms) at the first step.
    stream = io.BytesIO(payload)
    stream.seek(start)
    return msgpack.Unpacker(stream, raw=False, strict_map_key=False, read_size=1 << 16)


def decode_parts(
    frames: Sequence[bytes],
    max_events: int = PART_EVENTS,
    dp_rank: int | None = None,
    coalesce: bool = True,
) -> Iterator[EventBatch | None]:
    """One published message (topic, sequence number, payload), decoded a step at a
    time: parts of at most `max_events` events off the wire (part 0 first, then 1, 2...,
    all of the same seq), and None for a step that only read ahead. Each step is short:
    a caller on an event loop yields to it between steps. `dp_rank` stands in for a
    payload that names none (the publisher's configured rank). Raises KvEventError at
    the first step if the message is not a batch; an unreadable event is skipped.
    `coalesce`: consecutive stores along one chain become one BlockStored."""
    if len(frames) != 3:
        raise KvEventError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise KvEventError(f"sequence number: expected 8 bytes, got {len(seq_frame)}")
    seq = int.from_bytes(seq_frame, "big", signed=True)
    scan = _unpacker(payload)
    try:
        items = scan.read_array_header()
        ts = scan.unpack() if items >= 2 else None
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise KvEventError("payload: expected [timestamp, events, dp_rank]")
        n = scan.read_array_header()
        start = scan.tell()
        for done in range(n):
            scan.skip()
            if done % SKIP_EVENTS == SKIP_EVENTS - 1:
                yield None
        rank = scan.unpack() if items > 2 else None
    # TypeError: a map keyed by a list or a map (found by fuzzing: it escaped the
    # subscriber as no KvEventError).
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        if isinstance(e, KvEventError):
            raise
        raise KvEventError(f"payload: not a msgpack [timestamp, events, dp_rank]: {e}") from e
    if isinstance(rank, int) and not isinstance(rank, bool):
        dp_rank = rank
    head = EventBatch(topic.decode("utf-8", "replace"), seq, float(ts), (), dp_rank)
    events = _unpacker(payload, start)  # the payload's events, read one at a time
    for part, first in enumerate(range(0, max(n, 1), max_events)):
        out: list[KvEvent] = []
        chain: _Chain | None = None
        skipped = 0
        for _ in range(min(max_events, n - first)):
            try:
                kind, fields = _fields(events.unpack())
                stored = _stored(fields) if kind == BLOCK_STORED else None
                other = None if stored else _other(kind, fields)
            except (msgpack.UnpackException, TypeError, ValueError, LookupError) as err:
                log.debug("kv event skipped: %s", err)
                skipped += 1
                continue
            if stored and chain is not None and chain.take(stored):
                continue
            if chain is not None:
                out.append(chain.event())
                chain = None
            if stored and coalesce:
                chain = _Chain(stored)
            elif stored:
                out.append(BlockStored(*stored))
            elif other is not None:
                out.append(other)
        if chain is not None:
            out.append(chain.event())
        yield replace(head, events=tuple(out), part=part, skipped=skipped)


def decode_message(frames: Sequence[bytes], dp_rank: int | None = None) -> EventBatch:
    """One published message -> all its events in order, as sent (not coalesced)."""
    parts = [p for p in decode_parts(frames, 1 << 62, dp_rank, coalesce=False) if p is not None]
    (batch,) = parts
    return batch


def offset_port(endpoint: str, rank: int) -> str:
    """A DP rank's endpoint: the engines give rank r the configured port + r (SGLang
    python/sglang/srt/disaggregation/kv_events.py and vLLM vllm/distributed/kv_events.py,
    offset_endpoint_port; vLLM leaves a port 0 to the OS)."""
    if not rank or not endpoint:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
