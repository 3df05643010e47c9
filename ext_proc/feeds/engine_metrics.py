"""What an engine says about its own load, read from its Prometheus `/metrics` page.

Parsed with prometheus_client's text parser (not regexes), for SGLang's and vLLM's names.
An engine with several ranks reports a gauge once per rank: within a data-parallel rank
the tensor/pipeline ranks report the same scheduler's queue (SGLang with metrics for all
schedulers: the max is the queue), and data-parallel ranks are separate schedulers (the
queue is their sum). A metric the page does not carry is unknown (None), never 0.
Pure: text in, report out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Metric names per engine (SGLang: python/sglang/srt/metrics/collector.py; vLLM:
# vllm/v1/metrics/loggers.py, and the real vLLM's page in tests/fixtures/vllm/).
WAITING = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running")
# Share of the KV pool held by running requests (0-1); evictable cached blocks excluded.
KV_USAGE = ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# vLLM's LoRA gauge (v1/metrics/loggers.py): labels running_lora_adapters and
# waiting_lora_adapters (comma-separated names) and max_lora (adapters a batch may hold);
# its value is when it was set, so the newest sample is the state.
LORA_INFO = "vllm:lora_requests_info"
# The label that tells data-parallel schedulers apart, per engine.
DP_LABELS = ("dp_rank", "engine")
# The KV pool in tokens, set once at start. SGLang: a gauge (metrics/collector.py,
# "Maximum total number of tokens in the KV cache pool"). vLLM: an info gauge, value 1,
# whose labels are CacheConfig.metrics_info() (v1/metrics/loggers.py log_metrics_info),
# num_gpu_blocks and block_size among them; "None" until the engine has profiled memory.
SGLANG_POOL = "sglang:max_total_num_tokens"
VLLM_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class EngineReport:
    """One reading of an engine's load (None: the page did not say)."""

    waiting: float | None
    running: float | None
    kv_usage: float | None
    # LoRA adapters of the requests running and waiting, and how many a batch may hold
    # (None: the page has no LoRA gauge).
    adapters: frozenset[str] = frozenset()
    max_lora: int | None = None
    # The engine's KV pool in tokens, summed over its data-parallel schedulers (None:
    # the page does not say).
    kv_capacity_tokens: int | None = None

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": self.kv_usage,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }
        if self.max_lora is not None:
            out["adapters"], out["max_lora"] = sorted(self.adapters), self.max_lora
        return out


class MetricsError(ValueError):
    """The page is not Prometheus text."""


def _aggregate(by_rank: dict[str, list[float]], fraction: bool) -> float:
    per_rank = [max(values) for values in by_rank.values()]  # the same queue per TP rank
    return sum(per_rank) / len(per_rank) if fraction else sum(per_rank)


WANTED = (*WAITING, *RUNNING, *KV_USAGE, LORA_INFO, SGLANG_POOL, VLLM_CACHE_INFO)


def _vllm_pool_tokens(labels: dict[str, str]) -> int | None:
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() else None


def _wanted_lines(text: str) -> str:
    """Only the samples of the gauges read here: a real engine's page is hundreds of
    lines (histograms), and parsing them all every scrape was ~8 % of the router's busy
    time in `gorgo bench path`. A page without any of them is parsed whole, so a page that
    is not Prometheus text still fails as such."""
    kept = [line for line in text.splitlines() if line.startswith(WANTED)]
    return "\n".join(kept) + "\n" if kept else text


def parse_engine_metrics(text: str) -> EngineReport:
    samples: dict[str, dict[str, list[float]]] = {}
    wanted = {*WAITING, *RUNNING, *KV_USAGE, SGLANG_POOL}
    lora: tuple[float, dict[str, str]] | None = None
    vllm_pools: dict[str, int] = {}  # per engine (data-parallel rank)
    try:
        for family in text_string_to_metric_families(_wanted_lines(text)):
            for s in family.samples:
                if s.name == LORA_INFO and (lora is None or s.value >= lora[0]):
                    lora = (float(s.value), s.labels)
                if s.name == VLLM_CACHE_INFO and (tokens := _vllm_pool_tokens(s.labels)):
                    vllm_pools[s.labels.get("engine", "")] = tokens
                if s.name not in wanted:
                    continue
                if not (math.isfinite(s.value) and s.value >= 0):
                    # A count or a share is neither negative nor infinite (found by
                    # fuzzing: NaN and +Inf came through, and raised as a pool size):
                    # such a sample says nothing.
                    continue
                rank = next((s.labels[k] for k in DP_LABELS if k in s.labels), "")
                samples.setdefault(s.name, defaultdict(list))[rank].append(float(s.value))
    # The parser's error for a malformed line: mostly ValueError, not always (found by
    # fuzzing: IndexError on an empty label name), so any of its errors refuses the page.
    except Exception as e:
        raise MetricsError(f"not Prometheus text: {type(e).__name__}: {e}") from e

    def read(names: tuple[str, ...], fraction: bool = False) -> float | None:
        for name in names:
            if name in samples:
                return _aggregate(samples[name], fraction)
        return None

    adapters: frozenset[str] = frozenset()
    max_lora = None
    if lora is not None:
        labels = lora[1]
        names = (
            f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
        )
        adapters = frozenset(n.strip() for n in names.split(",") if n.strip())
        max_lora = int(labels["max_lora"]) if labels.get("max_lora", "").isdigit() else None
    pool = read((SGLANG_POOL,))
    return EngineReport(
        read(WAITING),
        read(RUNNING),
        read(KV_USAGE, fraction=True),
        adapters,
        max_lora,
        sum(vllm_pools.values()) if vllm_pools else (int(pool) if pool else None),
    )
