"""The twin's load and info bodies hold what current SGLang serves and what the rival routers
parse: /v1/loads (SGLang entrypoints/v1_loads.py, the scheduler's get_loads), the
sglang:gen_throughput gauge, /server_info's fields that SMG reads (discover_metadata.rs
ServerInfo)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.model.scheduler import DECODE_LOG_INTERVAL, EngineModel
from emulator.engine.runner import EngineStats
from emulator.engine.status import load, loads_body, metrics_text, server_info_body
from ext_proc.estimate.profile import load_profile

PROFILE = replace(load_profile(), jitter_sigma=0.0)
CORE = {
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "max_running_requests",
}


def cfg_with(**profile: object) -> EngineConfig:
    return EngineConfig(name="e1", profile=replace(PROFILE, **profile), enable_metrics=True)


def model_of(cfg: EngineConfig) -> EngineModel:
    return EngineModel(cfg.profile, random.Random(0))


def test_loads_answers_the_sections_asked() -> None:
    cfg = cfg_with()
    m = model_of(cfg)
    # SMG's probe (worker/monitor.rs): core plus disagg and queues; memory is left out, as
    # SGLang leaves it when it has no GPU memory figures.
    body = loads_body(cfg, m, "core,disagg,queues,memory")
    assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert body["timestamp"].endswith("+00:00")  # ISO 8601 in UTC, as datetime.isoformat
    (rank,) = body["loads"]
    assert set(rank) == CORE | {"queues", "disaggregation"}
    assert rank["queues"] == {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0}
    assert rank["disaggregation"]["mode"] == "null"
    assert rank["max_running_requests"] == PROFILE.max_running_requests
    assert rank["max_total_num_tokens"] == PROFILE.kv_capacity_tokens
    (core,) = loads_body(cfg, m, "core")["loads"]
    assert set(core) == CORE
    assert loads_body(cfg, m, None, dp_rank=3)["loads"] == []
    with pytest.raises(ValueError, match="'cpu'"):
        loads_body(cfg, m, "core,cpu")


def test_waiting_work_is_counted_in_tokens() -> None:
    """One slot: the first request prefills, two wait whole. num_waiting_uncached_tokens is
    every prompt token not yet computed; num_total_tokens adds the waiting prompts to the
    used KV (the admitted one's KV is reserved, so in use already)."""
    cfg = cfg_with(max_running_requests=1)
    m = model_of(cfg)
    for i in range(3):
        m.submit(f"r{i}", 1000 + i, 10, [], 0.0)
    rank = load(cfg, m)
    assert rank["num_running_reqs"] == 1 and rank["num_waiting_reqs"] == 2
    assert rank["num_waiting_uncached_tokens"] == 1000 + 1001 + 1002
    assert rank["num_used_tokens"] == m.held_tokens > 0
    assert rank["num_total_tokens"] == m.held_tokens + 1001 + 1002
    # once the first prompt is computed it is no longer waiting work
    m.advance(m.next_event_s() or 0.0)
    assert load(cfg, m)["num_waiting_uncached_tokens"] == 1001 + 1002


def test_gen_throughput_is_measured_over_forty_decode_steps() -> None:
    cfg = cfg_with()
    m = model_of(cfg)
    m.submit("r", 100, DECODE_LOG_INTERVAL + 5, [], 0.0)
    steps = 0
    decode_ms = []
    while m.next_event_s() is not None and steps < DECODE_LOG_INTERVAL + 1:
        step = m.step
        assert step is not None
        if step.decode:
            decode_ms.append((step.end_s - step.start_s) * 1e3)
            if len(decode_ms) < DECODE_LOG_INTERVAL:
                assert m.gen_throughput == 0.0  # nothing logged before the 40th step
        m.advance(step.end_s)
        steps += 1
    assert len(decode_ms) >= DECODE_LOG_INTERVAL
    # one token per step for one request: 40 tokens over the 40 steps' time
    expected = DECODE_LOG_INTERVAL / (sum(decode_ms[:DECODE_LOG_INTERVAL]) / 1e3)
    assert m.gen_throughput == pytest.approx(expected, rel=1e-9)
    assert loads_body(cfg, m)["loads"][0]["gen_throughput"] == round(expected, 2)
    page = metrics_text(cfg, m, EngineStats(), None)
    labels = 'model_name="emulated",engine_type="unified",tp_rank="0",pp_rank="0"'
    assert f"sglang:gen_throughput{{{labels}}} {m.gen_throughput}" in page
    assert f"sglang:utilization{{{labels}}} 0.0" in page


def test_server_info_has_what_smg_reads() -> None:
    cfg = cfg_with(max_running_requests=48)
    info = server_info_body(cfg, model_of(cfg), EngineStats())
    assert info["max_running_requests"] == 48
    assert info["context_length"] == cfg.context_length
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
    assert info["served_model_name"] == cfg.model
    assert info["model_path"] == "emulated"
    assert info["disaggregation_mode"] == "null"
    assert info["is_embedding"] is False
    assert info["max_total_tokens"] is None  # the unset flag; the pool is max_total_num_tokens
    assert info["max_total_num_tokens"] == PROFILE.kv_capacity_tokens
    (state,) = info["internal_states"]
    assert state["last_gen_throughput"] == 0.0
    assert set(state["load"]) == CORE
