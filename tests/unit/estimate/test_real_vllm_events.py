"""The real vLLM's captured KV events (tests/fixtures/vllm/) against the router's own
tokens: with the tiny model's tokenizer and template, the router's token ids of the
capture's long prompt are the very ids vLLM stored, and the cached tokens the index
predicts from those events are what vLLM reported serving from its cache."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from emulator.engine.tokenizer import tiny_tokenizer_dir
from emulator.vllm.capture import prose
from ext_proc.estimate.engine_index import EngineBlocks, chain_keys
from ext_proc.feeds.kv_events import BlockStored, decode_message
from ext_proc.prompt.engine_tokens import EngineTokenizer, load_engine_tokenizer
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.vocab.request import Chat

VLLM = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


@pytest.fixture(scope="module")
def engine() -> EngineTokenizer:
    tokenizer = tiny_tokenizer_dir() / "tokenizer.json"
    loaded = load_engine_tokenizer(TokenizerConfig(str(tokenizer)))
    assert loaded is not None
    return loaded


def long_prompt(engine: EngineTokenizer, target: int) -> Chat:
    """The capture's long prompt, rebuilt as emulator/vllm/capture.py built it (prose of a
    seed, resized until its chat is near `target` tokens), counted by the router instead
    of the engine's /tokenize: the same text only if the counts agree all the way."""
    n_words = max(target // 2, 10)
    for _ in range(8):
        chat = Chat(messages=({"role": "user", "content": prose(1, n_words)},))
        count = len(engine.chat_ids(chat))
        if abs(count - target) <= max(target // 50, 8):
            return chat
        n_words = max(int(n_words * target / count), 10)
    raise AssertionError("never near the target")


def test_the_routers_ids_are_the_ids_vllm_stored_and_its_prediction_vllms_hit(
    engine: EngineTokenizer,
) -> None:
    note = json.loads((VLLM / "sse-chat-cached.json").read_text())
    chat = long_prompt(engine, 1700)
    ids = engine.chat_ids(chat)
    assert len(ids) == note["request"]["prompt_tokens_by_tokenize"] == 1712
    rows = [json.loads(line) for line in (VLLM / "kv_events.jsonl").read_text().splitlines()]
    batches = [
        decode_message([b"", int(r["seq"]).to_bytes(8, "big"), base64.b64decode(r["payload_b64"])])
        for r in rows
    ]
    (first,) = batches[0].events  # the long prompt's first send: its 13 full blocks
    assert isinstance(first, BlockStored) and first.block_size == 128
    assert tuple(ids[: len(first.token_ids)]) == first.token_ids
    blocks = EngineBlocks()
    for b in batches:
        blocks.apply(b)
    predicted = blocks.cached_tokens(chain_keys(ids, 128))
    reported = note["second_send"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted == reported == 1664
