"""The emulated vLLM reports its KV pool as the real one does (vllm:cache_config_info,
tests/fixtures/vllm/metrics.txt), and the router reads it with the code that reads the
real page."""

from __future__ import annotations

from pathlib import Path

from emulator.engine.status import vllm_cache_config_info
from ext_proc.estimate.profile import load_profile
from ext_proc.feeds.engine_metrics import parse_engine_metrics

REAL_PAGE = Path(__file__).resolve().parents[3] / "fixtures" / "vllm" / "metrics.txt"


def test_the_emulated_vllm_reports_its_pool_in_whole_blocks() -> None:
    p = load_profile("h100-llama3.1-8b")
    lines = vllm_cache_config_info(p)
    pool = p.kv_capacity_tokens // p.block_tokens * p.block_tokens
    assert parse_engine_metrics("\n".join(lines) + "\n").kv_capacity_tokens == pool
    # the real page's HELP and TYPE lines, and labels the real page has
    real = REAL_PAGE.read_text()
    assert lines[0] in real and lines[1] in real
    for label in ("block_size=", "num_gpu_blocks=", "kv_cache_size_tokens=", 'engine="0"'):
        assert label in lines[2] and label in real
