"""The router reads what real engines say: their /metrics pages (a real vLLM's, captured
here, and an SGLang page written from SGLang's source) and their KV events (the real
vLLM's, captured here), with the same code that reads the emulator's."""

import base64
import json
import math
from pathlib import Path

import pytest

from ext_proc.feeds.engine_metrics import (
    WANTED,
    EngineReport,
    MetricsError,
    _wanted_lines,
    parse_engine_metrics,
)
from ext_proc.feeds.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_message
from tests.fuzz.runner import findings

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
VLLM = FIXTURES / "vllm"


def test_a_real_vllm_metrics_page() -> None:
    # captured while three streams were running (tests/fixtures/vllm/README.md)
    for page in ("metrics.txt", "metrics-busy.txt"):
        r = parse_engine_metrics((VLLM / page).read_text())
        assert (r.running, r.waiting) == (3.0, 0.0), page
        assert r.kv_usage is not None and 0 < r.kv_usage < 0.05
    # the small pool under six 2k-token prompts: requests wait for KV, the pool is full
    small = parse_engine_metrics((VLLM / "metrics-small-pool-busy.txt").read_text())
    assert (small.running, small.waiting) == (2.0, 4.0)
    assert small.kv_usage == pytest.approx(0.805, abs=0.001)


def test_an_sglang_page_written_from_its_source() -> None:
    page = (FIXTURES / "sglang" / "metrics-tp2-dp2.txt").read_text()
    r = parse_engine_metrics(page)
    # the same scheduler's queue appears once per TP rank: max within a DP rank, summed
    # over DP ranks
    assert (r.waiting, r.running) == (10.0, 21.0)
    assert r.kv_usage == pytest.approx((0.42 + 0.21) / 2)


def test_the_kv_pool_a_real_vllm_and_an_sglang_page_report() -> None:
    # vLLM's info gauge: num_gpu_blocks x block_size (8192 x 128; the small pool's
    # --num-gpu-blocks-override 160 x 32), as its own kv_cache_size_tokens label says
    for page, tokens in (("metrics.txt", 1_048_576), ("metrics-small-pool-busy.txt", 5120)):
        assert parse_engine_metrics((VLLM / page).read_text()).kv_capacity_tokens == tokens
    sglang = parse_engine_metrics((FIXTURES / "sglang" / "metrics-tp2-dp2.txt").read_text())
    assert sglang.kv_capacity_tokens == 983_549  # sglang:max_total_num_tokens
    # one vLLM engine per data-parallel rank, each its own pool; a pool not yet profiled
    # ("None") is unknown
    line = 'vllm:cache_config_info{{block_size="16",engine="{}",num_gpu_blocks="{}"}} 1.0'
    two = "\n".join(line.format(e, n) for e, n in (("0", 100), ("1", 50))) + "\n"
    assert parse_engine_metrics(two).kv_capacity_tokens == 150 * 16
    assert parse_engine_metrics(line.format("0", "None") + "\n").kv_capacity_tokens is None


def test_a_missing_metric_is_unknown_and_garbage_is_an_error() -> None:
    only_running = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"
    r = parse_engine_metrics(only_running)
    assert (r.running, r.waiting, r.kv_usage, r.kv_capacity_tokens) == (2.0, None, None, None)
    assert parse_engine_metrics("").waiting is None
    with pytest.raises(MetricsError):
        parse_engine_metrics("this is { not prometheus")


def test_only_the_gauges_read_are_parsed_and_a_broken_one_still_fails() -> None:
    page = (VLLM / "metrics-small-pool-busy.txt").read_text()
    kept = _wanted_lines(page)
    assert len(kept.splitlines()) < len(page.splitlines()) / 10  # the real page: histograms
    assert all(line.startswith(WANTED) for line in kept.splitlines())
    with pytest.raises(MetricsError):
        parse_engine_metrics(page + "vllm:num_requests_waiting{model_name= 3\n")


def captured_batches(name: str) -> list:
    rows = [json.loads(line) for line in (VLLM / name).read_text().splitlines() if line]
    out = []
    for row in rows:
        frames = [
            row["topic"].encode(),
            int(row["seq"]).to_bytes(8, "big", signed=True),
            base64.b64decode(row["payload_b64"]),
        ]
        out.append(decode_message(frames))
    return out


def test_the_real_vllm_kv_events_decode() -> None:
    batches = captured_batches("kv_events.jsonl")
    assert [b.seq for b in batches] == list(range(len(batches)))  # from 0, no gap
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored, "the captured requests stored blocks"
    for e in stored:
        assert e.block_size == 128  # vLLM's CPU block
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        assert e.medium in (None, "GPU")
    # a chain: each later store of a prompt continues from a block stored before it
    known = {h for e in stored for h in e.block_hashes}
    assert any(e.parent_block_hash in known for e in stored)


def test_real_vllm_eviction_and_reset_events_decode() -> None:
    small = captured_batches("kv_events-small-pool.jsonl")
    removed = [e for b in small for e in b.events if isinstance(e, BlockRemoved)]
    assert removed, "the 5,120-token pool evicted under six 2k-token prompts"
    reset = captured_batches("kv_events-reset.jsonl")
    kinds = {type(e) for b in reset for e in b.events}
    assert kinds & {AllBlocksCleared, BlockRemoved}


def test_vllms_lora_gauge_gives_the_adapters_there_and_the_slots() -> None:
    info = "vllm:lora_requests_info"
    page = f"""# HELP {info} Running stats on lora requests.
# TYPE {info} gauge
{info}{{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""}} 1.7e+09
{info}{{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="doc"}} 1.8e+09
vllm:num_requests_waiting{{engine="0",model_name="m"}} 1.0
"""
    report = parse_engine_metrics(page)
    assert report.adapters == {"sql", "chat", "doc"}  # the newest sample
    assert report.max_lora == 2 and report.waiting == 1.0
    assert report.as_json()["adapters"] == ["chat", "doc", "sql"]
    plain = parse_engine_metrics("vllm:num_requests_waiting 0.0\n")
    assert plain.max_lora is None and "adapters" not in plain.as_json()


@pytest.mark.parametrize("found", findings("engine_metrics"), ids=lambda p: p.name)
def test_a_malformed_page_or_sample_is_refused_or_says_nothing(found: Path) -> None:
    """Found by fuzzing (tests/fuzz/engine_metrics.py): a label the parser tripped on
    raised IndexError (not MetricsError) out of the probe; NaN, +Inf and negative gauges
    came through as the load (and raised as a pool size). Now the page is refused with
    MetricsError, or such a sample reads as not said."""
    text = found.read_text(encoding="utf-8", errors="replace")
    try:
        report = parse_engine_metrics(text)
    except MetricsError as e:
        assert str(e).startswith("not Prometheus text")
        return
    for value in (report.waiting, report.running, report.kv_usage, report.kv_capacity_tokens):
        assert value is None or (math.isfinite(value) and value >= 0)


def test_nan_infinite_and_negative_samples_read_as_not_said() -> None:
    page = (
        "vllm:num_requests_waiting NaN\n"
        "vllm:num_requests_running -2\n"
        "vllm:kv_cache_usage_perc +Inf\n"
        "sglang:max_total_num_tokens NaN\n"
    )
    assert parse_engine_metrics(page) == EngineReport(None, None, None)
    assert parse_engine_metrics("vllm:num_requests_waiting 3\n").waiting == 3.0
