"""What `gorgo up` starts and what it tells the router (emulator/stack/settings.py,
processes.py, emulator/vllm/serve.py): the emulated engines' tokenizer flag, the router's
config without a `tokenizer:` key, each engine's KV events (emulated or a real vLLM)
named in its backend's config, every router's admin token and last good config, and the
logs a stopped stack keeps. Nothing binds or starts (the KV ports are given)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from emulator.stack.processes import engine_argv
from emulator.stack.settings import DEFAULT_REGIONS, StackPorts, StackSettings
from emulator.stack.stack import Stack
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
    own publisher and replay endpoint, the engine binding both (tcp://*:P): any number of
    routers connect (mode connect), to the engine's port rather than the WAN link's. Real
    vLLM backends too (they used to stay approximate)."""
    for real in (False, True):
        off = config_as_dict(settings(real_engine=real).gorgo_config())
        assert all(not b["kv_events"]["endpoint"] for b in off["backends"])
        raw = config_as_dict(settings(real_engine=real, kv_events=True).gorgo_config())
        got = [
            (b["kv_events"]["endpoint"], b["kv_events"]["replay_endpoint"]) for b in raw["backends"]
        ]
        # the engine's own ports (events straight from it; traffic through the WAN link)
        assert got == [
            (f"tcp://127.0.0.1:{KV_PORTS[2 * i]}", f"tcp://127.0.0.1:{KV_PORTS[2 * i + 1]}")
            for i in range(len(DEFAULT_REGIONS))
        ]
        assert {b["kv_events"].get("mode", "connect") for b in raw["backends"]} == {"connect"}
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


def test_a_fleet_gives_each_engine_its_profile_and_the_router_the_shipped_one() -> None:
    """`gorgo up --fleet`: each emulated engine runs its region's profile (and its cache
    granularity); the router's config keeps the shipped profile, which it must correct."""
    from emulator.stack.fleet import load_fleet
    from ext_proc.vocab.backend import DEFAULT_PROFILE

    fleets = Path(__file__).resolve().parents[4] / "loadgen/data/fleets"
    fleet = load_fleet(fleets / "mixed-gpus.yaml", [r.id for r in DEFAULT_REGIONS])
    s = settings(engine_profiles=fleet.profiles)
    profiles = {}
    for i, r in enumerate(DEFAULT_REGIONS):
        argv = engine_argv(s, i, r.id, 18001 + i, i)
        profiles[r.id] = argv[argv.index("--profile") + 1]
        assert argv[argv.index("--page-size") + 1] == "64"
    assert profiles == {
        "us-ashburn": "h100-llama3.1-8b",
        "eu-frankfurt": "h200-llama3.1-70b-fp8",
        "ap-seoul": "a10g-llama3.1-8b",
    }
    raw = config_as_dict(s.gorgo_config())
    assert {b["engine_profile"] for b in raw["backends"]} == {DEFAULT_PROFILE}
    # without a fleet the engines run the stack's one profile (none: the engine's default)
    assert "--profile" not in engine_argv(settings(), 0, "us-ashburn", 18001, 0)


def test_up_reads_the_fleet_file_and_refuses_a_bad_one(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import emulator.stack.stack
    from ext_proc.cli import build_parser

    started: list[StackSettings] = []
    monkeypatch.setattr(emulator.stack.stack, "run_until_signalled", started.append)
    fleets = Path(__file__).resolve().parents[4] / "loadgen/data/fleets"
    args = build_parser().parse_args(["up", "--fleet", str(fleets / "slow-near.yaml")])
    args.func(args)
    assert Path(started[0].engine_profiles["us-ashburn"]).name == (
        "l40s-prefill-third-decode-half.yaml"
    )
    assert started[0].engine_profile is None
    bad = build_parser().parse_args(["up", "--fleet", str(fleets / "nope.yaml")])
    assert bad.func(bad) == 2
    assert "gorgo up: fleet" in capsys.readouterr().err
    real = build_parser().parse_args(
        ["up", "--engine", "vllm", "--fleet", str(fleets / "slow-near.yaml")]
    )
    assert real.func(real) == 2
    assert len(started) == 1


def test_a_fleets_models_and_adapters_become_each_engines_own_flags(
    tmp_path: Path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """`gorgo up --fleet` with `model` and `lora_modules`: each engine serves its name and
    loads its adapters with the flavor's flags (vLLM --enable-lora --lora-modules, SGLang
    --lora-paths), which `gorgo engine` reads; a region not named keeps the defaults."""
    import emulator.stack.stack
    from emulator.cli import _lora_settings
    from ext_proc.cli import build_parser

    fleet = tmp_path / "f.yaml"
    fleet.write_text(
        "backends:\n  - id: eu-frankfurt\n    model: beta\n    lora_modules: [sql, chat=/c]\n"
    )
    started: list[StackSettings] = []
    monkeypatch.setattr(emulator.stack.stack, "run_until_signalled", started.append)
    args = build_parser().parse_args(["up", "--flavor", "vllm", "--fleet", str(fleet)])
    args.func(args)
    (s,) = started
    assert s.engine_models == {"eu-frankfurt": "beta"}
    assert s.engine_loras == {"eu-frankfurt": ("sql", "chat=/c")}
    argv = engine_argv(s, 1, "eu-frankfurt", 18002, 1)
    parsed = build_parser().parse_args(argv[3:])
    assert parsed.served_model_name == ["beta"] and parsed.enable_lora
    assert parsed.lora_modules == ["sql=/lora/sql", "chat=/c"]
    lora = _lora_settings(parsed)
    assert [(m.name, m.path) for m in lora["lora_modules"]] == [
        ("sql", "/lora/sql"),
        ("chat", "/c"),
    ]
    plain = build_parser().parse_args(engine_argv(s, 0, "us-ashburn", 18001, 0)[3:])
    assert plain.served_model_name is None and not plain.enable_lora and not plain.lora_modules
    sglang = engine_argv(StackSettings(engine_loras={"ap-seoul": ["a"]}), 2, "ap-seoul", 1, 2)
    assert sglang[sglang.index("--lora-paths") + 1] == "a=/lora/a"
    assert "--enable-lora" not in sglang  # SGLang: --lora-paths enables LoRA itself
    # real vLLM engines are not the twin's to name
    real = build_parser().parse_args(["up", "--engine", "vllm", "--fleet", str(fleet)])
    assert real.func(real) == 2
    assert "model and lora_modules set emulated engines'" in capsys.readouterr().err


def test_each_stack_gives_every_router_its_own_admin_token_and_a_last_good_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gorgo up` sets an admin token (issue 39: without one a web page could post to the
    admin), random per stack unless given, and hands it, with a last good config path of
    its own, to every router it starts: the main one, the extra ones, each front door's."""
    ports = StackPorts.ephemeral(len(DEFAULT_REGIONS))
    stack = Stack(
        StackSettings(ports=ports, workdir=tmp_path, routers=2, front_door_regions=["ap-seoul"])
    )
    spawned: dict[str, tuple[list[str], dict[str, str] | None]] = {}

    def spawn(name: str, argv: list[str], env: dict[str, str] | None = None, **_: Any) -> None:
        spawned[name] = (argv, env)

    monkeypatch.setattr(stack, "_spawn", spawn)
    stack.start_router()
    stack.doors[0].start(stack)
    routers = sorted(n for n in spawned if n.endswith("gorgo-serve"))
    assert routers == [
        "door-ap-seoul-2-gorgo-serve",
        "door-ap-seoul-gorgo-serve",
        "gorgo-serve",
        "router-2-gorgo-serve",
    ]
    token = stack.admin_token
    assert len(token) >= 32
    for name in routers:
        argv, env = spawned[name]
        assert env == {"GORGO_ADMIN_TOKEN": token}
        last_good = argv[argv.index("--last-good-config") + 1]
        assert last_good == str(tmp_path / f"{name}.last-good.yaml")
    assert spawned["door-ap-seoul-envoy"][1] is None  # only the routers get it
    assert f"Authorization: Bearer {token}" in stack.ready_line()
    assert stack.admin_headers["Authorization"] == f"Bearer {token}"
    other = Stack(StackSettings(ports=ports, workdir=tmp_path / "b"))
    assert other.admin_token != token
    given = Stack(StackSettings(ports=ports, workdir=tmp_path / "c", admin_token="mine"))
    assert given.admin_token == "mine"


def test_up_takes_the_admin_token_from_its_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import emulator.stack.stack
    from ext_proc.cli import build_parser

    started: list[StackSettings] = []
    monkeypatch.setattr(emulator.stack.stack, "run_until_signalled", started.append)
    monkeypatch.delenv("GORGO_ADMIN_TOKEN", raising=False)
    for argv in (["up"], ["up", "--admin-token", "flag"]):
        args = build_parser().parse_args(argv)
        args.func(args)
    monkeypatch.setenv("GORGO_ADMIN_TOKEN", "env")
    args = build_parser().parse_args(["up"])
    args.func(args)
    assert [s.admin_token for s in started] == ["", "flag", "env"]  # "": a random one


@pytest.mark.parametrize("keep", [True, False])
def test_a_stopped_stack_keeps_its_logs_unless_told(keep: bool) -> None:
    stack = Stack(StackSettings(ports=StackPorts.ephemeral(3), keep_logs=keep))
    workdir = stack.workdir
    (workdir / "gorgo-serve.log").write_text("gorgo serve: ready\n")
    (workdir / "gorgo.yaml").write_text("policy: gorgo\n")
    (workdir / "xds").mkdir()
    stack.stop()
    try:
        assert (workdir / "gorgo-serve.log").exists() == keep
        assert (workdir / "gorgo.yaml").exists() == keep
        assert not (workdir / "xds").exists()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("fails", ["at start", "in a crash loop"])
def test_gorgo_up_says_where_the_logs_are_kept_when_it_stops(
    fails: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    from emulator.stack import stack as stack_module
    from emulator.stack.processes import StackError

    def start(self: Stack) -> None:
        (self.workdir / "envoy.log").write_text("envoy: bad\n")
        if fails == "at start":
            raise StackError("envoy exited with code 1")

    def tend(self: Stack) -> None:
        raise StackError("wan-ap-seoul exited (code 1) after 5 restarts within 60 s")

    monkeypatch.setattr(stack_module.Stack, "start", start)
    monkeypatch.setattr(stack_module.Stack, "tend", tend)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = stack_module.run_until_signalled(StackSettings(ports=StackPorts.ephemeral(3)))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    kept = re.search(r"gorgo up: the logs are kept in (\S+)", err)
    assert rc == 1 and kept, err
    try:
        assert (Path(kept.group(1)) / "envoy.log").read_text() == "envoy: bad\n"
    finally:
        shutil.rmtree(kept.group(1), ignore_errors=True)


def test_up_starts_the_first_n_regions_and_refuses_a_count_out_of_range(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import emulator.stack.stack
    from ext_proc.cli import build_parser

    started: list[StackSettings] = []
    monkeypatch.setattr(emulator.stack.stack, "run_until_signalled", started.append)
    for n in ("1", "2"):
        args = build_parser().parse_args(["up", "--engine", "vllm", "--regions", n])
        args.func(args)
    assert [[r.id for r in s.regions] for s in started] == [
        ["us-ashburn"],
        ["us-ashburn", "eu-frankfurt"],
    ]
    # the router's config lists only the engines started
    cfg = started[0].gorgo_config()
    assert [b.id for b in cfg.backends] == ["us-ashburn"]
    for bad in ("0", "4"):
        args = build_parser().parse_args(["up", "--regions", bad])
        assert args.func(args) == 2
    assert "--regions must be 1..3" in capsys.readouterr().err
    assert len(started) == 2


def test_each_front_door_has_as_many_routers_as_the_first_and_reaches_only_its_own(
    tmp_path: Path,
) -> None:
    """`gorgo up --front-doors 3 --routers 2`: each door's Envoy lists its own two routers
    (it listed the first door's, so its own decided nothing); each router has its own
    ports and bus id."""
    ports = StackPorts.ephemeral(len(DEFAULT_REGIONS))
    stack = Stack(
        StackSettings(
            ports=ports,
            workdir=tmp_path,
            routers=2,
            front_door_regions=["eu-frankfurt", "ap-seoul"],
        )
    )
    main = stack.config.envoy.ext_proc_addresses
    assert len(main) == 2
    seen = set(main)
    for door in stack.doors:
        mine = door.config.envoy.ext_proc_addresses
        assert mine == (door.config.listen.grpc, door.extra_routers[0].listen.grpc)
        assert not seen & set(mine)
        seen |= set(mine)
        ids = {door.config.bus.router_id, *(c.bus.router_id for c in door.extra_routers)}
        assert ids == {f"door-{door.region}", f"door-{door.region}-2"}
        assert len(door.admin_urls) == 2
    one = Stack(StackSettings(ports=ports, workdir=tmp_path / "b", front_door_regions=["ap-seoul"]))
    assert one.doors[0].extra_routers == [] and not one.doors[0].config.envoy.ext_proc_addresses
