"""The router's own keys for a prompt's blocks, the same from a request's token ids and from
an engine's KV events (`chain_keys`), and the namespace a chain starts in: the LoRA adapter
and the cache salt the engine hashes into a chain (`namespace_seed`), and the extra hash
inputs of an event's blocks that no text-only request has (`event_extras`).

Pure.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ext_proc.feeds.kv_events import BlockStored
from ext_proc.prompt.tokens import TokenIds

# Extra hash inputs of one block beyond its adapter and salt (None: it has none).
Extras = tuple[object, ...] | None


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The router's key of every full block of `token_ids`: a hash of the previous key and
    the block's tokens (Python's SipHash of the packed ids: process-local, which is all an
    in-memory index needs). `parent`: the key before the first block (a chain's first
    block: its namespace, `namespace_seed`)."""
    keys: list[int] = []
    ends = range(block_size, len(token_ids) + 1, block_size)
    if isinstance(token_ids, TokenIds):  # already packed: slice the bytes (same values)
        packed, step = token_ids.packed, 8 * block_size
        for end in ends:
            parent = hash((parent, packed[8 * end - step : 8 * end]))
            keys.append(parent)
        return keys
    for end in ends:
        parent = hash((parent, array("q", token_ids[end - block_size : end]).tobytes()))
        keys.append(parent)
    return keys


def namespace_seed(lora: str | None, salt: str | None) -> int:
    """The key a chain's first block chains from. vLLM hashes every block of an adapter's
    request with the adapter and the first block with the request's cache_salt
    (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys; SGLang seeds a salted
    chain's root likewise, python/sglang/srt/mem_cache/utils.py): a chain seeded with them
    carries them to every later key, so another adapter's, the base model's or another
    salt's blocks never match. 0 for the base model without a salt."""
    if lora is None and salt is None:
        return 0
    return hash(("namespace", lora, salt))


def keyed_block(parent: int, block: bytes, extras: Extras) -> int:
    """The key of one block with extra hash inputs (`chain_keys` folds none)."""
    return hash((parent, block)) if extras is None else hash((parent, block, extras))


def event_extras(e: BlockStored) -> tuple[str | None, list[Extras] | None]:
    """The event's cache salt, and per block its other extra hash inputs (None: none has).

    vLLM publishes them untagged, one entry per block: the adapter's name first (when
    lora_name is set), multimodal (identifier, offset) pairs, the cache_salt string on the
    prompt's first block only, prompt-embedding digests (vllm/v1/core/kv_cache_utils.py
    to_event_extra_keys). The adapter and the salt go into the chain's namespace; what
    is left (a multimodal item, an embedding) no text-only request has: such a block is
    stored under a key no text request can reach. SGLang names the salt in its own field
    (python/sglang/srt/disaggregation/kv_events.py, cache_salt)."""
    salt = e.cache_salt
    salt = salt if isinstance(salt, str) and e.parent_block_hash is None else None
    if not e.extra_keys:
        return salt, None
    out: list[Extras] = []
    for i, entry in enumerate(e.extra_keys):
        items = list(entry or ())
        if e.lora_name is not None and items and items[0] == e.lora_name:
            items.pop(0)
        if i == 0 and e.parent_block_hash is None and salt is None:
            text = next((x for x in items if isinstance(x, str)), None)
            if text is not None:
                salt = text
                items.remove(text)
        out.append(tuple(items) if items else None)
    return salt, out if any(x is not None for x in out) else None
