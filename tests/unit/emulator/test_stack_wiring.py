"""What `gorgo up` starts and what it tells the router (emulator/stack/settings.py,
processes.py, emulator/vllm/serve.py): the emulated engines' tokenizer flag, the router's
config without a `tokenizer:` key, and each engine's KV events (emulated or a real vLLM)
named in its backend's config. Pure: the KV ports are given, nothing binds."""

from __future__ import annotations

import json
from pathlib import Path

from emulator.stack.processes import engine_argv
from emulator.stack.settings import DEFAULT_REGIONS, StackSettings
from emulator.vllm.serve import EngineSpec
from ext_proc.config.dump import config_as_dict

KV_PORTS = [21001, 21002, 21003, 21004, 21005, 21006]


def settings(**extra: object) -> StackSettings:
    return StackSettings(kv_ports=list(KV_PORTS), **extra)  # type: ignore[arg-type]


def test_the_engines_tokenize_with_the_tiny_model_and_the_router_is_told_nothing() -> None:
    """The router finds the engines' tokenizer itself (their /v1/models root): its config
    has no tokenizer path; each engine gets --tokenizer tiny unless the stack says else."""
    argv = engine_argv(settings(), 0, "us-ashburn", 18001, 0)
    assert argv[argv.index("--tokenizer") + 1] == "tiny"
    raw = config_as_dict(settings().gorgo_config())
    assert raw.get("tokenizer", {}).get("path", "") == ""
    approx = engine_argv(settings(engine_tokenizer="approx"), 0, "us-ashburn", 18001, 0)
    assert approx[approx.index("--tokenizer") + 1] == "approx"


def test_kv_events_name_each_engines_endpoints_for_emulated_and_real_engines() -> None:
    """With --kv-events (or several front doors) every backend's kv_events are its engine's
    own --kv-events-config endpoints, the engine binding both (tcp://*:P): any number of
    routers connect. Real vLLM backends too (they used to stay approximate)."""
    for real in (False, True):
        off = config_as_dict(settings(real_engine=real).gorgo_config())
        assert all(not b["kv_events"]["endpoint"] for b in off["backends"])
        raw = config_as_dict(settings(real_engine=real, kv_events=True).gorgo_config())
        got = [
            (b["kv_events"]["endpoint"], b["kv_events"]["replay_endpoint"]) for b in raw["backends"]
        ]
        assert got == [
            (f"tcp://*:{KV_PORTS[2 * i]}", f"tcp://*:{KV_PORTS[2 * i + 1]}")
            for i in range(len(DEFAULT_REGIONS))
        ]
        assert {b["engine"] for b in raw["backends"]} == {"vllm" if real else "sglang"}
    argv = engine_argv(settings(kv_events=True), 1, "eu-frankfurt", 18002, 1)
    spec = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert spec == {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_PORTS[2]}",
        "replay_endpoint": f"tcp://*:{KV_PORTS[3]}",
    }


def test_a_real_vllm_gets_the_flags_the_readme_names() -> None:
    """--enable-prefix-caching --enable-prompt-tokens-details (README's table), and KV events
    bound with a replay endpoint (vllm/config/kv_events.py KVEventsConfig.replay_endpoint)."""
    spec = EngineSpec(
        venv=Path("/v"),
        model=Path("/m"),
        port=8101,
        kv_port=21001,
        work_dir=Path("/w"),
        kv_bind=True,
        kv_replay_port=21002,
        extra_args=["--trust-request-chat-template"],
    )
    argv = spec.argv()
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    assert json.loads(argv[argv.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:21001",
        "replay_endpoint": "tcp://*:21002",
    }
    assert argv[-1] == "--trust-request-chat-template"
    # connecting to a subscriber's port (serve.py --kv-port): no replay endpoint
    connect = EngineSpec(Path("/v"), Path("/m"), 8101, 21001, Path("/w"), kv_replay_port=21002)
    assert connect.kv_events_config() == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:21001",
    }
