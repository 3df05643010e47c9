"""What the engine says about its load and state, pure (no HTTP server): the bodies of
SGLang's `/v1/loads`, `/get_load` and `/server_info`, vLLM's `/kv_event_sources`, the
emulator's own `/stats`, and the `/metrics` page in each flavor's names and labels. The
handlers of emulator/engine/server.py answer with them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.disagg.status import (
    engine_type,
    loads_section,
    metrics_lines,
    server_info_args,
    stats_section,
)
from emulator.engine.kv_publisher import DEFAULT_BUFFER_STEPS
from emulator.engine.lora import LoraInfoGauge
from emulator.engine.model.scheduler import EngineModel
from emulator.engine.model_api import model_path
from emulator.engine.priority import PriorityScheduling
from emulator.engine.runner import EngineStats
from ext_proc.estimate.profile import EngineProfile


def load(cfg: EngineConfig, m: EngineModel) -> dict[str, Any]:
    """One DP rank's core load, as SGLang's /v1/loads reports it (managers/io_struct.py
    GetLoadsReqOutput; the scheduler's get_loads: num_total_tokens = used + the waiting
    requests' seqlen), unrounded (`loads_body` rounds as /v1/loads does; the /metrics
    gauges are not). utilization is not modelled: 0.0, SchedulerStats' default
    (metrics/collector.py)."""
    cap = cfg.profile.kv_capacity_tokens
    used = m.held_tokens
    return {
        "dp_rank": 0,
        "num_running_reqs": m.num_started,
        "num_waiting_reqs": m.num_queued,
        "num_waiting_uncached_tokens": m.waiting_uncached_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + m.waiting_prompt_tokens,
        "max_total_num_tokens": cap,
        "token_usage": used / cap,
        "gen_throughput": m.gen_throughput,
        "cache_hit_rate": m.cache_hit_rate,
        "utilization": 0.0,
        "max_running_requests": cfg.profile.max_running_requests,
    }


# /v1/loads `include` sections (managers/io_struct.py GetLoadsReqInput.VALID_SECTIONS).
LOADS_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def loads_body(
    cfg: EngineConfig, m: EngineModel, include: str | None = None, dp_rank: int | None = None
) -> dict[str, Any]:
    """SGLang GET /v1/loads?include=...&dp_rank=... (entrypoints/v1_loads.py; the
    scheduler's get_loads). The core fields always; `include` (comma-separated, default
    all) adds sections: `queues` {waiting, grammar, paused, retracted} and `disagg`
    ("disaggregation": the P/D mode and queues, emulator/engine/disagg/status.py).
    `memory` needs the GPU's weight, KV and graph memory, which the twin does not have:
    left out, as SGLang leaves it out when they are unavailable; `spec` and `lora` (no
    speculative decoding, LoRA pool slots not modelled) likewise. An unknown section is
    a ValueError (SGLang: 400)."""
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    bad = sections - LOADS_SECTIONS
    if bad:
        raise ValueError(
            f"Invalid include sections: {sorted(bad)}. Valid options: {sorted(LOADS_SECTIONS)}"
        )
    every = "all" in sections
    rank = load(cfg, m)
    # get_loads rounds these three (token_usage, cache_hit_rate 4 places, gen_throughput 2).
    for key, places in (("token_usage", 4), ("cache_hit_rate", 4), ("gen_throughput", 2)):
        rank[key] = round(rank[key], places)
    if every or "queues" in sections:
        rank["queues"] = {"waiting": m.num_queued, "grammar": 0, "paused": 0, "retracted": 0}
    if every or "disagg" in sections:
        rank["disaggregation"] = loads_section(cfg.disagg, m)  # emulator/engine/disagg
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": "emulated",
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [rank] if dp_rank in (None, 0) else [],
    }


def get_load_body(cfg: EngineConfig, m: EngineModel) -> list[dict[str, Any]]:
    """SGLang /get_load: per DP rank, requests and tokens."""
    now = load(cfg, m)
    return [
        {
            "dp_rank": 0,
            "num_reqs": now["num_running_reqs"] + now["num_waiting_reqs"],
            "num_waiting_reqs": now["num_waiting_reqs"],
            "num_tokens": now["num_used_tokens"],
        }
    ]


def kv_event_sources_body(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM /kv_event_sources: the --kv-events-config per DP rank, as given (the real
    one: tests/fixtures/vllm/routes.json; vLLM's KVEventsConfig defaults otherwise)."""
    kv = cfg.kv_events
    return {
        "0": {
            "enable_kv_cache_events": kv is not None,
            "publisher": "null" if kv is None else "zmq",
            "endpoint": "tcp://*:5557" if kv is None else kv.endpoint,
            "replay_endpoint": (kv.replay_endpoint or None) if kv else None,
            "buffer_steps": DEFAULT_BUFFER_STEPS if kv is None else kv.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "" if kv is None else kv.topic,
        }
    }


def server_info_body(cfg: EngineConfig, m: EngineModel, stats: EngineStats) -> dict[str, Any]:
    """SGLang /server_info (/get_server_info): its server args, the scheduler's info and
    `internal_states` per DP rank (entrypoints/http_server.py get_server_info). The args a
    router reads as SGLang names them (SMG workflow/steps/local/discover_metadata.rs
    ServerInfo: model_path, served_model_name, tp/dp/pp_size, disaggregation_mode,
    is_embedding, context_length, max_total_tokens, max_running_requests,
    weight_version); max_total_tokens is the --max-total-tokens flag, unset (None) as by
    default, the pool itself is the scheduler's max_total_num_tokens. The rest are the
    emulator's own settings (no real server args to show)."""
    p = cfg.profile
    return {
        "name": cfg.name,
        "flavor": cfg.flavor,
        "model_path": model_path(cfg),
        "served_model_name": cfg.model,
        "served_model_names": list(cfg.served_names),
        "lora_adapters": [vars(a) for a in cfg.adapters],
        "max_loras": cfg.max_loras if cfg.enable_lora else None,
        "engine_profile": p.name,
        "tokenizer": cfg.tokenizer.name,
        "max_total_num_tokens": p.kv_capacity_tokens,
        "max_running_requests": p.max_running_requests,
        "chunked_prefill_size": p.chunk_tokens,
        "page_size": p.block_tokens,
        "context_length": cfg.context_length,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        **server_info_args(cfg.disagg, cfg.flavor),  # disaggregation_mode, ...
        "is_embedding": False,
        "max_total_tokens": None,
        "weight_version": "default",
        "enable_cache_report": cfg.cache_report,
        "enable_metrics": cfg.enable_metrics,
        "kv_events_config": None if cfg.kv_events is None else vars(cfg.kv_events),
        **priority_args(cfg),
        "faults": vars(cfg.faults),
        "internal_states": [
            {"last_gen_throughput": round(m.gen_throughput, 2), "load": load(cfg, m)}
        ],
        "timing": stats.timing(),
        "version": "emulated",
    }


def metrics_text(
    cfg: EngineConfig, m: EngineModel, s: EngineStats, lora_info: LoraInfoGauge | None
) -> str:
    """Prometheus text with each engine's names and labels: SGLang's scheduler gauges
    carry model_name, engine_type, tp_rank, pp_rank (metrics/collector.py); vLLM's
    model_name and engine (v1/metrics/loggers.py)."""
    now = load(cfg, m)
    gauges: tuple[tuple[str, Any], ...]
    counters: tuple[tuple[str, int], ...]
    if cfg.flavor == SGLANG:
        kind = engine_type(cfg.disagg)  # "unified" unless P/D
        labels = f'model_name="{cfg.model}",engine_type="{kind}",tp_rank="0",pp_rank="0"'
        gauges = (
            ("sglang:num_running_reqs", now["num_running_reqs"]),
            ("sglang:num_queue_reqs", now["num_waiting_reqs"]),
            ("sglang:num_used_tokens", now["num_used_tokens"]),
            ("sglang:max_total_num_tokens", now["max_total_num_tokens"]),
            ("sglang:token_usage", now["token_usage"]),
            ("sglang:cache_hit_rate", now["cache_hit_rate"]),
            # Both as /v1/loads reports them (SMG's /metrics fallback reads them).
            ("sglang:gen_throughput", now["gen_throughput"]),
            ("sglang:utilization", now["utilization"]),
        )
        counters = (
            ("sglang:prompt_tokens_total", s.prompt_tokens),
            ("sglang:generation_tokens_total", s.tokens_written),
            ("sglang:cached_tokens_total", m.stats.cached_tokens),
            ("sglang:num_requests_total", s.requests_total),
        )
        ttft, itl = "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds"
    else:
        labels = f'engine="0",model_name="{cfg.model}"'
        gauges = (
            ("vllm:num_requests_running", now["num_running_reqs"]),
            ("vllm:num_requests_waiting", now["num_waiting_reqs"]),
            ("vllm:kv_cache_usage_perc", now["token_usage"]),
        )
        counters = (
            ("vllm:prompt_tokens_total", s.prompt_tokens),
            ("vllm:generation_tokens_total", s.tokens_written),
            ("vllm:prefix_cache_queries_total", m.stats.prompt_tokens),
            ("vllm:prefix_cache_hits_total", m.stats.cached_tokens),
            ("vllm:prompt_tokens_cached_total", m.stats.cached_tokens),
            # v1/metrics/loggers.py counter_num_preempted_reqs
            ("vllm:num_preemptions_total", m.stats.preemptions),
        )
        ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    lines = []
    for name, value in gauges:
        lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    for name, value in counters:
        # prometheus_client (both engines) declares a counter by its _total name.
        lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {value}"]
    lines += s.ttft_s.prometheus(ttft, labels)
    lines += s.itl_s.prometheus(itl, labels)
    if lora_info is not None:
        lines += lora_info.lines(*m.lora_counts())
    lines += metrics_lines(cfg.disagg, m, labels)
    if cfg.flavor == VLLM:
        lines += vllm_cache_config_info(cfg.profile)
    return "\n".join(lines) + "\n"


def priority_args(cfg: EngineConfig) -> dict[str, Any]:
    """The scheduling settings as each engine names them: SGLang's server args
    (server_args.py: schedule_policy, enable_priority_scheduling,
    schedule_low_priority_values_first, priority_scheduling_preemption_threshold,
    disable_priority_preemption; its /server_info shows them), vLLM's
    --scheduling-policy (SchedulerConfig.policy)."""
    prio = cfg.priority
    if cfg.flavor == VLLM:
        return {"scheduling_policy": "fcfs" if prio is None else "priority"}
    shown = prio or PriorityScheduling()  # SGLang shows its defaults when it is off
    return {
        "schedule_policy": "fcfs",
        "enable_priority_scheduling": prio is not None,
        "schedule_low_priority_values_first": shown.low_values_first,
        "priority_scheduling_preemption_threshold": shown.preemption_threshold,
        "disable_priority_preemption": not shown.preemption,
    }


def stats_body(cfg: EngineConfig, s: EngineStats, m: EngineModel | None = None) -> dict[str, Any]:
    """The emulator's own /stats: its request counters; with the model, the requests
    by the priority they carried ("none": no priority) and the preemptions."""
    return {
        "name": cfg.name,
        "requests_total": s.requests_total,
        "bad_requests_total": s.bad_requests_total,
        "injected_errors_total": s.injected_errors_total,
        "completed_total": s.completed_total,
        "in_flight": s.in_flight,
        "requests_by_path": dict(s.requests_by_path),
        "gets": dict(s.gets),
        # the last request bodies received: [bytes, BLAKE2b-128 hex], oldest first
        "recent_bodies": [list(b) for b in s.recent_bodies],
        **stats_section(m),  # a P/D twin's (emulator/engine/disagg/status.py)
        "priority": None
        if m is None
        else {
            "scheduling": cfg.priority is not None,
            "requests_by_priority": dict(s.requests_by_priority),
            "preempted_total": m.stats.preemptions,
            "preempted_by_priority": dict(m.stats.preempted_by_priority),
        },
    }


def vllm_cache_config_info(profile: EngineProfile) -> list[str]:
    """vLLM's KV pool on its /metrics page: an info gauge set to 1 whose labels are its
    CacheConfig.metrics_info() plus `engine` (vllm/v1/metrics/loggers.py
    log_metrics_info; the real page: tests/fixtures/vllm/metrics.txt). The labels the
    pool is read from (num_gpu_blocks, block_size, and newer vLLMs' kv_cache_size_tokens)
    and a few others as the real engine spells them; the rest of its config is not
    emulated. The pool is the profile's in whole blocks."""
    blocks = profile.kv_capacity_tokens // profile.block_tokens
    labels = {
        "block_size": profile.block_tokens,
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "kv_cache_size_tokens": blocks * profile.block_tokens,
        "num_cpu_blocks": "None",
        "num_gpu_blocks": blocks,
        "num_gpu_blocks_override": "None",
    }
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{text}}} 1.0",
    ]
