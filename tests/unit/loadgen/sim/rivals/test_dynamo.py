"""Dynamo's KV router cost: overlap from the engines' KV events, the router's own active
prefill tokens and blocks, logit = prefill blocks + decode blocks, least logit."""

from __future__ import annotations

import random

import pytest

from ext_proc.vocab.events import Closed, FirstByte
from ext_proc.vocab.types import InFlight, Status
from loadgen.sim.rivals.dynamo import DynamoKv
from tests.unit.loadgen.sim.rivals.fakes import FakeView, fleet


def dynamo(view: FakeView) -> DynamoKv:
    policy = DynamoKv(random.Random(0))
    policy.bind(view)
    return policy


def closed(rid: str, backend: str) -> Closed:
    return Closed(rid, backend, Status.OK, 1.0, 2.0, InFlight(rid, backend, 0.0, 0), 2.0)


def test_the_logit_is_prefill_blocks_after_the_overlap_plus_decode_blocks() -> None:
    view = FakeView(block_tokens=512, engine_block_tokens=64)
    policy = dynamo(view)
    req = view.request("r", [1, 2])  # 1024 tokens: 16 engine blocks
    keys = list(view.engine_keys("r"))
    # a's engine caches the first 8 blocks (the events' stored keys)
    policy.on_kv_events("a", [("stored", k, None) for k in keys[:8]])
    choice = policy.choose(req, fleet(a=0, b=0), None)
    # a: (1024 - 8 x 64)/64 = 8 prefill blocks + 16 new blocks; b: 16 + 16
    assert choice.scores == {"a": pytest.approx(24.0), "b": pytest.approx(32.0)}
    assert choice.backend_id == "a"
    # a now holds r's blocks and its 512 new prefill tokens in its books
    assert len(policy.books["a"].blocks) == 16 and policy.books["a"].prefill_tokens == 512


def test_prefill_counts_until_the_first_token_blocks_until_the_end() -> None:
    view = FakeView()
    policy = dynamo(view)
    req = view.request("r", [1])
    policy.choose(req, fleet(a=0), None)
    assert policy.books["a"].prefill_tokens == 512
    policy.on_first_byte(FirstByte("r", "a", 10.0, 1.0))
    assert policy.books["a"].prefill_tokens == 0 and len(policy.books["a"].blocks) == 8
    # a second request sharing the block: its active blocks count once, no new blocks
    logits, _ = policy.logits(list(view.engine_keys("r")), 512, ["a"])
    assert logits["a"] == pytest.approx(512 / 64 + 8)
    policy.on_close(closed("r", "a"))
    assert not policy.books["a"].blocks


def test_removed_and_cleared_events_take_blocks_out_of_the_overlap() -> None:
    view = FakeView()
    policy = dynamo(view)
    view.request("r", [1])
    keys = list(view.engine_keys("r"))
    policy.on_kv_events("a", [("stored", k, None) for k in keys])
    assert policy.overlap("a", keys) == 8
    policy.on_kv_events("a", [("removed", keys[3])])
    assert policy.overlap("a", keys) == 3
    policy.on_kv_events("a", [("cleared",)])
    assert policy.overlap("a", keys) == 0


def test_ties_go_to_the_smaller_tree() -> None:
    view = FakeView()
    policy = dynamo(view)
    policy.on_kv_events("a", [("stored", k, None) for k in range(100, 140)])
    # no overlap anywhere, equal logits: b's tree (empty) is smaller than a's (40 blocks)
    assert policy.choose(view.request("r", [1]), fleet(a=0, b=0), None).backend_id == "b"
