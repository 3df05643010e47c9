"""KV cache events as the engines publish them (`--kv-events-config`), for the emulated
engine.

What the real engines do (`../shared/real-engines.md`; SGLang
python/sglang/srt/disaggregation/kv_events.py, vLLM vllm/distributed/kv_events.py):
- a ZMQ PUB socket; an endpoint `tcp://*:PORT` binds (subscribers connect), a concrete
  address connects (the subscriber binds);
- one multipart message per batch: topic, the sequence number as 8 bytes big-endian
  (from 0 at each start), and the msgpack payload `[timestamp, [event, ...], dp_rank]`;
- events `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium), `BlockRemoved` (block_hashes, medium) and `AllBlocksCleared`, as maps with a
  "type" key (vLLM; SGLang since 2026) or as tagged arrays (SGLang before: `encoding:
  array`);
- SGLang's replay endpoint: a ROUTER socket; a DEALER sends `[b"", start_seq]` and gets
  `[b"", seq, payload]` for every buffered batch from start_seq on, then a seq of -1;
- with data parallelism one publisher per DP rank, on the endpoint's (and the replay
  endpoint's) port + rank, each with its own sequence (offset_endpoint_port in both);
- SGLang's page size 1 (its default) stores one page per token: before SGLang coalesced
  its event queue (python/sglang/srt/mem_cache/events.py enqueue) that was one BlockStored
  per token, which `per_page_events` reproduces.

The emulated engine's blocks carry SHA-256-chained 64-bit hashes of their token ids (as
SGLang's page hashes are made, python/sglang/srt/mem_cache/utils.py); subscribers should
not rely on hash values but on the token ids each BlockStored carries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

log = logging.getLogger(__name__)

MAP, ARRAY = "map", "array"
# The flavors (emulator.engine.config imports this module, so not from there).
SGLANG_FLAVOR, VLLM_FLAVOR = "sglang", "vllm"
UINT64_MASK = (1 << 64) - 1
# How many batches the replay endpoint keeps (SGLang's buffer_steps default).
DEFAULT_BUFFER_STEPS = 10_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# A LoRA adapter as KV events name it: (lora_name, lora_id); None for the base model.
Lora = tuple[str, int] | None


@dataclass(frozen=True)
class KvEventsConfig:
    """The engines' --kv-events-config JSON, the keys the emulator honours."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    # SGLang: map (2026) or array (tagged arrays, before); vLLM: always map.
    encoding: str = MAP
    medium: str = "GPU"
    # One BlockStored per page (SGLang's radix cache before it coalesced its queue), not
    # one per chain of consecutive pages.
    per_page_events: bool = False

    @staticmethod
    def parse(raw: str, flavor: str) -> KvEventsConfig | None:
        """From the flag's JSON; None when events are not enabled."""
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config: not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise ValueError("--kv-events-config: expected a JSON object")
        if flavor == "vllm" and not doc.get("enable_kv_cache_events", False):
            return None  # vLLM publishes only when asked
        publisher = doc.get("publisher", "zmq")
        if publisher == "null":
            return None
        if publisher != "zmq":
            raise ValueError(f"--kv-events-config: publisher {publisher!r}: only zmq is emulated")
        endpoint = doc.get("endpoint", "tcp://*:5557")
        encoding = doc.get("encoding", MAP)
        if encoding not in (MAP, ARRAY) or (flavor == "vllm" and encoding != MAP):
            raise ValueError(f"--kv-events-config: encoding {encoding!r} (sglang: map or array)")
        return KvEventsConfig(
            endpoint=str(endpoint),
            topic=str(doc.get("topic", "")),
            replay_endpoint=str(doc.get("replay_endpoint") or ""),
            buffer_steps=int(doc.get("buffer_steps", DEFAULT_BUFFER_STEPS)),
            encoding=encoding,
            per_page_events=bool(doc.get("per_page_events", False)),
        )


def offset_port(endpoint: str, dp_rank: int) -> str:
    """A DP rank's endpoint: the port + the rank, a port 0 left to the OS (SGLang's and
    vLLM's kv_events.py, offset_endpoint_port)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + dp_rank}"


def page_hash(parent: int | None, token_ids: Sequence[int], lora: str | None = None) -> int:
    """SHA-256 over the parent's hash and the page's tokens as uint32, as a signed int64;
    an adapter's pages also over its name (vLLM hashes the LoRA name into every block of
    an adapter's request: v1/core/kv_cache_utils.py generate_block_hash_extra_keys)."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent.to_bytes(8, "big", signed=True))
    for t in token_ids:
        h.update((t & 0xFFFFFFFF).to_bytes(4, "little"))
    if lora is not None:
        h.update(b"lora:" + lora.encode())
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def wire_hash(h: int, flavor: str) -> int:
    """A page hash as the flavor publishes it: SGLang a signed int64 (hash_str_to_int64),
    vLLM an unsigned 64-bit int (maybe_convert_block_hash; the real one here sends values
    >= 2**63: tests/fixtures/vllm/kv_events.jsonl)."""
    return h & UINT64_MASK if flavor == VLLM_FLAVOR else h


def stored_event(
    cfg: KvEventsConfig,
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    flavor: str = SGLANG_FLAVOR,
    lora: Lora = None,
) -> Any:
    """`lora`: the adapter's (name, int id) the blocks were stored for (None: the base
    model)."""
    hashes = [wire_hash(h, flavor) for h in hashes]
    parent = None if parent is None else wire_hash(parent, flavor)
    lora_id = None if lora is None else lora[1]
    if cfg.encoding == ARRAY:
        return ["BlockStored", hashes, parent, list(token_ids), block_size, lora_id, cfg.medium]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": cfg.medium,
    }
    if flavor == VLLM_FLAVOR:
        # The real vLLM's further fields (tests/fixtures/vllm/kv_events.jsonl): the
        # adapter's name (None for the base model) and, per block, its extra hash keys
        # (an adapter's: its name; v1/core/block_pool.py _build_block_stored_event,
        # kv_cache_utils.py generate_block_hash_extra_keys), one full-attention group.
        event.update(
            lora_name=None if lora is None else lora[0],
            extra_keys=[None if lora is None else (lora[0],)] * len(hashes),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    return event


def removed_event(cfg: KvEventsConfig, hashes: Sequence[int], flavor: str = SGLANG_FLAVOR) -> Any:
    hashes = [wire_hash(h, flavor) for h in hashes]
    if cfg.encoding == ARRAY:
        return ["BlockRemoved", hashes, cfg.medium]
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": cfg.medium}
    if flavor == VLLM_FLAVOR:
        event["group_idx"] = 0
    return event


def cleared_event(cfg: KvEventsConfig) -> Any:
    return ["AllBlocksCleared"] if cfg.encoding == ARRAY else {"type": "AllBlocksCleared"}


class KvEventPublisher:
    """ZMQ publisher of event batches, with SGLang's replay endpoint when configured."""

    def __init__(self, cfg: KvEventsConfig, dp_rank: int = 0) -> None:
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.endpoint = offset_port(cfg.endpoint, dp_rank)
        self.replay_endpoint = offset_port(cfg.replay_endpoint, dp_rank)
        self.seq = 0
        # Fault injection: this many next batches are numbered and kept for replay but not
        # sent (as a full send queue drops them), so subscribers see a gap.
        self.lose_next = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self.set_down(False)
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=max(1, cfg.buffer_steps))
        self._replay: zmq.Socket[bytes] | None = None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)  # the replay socket always binds

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        seq = self.seq.to_bytes(8, "big", signed=True)
        self.seq += 1
        self._buffer.append((seq, payload))
        if self.lose_next > 0:
            self.lose_next -= 1
        elif self._pub is not None:
            self._pub.send_multipart([self.cfg.topic.encode(), seq, payload])

    def set_down(self, down: bool) -> None:
        """Fault injection: with the stream down, batches are numbered and kept for replay
        but not sent (subscribers see a gap when it is back)."""
        if down and self._pub is not None:
            self._pub.close()
            self._pub = None
        elif not down and self._pub is None:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            _bind_or_connect(self._pub, self.endpoint)

    def serve_replays(self) -> int:
        """Answer pending replay requests (non-blocking). Returns how many were served."""
        if self._replay is None:
            return 0
        served = 0
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            if len(frames) < 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
            for seq, payload in self._buffer:
                if int.from_bytes(seq, "big", signed=True) >= start:
                    self._replay.send_multipart([identity, b"", seq, payload])
            self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
            served += 1

    def close(self) -> None:
        self.set_down(True)
        if self._replay is not None:
            self._replay.close()


def _bind_or_connect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    # As the engines do: a wildcard host binds; a concrete address connects.
    if endpoint.startswith("tcp://*") or endpoint.startswith("ipc://"):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class KvEventEmitter:
    """Turns the engine model's cache changes into published batches.

    The model's blocks are keyed by its own chained hashes; what a subscriber sees is
    each block's page hash (`page_hash`, chained over the block's token ids) and its token
    ids, which the engine learns from the requests it admits (`register` at submit,
    `unregister` at release)."""

    def __init__(
        self, publisher: KvEventPublisher, block_tokens: int, flavor: str = SGLANG_FLAVOR
    ) -> None:
        self.publisher = publisher
        self.cfg = publisher.cfg
        self.block_tokens = block_tokens
        self.flavor = flavor
        # Model hash -> (published hash, token ids, adapter): blocks in the cache, and the
        # blocks of requests in flight (counted by how many of them carry each).
        self._blocks: dict[int, tuple[int, tuple[int, ...], Lora]] = {}
        self._pending: dict[int, int] = {}
        self._stored: set[int] = set()

    def register(self, blocks: Sequence[int], token_ids: Sequence[int], lora: Lora = None) -> None:
        bt, parent = self.block_tokens, None
        name = None if lora is None else lora[0]
        for i, h in enumerate(blocks):
            if h not in self._blocks:
                tokens = tuple(token_ids[i * bt : (i + 1) * bt])
                self._blocks[h] = (page_hash(parent, tokens, name), tokens, lora)
            parent = self._blocks[h][0]
            self._pending[h] = self._pending.get(h, 0) + 1

    def unregister(self, blocks: Sequence[int]) -> None:
        for h in blocks:
            n = self._pending.get(h, 0) - 1
            if n > 0:
                self._pending[h] = n
                continue
            self._pending.pop(h, None)
            if h not in self._stored:
                self._blocks.pop(h, None)

    def emit(self, changes: list[tuple[Any, ...]]) -> None:
        """Publish one batch for the model's recorded changes, in order. Consecutive
        stores along one chain go in one BlockStored, as the engines batch them."""
        events: list[Any] = []
        run: list[int] = []  # model hashes of the current BlockStored
        run_parent: list[int | None] = [None]  # the model hash its first block follows

        def flush() -> None:
            if run:
                first = run_parent[0]
                parent = None if first is None else self._blocks[first][0]
                hashes = [self._blocks[h][0] for h in run]
                tokens = [t for h in run for t in self._blocks[h][1]]
                lora = self._blocks[run[0]][2]  # a chain is one adapter's (or the base's)
                bt, flavor = self.block_tokens, self.flavor
                if self.cfg.per_page_events:
                    for i, h in enumerate(hashes):
                        page = tokens[i * bt : (i + 1) * bt]
                        events.append(stored_event(self.cfg, [h], parent, page, bt, flavor, lora))
                        parent = h
                else:
                    events.append(stored_event(self.cfg, hashes, parent, tokens, bt, flavor, lora))
                run.clear()

        for change in changes:
            kind = change[0]
            if kind == "stored":
                _, h, parent = change
                if h not in self._blocks:
                    continue  # a block whose request left already: nothing to say
                self._stored.add(h)
                if run and parent != run[-1]:
                    flush()
                if not run:
                    run_parent[0] = parent
                run.append(h)
                continue
            flush()
            if kind == "removed":
                h = change[1]
                self._stored.discard(h)
                published = self._blocks.get(h)
                if h not in self._pending:
                    self._blocks.pop(h, None)
                if published is not None:
                    events.append(removed_event(self.cfg, [published[0]], self.flavor))
            else:
                for h in self._stored:
                    if h not in self._pending:
                        self._blocks.pop(h, None)
                self._stored.clear()
                events.append(cleared_event(self.cfg))
        flush()
        self.publisher.publish(events)
