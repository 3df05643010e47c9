"""The twin's models and LoRA adapters, pure (emulator/engine/lora.py, parse.py, model_api.py,
model.py, kv_publisher.py): what vLLM names and refuses, each adapter's own cache
namespace and speed, its KV events' LoRA fields as the router keys them, and
vllm:lora_requests_info."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import pytest

from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.kv_publisher import KvEventEmitter, KvEventsConfig
from emulator.engine.lora import (
    LoraError,
    LoraInfoGauge,
    LoraModule,
    go_float,
    parse_lora_module,
)
from emulator.engine.model.scheduler import EngineModel
from emulator.engine.model_api import load_lora, models_body, unload_lora
from emulator.engine.parse import BadRequest, UnknownModel, parse_request, request_target
from ext_proc.estimate.chain import chain_keys
from ext_proc.estimate.engine_index import EngineBlocks
from ext_proc.estimate.profile import load_profile
from ext_proc.feeds.kv_events import decode_message

PROMPT = "x" * 4096  # 1024 tokens at 4 bytes a token


def vllm(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = {"name": "e", "flavor": VLLM, "model": "alpha", "model_path": "/m"}
    return EngineConfig(**{**base, **kw})


def with_sql(**kw: Any) -> EngineConfig:
    return vllm(enable_lora=True, lora_modules=(LoraModule("sql", "/lora/sql"),), **kw)


def completion(model: str | None, prompt: str = PROMPT) -> bytes:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


# -- names --------------------------------------------------------------------------------


def test_the_served_names_and_loaded_adapters_are_served_and_nothing_else() -> None:
    cfg = with_sql(model_aliases=("alpha-v1",))
    assert request_target({}, cfg) == ("alpha", None)
    # an alias is the base model, and responses name the first served name
    assert request_target({"model": "alpha-v1"}, cfg) == ("alpha", None)
    name, adapter = request_target({"model": "sql"}, cfg)
    assert name == "sql" and adapter is not None and adapter.int_id == 1
    with pytest.raises(UnknownModel) as e:
        request_target({"model": "beta"}, cfg)
    assert (e.value.status, e.value.err_type, e.value.param) == (404, "NotFoundError", "model")
    assert e.value.message == "The model `beta` does not exist. Valid aliases: alpha, alpha-v1."
    # SGLang echoes any name and runs the base model
    sg = EngineConfig(name="e", flavor=SGLANG, model="alpha")
    assert request_target({"model": "sql"}, sg) == ("sql", None)


def test_lora_modules_need_enable_lora_in_vllm_and_enable_it_in_sglang() -> None:
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        vllm(lora_modules=(LoraModule("sql", "/p"),))
    sg = EngineConfig(name="e", flavor=SGLANG, lora_modules=(LoraModule("sql", "/p"),))
    assert sg.enable_lora and sg.max_loras == 8
    assert vllm().max_loras == 1


def test_lora_module_syntax() -> None:
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "slowdown": 1.5}') == LoraModule(
        "sql", "/a", 1.5
    )
    assert parse_lora_module("/a/b", "--lora-paths") == LoraModule("/a/b", "/a/b")
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_module("/a/b")
    with pytest.raises(ValueError, match="needs a non-empty 'name' and 'path'"):
        parse_lora_module('{"name": "sql"}')


# -- /v1/models ----------------------------------------------------------------------------


def test_models_list_the_base_names_then_each_adapter_in_vllms_shape() -> None:
    cfg = with_sql(model_aliases=("alpha-v1",), context_length=4096)
    load_lora({"lora_name": "chat", "lora_path": "/lora/chat"}, cfg)
    data = models_body(cfg)["data"]
    assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in data] == [
        ("alpha", "/m", None, 4096),
        ("alpha-v1", "/m", None, 4096),
        ("sql", "/lora/sql", "alpha", None),
        ("chat", "/lora/chat", "alpha", None),
    ]
    assert all(m["object"] == "model" and m["owned_by"] == "vllm" for m in data)
    assert all(m["permission"][0]["object"] == "model_permission" for m in data)
    # SGLang lists its --lora-paths adapters with the served name as parent
    sg = EngineConfig(name="e", flavor=SGLANG, model="m", lora_modules=(LoraModule("a", "/a"),))
    assert [(m["id"], m["root"], m["parent"]) for m in models_body(sg)["data"]] == [
        ("m", "m", None),
        ("a", "/a", "m"),
    ]
    assert "permission" not in models_body(sg)["data"][1]


# -- load and unload -----------------------------------------------------------------------


def test_load_and_unload_answer_as_vllm() -> None:
    cfg = with_sql()
    ok = load_lora({"lora_name": "chat", "lora_path": "/c"}, cfg)
    assert ok == "Success: LoRA adapter 'chat' added successfully."
    assert cfg.adapters.get("chat").int_id == 2  # type: ignore[union-attr]
    with pytest.raises(LoraError) as e:
        load_lora({"lora_name": "chat", "lora_path": "/c2"}, cfg)
    assert (e.value.status, e.value.err_type) == (400, "InvalidUserInput")
    assert "has already been loaded" in e.value.message and "load_inplace" in e.value.message
    # in place: same id, new path
    load_lora({"lora_name": "chat", "lora_path": "/c2", "load_inplace": True}, cfg)
    chat = cfg.adapters.get("chat")
    assert chat is not None and (chat.int_id, chat.path) == (2, "/c2")
    with pytest.raises(LoraError, match=r"Both 'lora_name' and 'lora_path' must be provided\."):
        load_lora({"lora_name": "", "lora_path": "/c"}, cfg)
    with pytest.raises(BadRequest, match="missing required field 'lora_path'") as bad:
        load_lora({"lora_name": "x"}, cfg)
    assert bad.value.param == "body.lora_path"
    ok = unload_lora({"lora_name": "chat"}, cfg)
    assert ok == "Success: LoRA adapter 'chat' removed successfully."
    with pytest.raises(LoraError) as e:
        unload_lora({"lora_name": "chat"}, cfg)
    assert (e.value.status, e.value.err_type) == (404, "NotFoundError")
    assert e.value.message == "The lora adapter 'chat' cannot be found."
    with pytest.raises(LoraError, match="'lora_name' needs to be provided"):
        unload_lora({"lora_name": ""}, cfg)
    # a new load after an unload gets a new id (vLLM's counter only grows)
    load_lora({"lora_name": "chat", "lora_path": "/c"}, cfg)
    assert cfg.adapters.get("chat").int_id == 3  # type: ignore[union-attr]
    # without a LoRA config the engine refuses the adapter
    with pytest.raises(LoraError) as e:
        load_lora({"lora_name": "chat", "lora_path": "/c"}, vllm())
    assert (e.value.status, e.value.err_type) == (500, "InternalServerError")
    assert "--enable-lora" in e.value.message


def test_an_unloaded_adapter_is_unknown_again() -> None:
    cfg = with_sql()
    unload_lora({"lora_name": "sql"}, cfg)
    with pytest.raises(UnknownModel):
        parse_request("completion", completion("sql"), cfg)


# -- cache namespaces and speed ---------------------------------------------------------------


def test_an_adapter_request_has_its_own_cache_namespace() -> None:
    cfg = with_sql()
    load_lora({"lora_name": "chat", "lora_path": "/c"}, cfg)
    base = parse_request("completion", completion(None), cfg)
    sql = parse_request("completion", completion("sql"), cfg)
    chat = parse_request("completion", completion("chat"), cfg)
    assert base.adapter is None and sql.adapter is not None and sql.model == "sql"
    assert len(base.blocks) == len(sql.blocks) == len(chat.blocks) > 0
    assert not set(base.blocks) & set(sql.blocks)
    assert not set(sql.blocks) & set(chat.blocks)
    # the same adapter and prompt: the same keys (a prefix of a longer prompt's)
    longer = parse_request("completion", completion("sql", PROMPT * 2), cfg)
    assert longer.blocks[: len(sql.blocks)] == sql.blocks

    m = EngineModel(cfg.profile, random.Random(0))
    m.submit("b", base.input_tokens, 1, base.blocks, 0.0)
    m.advance(100.0)
    assert m.stats.cached_tokens == 0
    m.submit("s", sql.input_tokens, 1, sql.blocks, 100.0, "sql")
    m.advance(200.0)
    assert m.stats.cached_tokens == 0  # the base model's blocks are not the adapter's
    m.submit("s2", sql.input_tokens, 1, sql.blocks, 200.0, "sql")
    m.advance(300.0)
    assert m.stats.cached_tokens > 0  # the adapter's own are


def test_an_adapters_steps_take_its_slowdown_times_longer() -> None:
    profile = load_profile()
    plain = EngineModel(profile, random.Random(0))
    plain.submit("a", 4000, 1, (), 0.0)
    slow = EngineModel(profile, random.Random(0))
    slow.submit("a", 4000, 1, (), 0.0, "sql", 2.0)
    assert plain.step is not None and slow.step is not None
    base_ms = profile.prefill_base_ms
    plain_ms = (plain.step.end_s * 1e3) - base_ms
    slow_ms = (slow.step.end_s * 1e3) - base_ms
    assert slow_ms == pytest.approx(2 * plain_ms, rel=0.05)
    # the slowdown is configured per adapter, else the engine's default
    cfg = vllm(
        enable_lora=True,
        lora_slowdown=1.5,
        lora_modules=(LoraModule("a", "/a"), LoraModule("b", "/b", 3.0)),
    )
    assert [x.slowdown for x in cfg.adapters] == [1.5, 3.0]
    with pytest.raises(ValueError, match="slowdown must be a number >= 1"):
        vllm(lora_slowdown=0.5)


def test_max_loras_passes_over_a_third_adapter_not_the_base_model() -> None:
    m = EngineModel(load_profile(), random.Random(0), max_loras=1)
    m.submit("a", 500, 50, (), 0.0, "a")
    m.submit("b", 500, 50, (), 0.0, "b")
    m.submit("base", 500, 50, (), 0.0)
    m.submit("a2", 500, 50, (), 0.0, "a")
    running = {r.rid for r in (*m.prefilling, *m.decoding.values())}
    assert running == {"a", "base", "a2"}
    assert [r.rid for r in m.waiting] == ["b"]  # kept its place, admitted when a is done
    run, wait = m.lora_counts()
    assert wait == {"b": 1} and sum(run.values()) + sum(wait.values()) == 3
    while m.requests:
        m.advance(m.next_event_s() or 0.0)
        if "b" not in {r.rid for r in m.waiting}:
            break
    assert "a" not in m.requests and "a2" not in m.requests


# -- KV events ---------------------------------------------------------------------------------


class Captured:
    def __init__(self, cfg: KvEventsConfig) -> None:
        self.cfg = cfg
        self.batches: list[list[Any]] = []

    def publish(self, events: list[Any]) -> None:
        self.batches.append(events)


def test_an_adapters_block_stored_names_it_and_the_router_keys_it_so() -> None:
    cfg = with_sql(kv_events=KvEventsConfig(endpoint="tcp://*:1"))
    bs = 128
    cfg.profile = load_profile()
    sql = parse_request("completion", completion("sql"), cfg)
    base = parse_request("completion", completion(None), cfg)
    pub = Captured(cfg.kv_events)  # type: ignore[arg-type]
    emitter = KvEventEmitter(pub, bs, VLLM)  # type: ignore[arg-type]
    emitter.register(sql.blocks[:2], sql.token_ids, ("sql", 1))
    emitter.register(base.blocks[:2], base.token_ids)
    emitter.emit(
        [
            ("stored", sql.blocks[0], None),
            ("stored", sql.blocks[1], sql.blocks[0]),
            ("stored", base.blocks[0], None),
            ("stored", base.blocks[1], base.blocks[0]),
        ]
    )
    (events,) = pub.batches
    lora_event, base_event = events
    assert (lora_event["lora_id"], lora_event["lora_name"]) == (1, "sql")
    assert lora_event["extra_keys"] == [("sql",), ("sql",)]
    assert (base_event["lora_id"], base_event["lora_name"]) == (None, None)
    assert base_event["extra_keys"] == [None, None]
    assert lora_event["token_ids"] == base_event["token_ids"]
    assert not set(lora_event["block_hashes"]) & set(base_event["block_hashes"])

    # the router's decoder and index (ext_proc/feeds/kv_events.py, estimate/engine_index.py)
    payload = msgpack.packb([1.0, events, 0], use_bin_type=True)
    index = EngineBlocks()
    index.apply(decode_message([b"", (0).to_bytes(8, "big"), payload]))
    tokens = list(sql.token_ids[: 2 * bs])
    assert index.lora_names == {"sql"}
    in_sql = chain_keys(tokens, bs, index.seed_for("sql", None))
    in_base = chain_keys(tokens, bs, index.seed_for("alpha", None))
    assert index.cached_tokens(in_sql) == index.cached_tokens(in_base) == 2 * bs
    # only the base model's chain holds the base model's blocks: drop them and see
    index = EngineBlocks()
    payload = msgpack.packb([1.0, [lora_event], 0], use_bin_type=True)
    index.apply(decode_message([b"", (0).to_bytes(8, "big"), payload]))
    assert index.cached_tokens(chain_keys(tokens, bs, index.seed_for("sql", None))) == 2 * bs
    assert index.cached_tokens(chain_keys(tokens, bs, index.seed_for("alpha", None))) == 0


# -- vllm:lora_requests_info -----------------------------------------------------------------------


def test_lora_requests_info_is_vllms_gauge_with_a_timestamp() -> None:
    gauge = LoraInfoGauge(max_loras=2)
    assert gauge.lines({}, {}, now_s=1789828498.802105) == [
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",'
        'running_lora_adapters=""} 1.789828498802105e+09',
    ]
    lines = gauge.lines({"sql": 2, "chat": 1}, {"sql": 1}, now_s=1789828500.5)
    # prometheus_client keeps every label set it was given, each at its last time
    assert lines[1].endswith(" 1.789828498802105e+09")
    assert lines[2] == (
        'vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="sql",'
        'running_lora_adapters="sql,chat"} 1.7898285005e+09'
    )
    assert go_float(3.0) == "3.0" and go_float(0.25) == "0.25"
