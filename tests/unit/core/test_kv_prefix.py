"""The router's predictions from an engine's KV events, request side: a request keyed as the
engine keys it (its adapter, its cache salt, each KV cache group's block size, pages
keyed every granule), a stream heard mid-way warming until its predictions agree, and
what /state shows of the stream."""

from __future__ import annotations

import json
import time

from ext_proc.core.router import Router
from ext_proc.estimate.stream_health import NO_PARENTS, UNSUPPORTED_MIN_STORES, WARM_AGREEMENTS
from ext_proc.feeds.kv_events import BlockRemoved, BlockStored, EventBatch, KvEvent
from ext_proc.prompt.parse import COMPLETIONS, parse_body
from ext_proc.vocab.types import RouteRequest, Status
from tests.builders import make_router
from tests.fakes import FakeClock

IDS = list(range(1000, 1257))  # 257 tokens: 4 blocks of 64 within the 256 a hit may take


def one_backend() -> tuple[Router, FakeClock]:
    backend = {"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}
    r, clock = make_router("gorgo", backends=[backend])
    r.inputs.set_event_stream("a", True)
    return r, clock


def request(ids: list[int], model: str | None = None, salt: str | None = None) -> RouteRequest:
    body: dict[str, object] = {"prompt": ids, "max_tokens": 4}
    if model is not None:
        body["model"] = model
    if salt is not None:
        body["cache_salt"] = salt
    return RouteRequest(
        f"r{time.monotonic_ns()}", parse_body(COMPLETIONS, json.dumps(body).encode()), None
    )


def events(r: Router, seq: int, *evs: KvEvent, rank: int = 0) -> None:
    r.inputs.apply_kv_events("a", EventBatch("", seq, time.time(), tuple(evs), rank))


def cached(r: Router, req: RouteRequest) -> int:
    (c,) = r.features.candidates(req, r.features.prompt_blocks(req))
    return c.cached_tokens


def blocks(n: int, ids: list[int] = IDS, size: int = 64, **fields: object) -> BlockStored:
    return BlockStored(tuple(range(1, n + 1)), None, tuple(ids[: n * size]), size, "GPU", **fields)  # type: ignore[arg-type]


def test_an_adapter_request_matches_only_that_adapters_blocks() -> None:
    r, _ = one_backend()
    # vLLM names the adapter (its served name) on its blocks (block_pool.py)
    events(r, 0, blocks(4, lora_name="sql-lora", extra_keys=(("sql-lora",),) * 4))
    assert cached(r, request(IDS, model="sql-lora")) == 256
    assert cached(r, request(IDS, model="base-model")) == 0  # the base model's are not it
    assert cached(r, request(IDS)) == 0
    assert r.snapshot()["backends"]["a"]["kv_events"]["lora_names"] == ["sql-lora"]


def test_a_salted_request_matches_only_blocks_of_its_salt() -> None:
    r, _ = one_backend()
    events(r, 0, blocks(4, extra_keys=(("tenant-1",), None, None, None)))
    assert cached(r, request(IDS, salt="tenant-1")) == 256
    assert cached(r, request(IDS, salt="tenant-2")) == 0
    assert cached(r, request(IDS)) == 0


def test_a_hybrid_models_prompt_is_cached_as_far_as_every_group_hits() -> None:
    r, _ = one_backend()
    ids = IDS[:33]  # 33 tokens: 32 may hit
    mamba = BlockStored((9,), None, tuple(ids[:32]), 32, "GPU", group_idx=1, spec_kind="mamba")
    full = BlockStored(
        (1, 2), None, tuple(ids[:32]), 16, "GPU", group_idx=0, spec_kind="full_attention"
    )
    events(r, 0, mamba, full)
    assert cached(r, request(ids)) == 32
    events(r, 1, BlockRemoved((9,), group_idx=1))  # no state to resume from
    assert cached(r, request(ids)) == 0
    groups = r.snapshot()["backends"]["a"]["kv_events"]["groups"]
    assert [(g["group"], g["kind"], g["block_size"], g["blocks"]) for g in groups] == [
        (0, "full_attention", 16, 2),
        (1, "mamba", 32, 0),
    ]


def test_small_pages_are_matched_a_granule_at_a_time() -> None:
    r, _ = one_backend()
    ids = IDS[:100]
    events(r, 0, BlockStored(tuple(range(1, 101)), None, tuple(ids), 1, "GPU"))
    assert cached(r, request(ids)) == 96  # 99 may hit: three granules of 32
    kv = r.snapshot()["backends"]["a"]["kv_events"]
    assert (kv["block_size"], kv["groups"][0]["key_tokens"], kv["blocks"]) == (1, 32, 3)


def test_a_stream_heard_mid_way_is_warming_until_its_predictions_agree() -> None:
    r, _ = one_backend()
    events(r, 7, blocks(4))  # seq 7: what the engine published before is unknown
    state = r.snapshot()["backends"]["a"]
    assert state["prefix_state"] == "warming" and state["kv_events"]["history"] == "warming"
    for _ in range(WARM_AGREEMENTS):
        d = r.decide(request(IDS))
        assert d.chosen.cached_tokens == 256
        assert r.in_flight[d.request_id].prefix_state == "warming"
        r.close(d.request_id, Status.OK, cached_tokens=256)
    state = r.snapshot()["backends"]["a"]
    assert state["prefix_state"] == "precise" and state["kv_events"]["history"] == "complete"
    assert state["prefix_prediction"]["warming"]["requests"] == WARM_AGREEMENTS


def test_a_warming_prediction_is_the_larger_of_the_events_and_the_routers_index() -> None:
    r, clock = one_backend()
    events(r, 7)
    d = r.decide(request(IDS))
    assert d.chosen.cached_tokens == 0
    r.close(d.request_id, Status.OK, cached_tokens=0)
    clock.advance(r.cfg.routing.optimistic_ttl_s + 1)
    # the events never showed the prompt; the router sent it there itself
    d = r.decide(request(IDS))
    assert d.chosen.cached_tokens == 256
    # precise, only an unconfirmed dispatch this recent would count
    r.close(d.request_id, Status.OK, cached_tokens=256)
    assert r.backends["a"].engine.blocks is not None
    assert r.backends["a"].engine.blocks.health.agreements == 0  # a precise one said 0


def test_state_shows_unknown_parents_and_each_ranks_sequence() -> None:
    r, _ = one_backend()
    events(r, 5, BlockStored((12,), 11, tuple(IDS[64:128]), 64, "GPU"))
    events(r, 2, rank=1)
    kv = r.snapshot()["backends"]["a"]["kv_events"]
    assert kv["unknown_parents"] == {"total": 1, "recent": 1, "blocks_dropped": 1}
    assert kv["last_seq"] == {"0": 5, "1": 2} and kv["resets"] == 0
    assert kv["unsupported"] is None and kv["skipped_stores"] == 0


def test_an_unsupported_stream_stays_approximate_and_says_why() -> None:
    r, _ = one_backend()
    for i in range(UNSUPPORTED_MIN_STORES):  # pages without parents: SGLang's old events
        start = i % 4 * 64
        events(r, i, BlockStored((100 + i,), None, tuple(IDS[start : start + 64]), 64, "GPU"))
    state = r.snapshot()["backends"]["a"]
    assert state["prefix_state"] == "approximate"
    assert state["kv_events"]["unsupported"] == NO_PARENTS and state["kv_events"]["up"]
    d = r.decide(request(IDS))
    assert r.in_flight[d.request_id].prefix_state == "approximate"
