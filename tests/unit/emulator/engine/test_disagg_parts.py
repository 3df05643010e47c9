"""The P/D twin's pure parts: its configuration (the engines' flags and defaults), the KV
bytes of a transfer and their scaling, the model with KV in transit and prebuilt requests,
and what the status pages show."""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.disagg.cli import add_disagg_flags, disagg_settings
from emulator.engine.disagg.config import DisaggConfig, parse_kv_transfer_config
from emulator.engine.disagg.kv import block_tokens, chunks, kv_bytes, wire_bytes
from emulator.engine.disagg.prebuilt import PrebuiltModel
from emulator.engine.disagg.status import engine_type, loads_section, metrics_lines
from emulator.engine.runner import EngineStats
from emulator.engine.status import metrics_text, server_info_body
from ext_proc.estimate.profile import load_profile

PROFILE = replace(load_profile(), jitter_sigma=0.0, kv_capacity_tokens=10_000)


# -- configuration ----------------------------------------------------------------------


def test_sglang_defaults_are_the_engines() -> None:
    d = DisaggConfig.sglang("decode")
    assert (d.bootstrap_port, d.transfer_backend, d.reserved_decode_tokens) == (
        8998,
        "mooncake",
        512,
    )
    assert (d.bootstrap_timeout_s, d.waiting_timeout_s) == (300.0, 300.0)
    assert (d.heartbeat_interval_s, d.heartbeat_max_failures, d.ensure_retries) == (5.0, 2, 15)
    assert d.decodes() and not d.prefills()
    with pytest.raises(ValueError, match="--disaggregation-mode must be one of null, prefill"):
        DisaggConfig.sglang("both")


def test_kv_transfer_config_is_checked_and_filled_as_vllm_does() -> None:
    raw = parse_kv_transfer_config('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}')
    assert raw["kv_load_failure_policy"] == "fail" and len(raw["engine_id"]) == 36
    d = DisaggConfig.vllm({"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "e"})
    assert (d.mode, d.engine_id, d.side_channel_port, d.abort_request_timeout_s) == (
        "both",
        "e",
        5600,
        480.0,
    )
    for bad, message in (
        ("{", "not JSON"),
        ('{"kv_role":"kv_both"}', "kv_connector is required"),
        ('{"kv_connector":"NixlConnector"}', "Please specify kv_disagg_role"),
        ('{"kv_connector":"NixlConnector","kv_role":"both"}', "Unsupported kv_role: both"),
        ('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', "NixlConnector only"),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"x"}',
            "kv_load_failure_policy",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            parse_kv_transfer_config(bad)


NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="sglang")
    parser.add_argument("--host", default="127.0.0.1")
    add_disagg_flags(parser.add_argument_group())
    return parser.parse_args(argv)


def test_the_flags_take_each_engines_names_and_environment() -> None:
    assert disagg_settings(parse(), {}) is None
    env = {
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
    }
    d = disagg_settings(
        parse("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9000"), env
    )
    assert d is not None and (d.mode, d.bootstrap_port, d.waiting_timeout_s) == (
        "prefill",
        9000,
        30.0,
    )
    assert d.heartbeat_interval_s == 2.0  # SGLang's floor
    v = disagg_settings(
        parse(
            "--flavor",
            "vllm",
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
        ),
        {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "60"},
    )
    assert v is not None and (v.side_channel_port, v.abort_request_timeout_s) == (5601, 60.0)
    with pytest.raises(ValueError, match="--disaggregation-mode is sglang's flag"):
        disagg_settings(parse("--flavor", "vllm", "--disaggregation-mode", "decode"), {})
    with pytest.raises(ValueError, match="--kv-transfer-config is vllm's flag"):
        disagg_settings(parse("--kv-transfer-config", "{}"), {})


def test_a_twin_placed_on_a_wan_advertises_an_address_and_routes_others() -> None:
    p = disagg_settings(
        parse("--disaggregation-mode", "prefill", "--kv-advertise", "127.0.0.1:21000"), {}
    )
    assert p is not None and p.advertised() == ("127.0.0.1", 21000)
    # without --kv-advertise: where it listens (vLLM: the side channel's variables)
    plain = disagg_settings(parse("--disaggregation-mode", "prefill"), {})
    assert plain is not None and plain.advertised() == ("127.0.0.1", 8998)
    v = disagg_settings(
        parse("--flavor", "vllm", "--kv-transfer-config", NIXL),
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"},
    )
    assert v is not None and v.advertised() == ("10.0.0.1", 5601)
    d = disagg_settings(
        parse(
            "--disaggregation-mode", "decode",
            "--kv-route", "127.0.0.1:21000=127.0.0.1:21001",
            "--kv-route", "127.0.0.1:22000=127.0.0.1:22001",
        ),
        {},
    )  # fmt: skip
    assert d is not None
    assert d.via("127.0.0.1:21000") == "127.0.0.1:21001"
    assert d.via("127.0.0.1:23000") == "127.0.0.1:23000"  # no route: the address itself
    for bad, flag in (
        (("--kv-advertise", "nohost"), "--kv-advertise"),
        (("--kv-route", "127.0.0.1:1"), "--kv-route"),
        (("--kv-route", "127.0.0.1:1=x:0"), "--kv-route"),
    ):
        with pytest.raises(ValueError, match=flag):
            disagg_settings(parse("--disaggregation-mode", "decode", *bad), {})


def test_a_twin_speaks_its_own_engines_protocol() -> None:
    from emulator.engine.server import Engine

    with pytest.raises(ValueError, match="a vllm twin speaks vllm's P/D protocol"):
        Engine(EngineConfig("x", flavor="vllm", disagg=DisaggConfig.sglang("prefill")))


# -- KV bytes ---------------------------------------------------------------------------


def test_kv_bytes_and_their_scaling() -> None:
    # Llama-3.1-8B in fp16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes per token.
    assert kv_bytes(8192, 2 * 32 * 8 * 128 * 2) == 1 << 30
    assert wire_bytes(1 << 30, 1024) == 1 << 20
    assert wire_bytes(1, 1024) == 1 and wire_bytes(0, 1024) == 0
    assert block_tokens(200, 64) == 256
    pieces = chunks(150_000)
    assert sum(map(len, pieces)) == 150_000 and max(map(len, pieces)) == 64 * 1024
    assert load_profile("a10g-llama3.1-8b").kv_bytes_per_token == 131072
    assert load_profile("l40s-qwen3.5-35b-a3b-fp8").kv_bytes_per_token == 2 * 10 * 2 * 256 * 2


# -- the model ----------------------------------------------------------------------------


def model(scheduler: str = "sglang") -> PrebuiltModel:
    return PrebuiltModel(PROFILE, random.Random(1), scheduler=scheduler)


def test_reservations_take_room_and_give_it_back() -> None:
    m = model()
    assert m.fits(10_000) and not m.fits(10_001)
    m.reserve("a", 6000)
    assert m.held_tokens == 6000 and not m.fits(5000) and m.fits(4000)
    m.reserve("a", 1000)  # a new reservation replaces the old
    assert m.held_tokens == 1000
    m.release("a")
    m.release("a")  # twice is harmless
    assert m.held_tokens == 0 and m.reservations == {}


def test_sglang_prebuilt_emits_the_prefills_token_at_once_then_decodes() -> None:
    m = model()
    m.reserve("r", 700)
    m.submit_prebuilt("r", 500, 3, 10.0, cached_tokens=64, first_token_known=True)
    assert m.reservations == {} and m.held_tokens == 503  # prompt and output now
    assert m.next_event_s() == 10.0  # no prefill step: token 0 is due now
    first = m.advance(10.0)
    assert [(e.index, e.time_s, e.cached_tokens) for e in first] == [(0, 10.0, 64)]
    assert m.stats.prefill_steps == 0
    out = []
    while (due := m.next_event_s()) is not None:
        out += m.advance(due)
    assert [e.index for e in out] == [1, 2] and out[-1].finished
    assert m.stats.decode_steps == 2 and m.held_tokens == 0


def test_vllm_prebuilt_computes_the_last_prompt_token_again() -> None:
    m = model("vllm")
    m.submit_prebuilt("r", 500, 2, 0.0, cached_tokens=499, first_token_known=False)
    assert m.next_event_s() is not None and m.next_event_s() > 0.0  # a one-token step
    first = m.advance(m.next_event_s() or 0.0)
    assert [(e.index, e.cached_tokens) for e in first] == [(0, 499)]
    assert m.stats.prefill_steps == 1


def test_prebuilt_requests_wait_for_a_batch_slot_and_cancel_cleanly() -> None:
    m = PrebuiltModel(replace(PROFILE, max_running_requests=1), random.Random(1))
    m.submit_prebuilt("a", 100, 5, 0.0, 0, True)
    m.submit_prebuilt("b", 100, 5, 0.0, 0, True)
    assert (m.num_running, m.num_waiting, m.num_queued) == (1, 1, 1)
    m.cancel("b", 0.0)
    assert (m.num_running, m.num_waiting) == (1, 0)
    m.cancel("a", 0.0)
    assert m.held_tokens == 0 and m.requests == {}


def test_vllm_counts_requests_whose_kv_is_coming_as_waiting() -> None:
    for scheduler, waiting in (("vllm", 2), ("sglang", 0)):
        m = model(scheduler)
        m.disagg.decode_prealloc, m.disagg.decode_transfer = 1, 1
        assert (m.num_waiting, m.num_queued, m.num_started) == (waiting, waiting, 0)


# -- status -------------------------------------------------------------------------------


def test_status_pages_show_the_mode() -> None:
    cfg = EngineConfig(
        "p", profile=PROFILE, enable_metrics=True, disagg=DisaggConfig.sglang("prefill")
    )
    m = model()
    m.disagg.prefill_bootstrap = 2
    m.disagg.transferred(1 << 30, 0.5)
    assert engine_type(cfg.disagg) == "prefill" and engine_type(None) == "unified"
    section = loads_section(cfg.disagg, m)
    assert section["mode"] == "prefill" and section["prefill_bootstrap_queue_reqs"] == 2
    assert section["kv_transfer_latency_ms"] == 500.0 and section["kv_transfer_speed_gb_s"] == 2.15
    info = server_info_body(cfg, m, EngineStats())
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("prefill", 8998)
    text = metrics_text(cfg, m, EngineStats(), None)
    assert 'engine_type="prefill"' in text
    labels = 'model_name="emulated",engine_type="prefill",tp_rank="0",pp_rank="0"'
    assert f"sglang:num_prefill_bootstrap_queue_reqs{{{labels}}} 2" in text
    plain = EngineConfig("u", profile=PROFILE, enable_metrics=True)
    assert server_info_body(plain, m, EngineStats())["disaggregation_mode"] == "null"
    assert "queue_reqs" not in "".join(metrics_lines(None, m, ""))
    assert loads_section(None, m)["mode"] == "null"
