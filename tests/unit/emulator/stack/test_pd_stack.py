"""`gorgo up --pd` (emulator/stack/pd.py, pd_twins.py): the flags become StackSettings,
each region a prefill and a decode twin whose command lines `gorgo engine` reads back, a
KV link per ordered pair of regions at that pair's RTT, the prefills' advertised address
and the decodes' routes agreeing so every transfer crosses the link between the two
twins' regions, and the router told of both roles (the decodes alone with route_roles off).
Nothing binds or starts: the ports are given and the children recorded, not spawned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from emulator.engine.disagg.cli import disagg_settings
from emulator.stack.pd import PdLayout, PdSettings
from emulator.stack.pd_twins import decode_argv, kv_link_argv, prefill_argv
from emulator.stack.settings import DEFAULT_REGIONS, StackPorts, StackSettings
from emulator.stack.stack import Stack
from emulator.wan import region_rtt_ms
from ext_proc.cli import build_parser
from ext_proc.config.dump import config_as_dict

TWO = DEFAULT_REGIONS[:2]  # us-ashburn, eu-frankfurt (90 ms)
PD_PORTS = list(range(22001, 22001 + PdLayout.size(2)))


def pd_settings(protocol: str = "sglang", **extra: Any) -> StackSettings:
    pd = PdSettings(protocol=protocol, ports=list(PD_PORTS), **extra.pop("pd", {}))
    return StackSettings(regions=TWO, flavor=protocol, pd=pd, **extra)


def up(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int | None, list[StackSettings]]:
    import emulator.stack.stack

    started: list[StackSettings] = []
    monkeypatch.setattr(emulator.stack.stack, "run_until_signalled", started.append)
    args = build_parser().parse_args(["up", *argv])
    return args.func(args), started


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_up_pd_makes_the_settings_and_refuses_what_does_not_go_with_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, started = up(monkeypatch, "--pd", "--regions", "2")
    (s,) = started
    assert s.pd is not None and [r.id for r in s.regions] == [r.id for r in TWO]
    assert (s.pd.protocol, s.flavor, s.pd.kv_link_gbps, s.pd.route_roles) == (
        "sglang",
        "sglang",
        10.0,
        True,
    )
    _, (v,) = up(monkeypatch, "--pd", "--pd-protocol", "vllm", "--kv-link-gbps", "2.5")
    assert v.pd is not None and (v.pd.protocol, v.flavor, v.pd.kv_link_gbps) == (
        "vllm",
        "vllm",
        2.5,
    )
    _, (f,) = up(monkeypatch, "--pd", "--flavor", "vllm")  # the protocol follows --flavor
    assert f.pd is not None and f.pd.protocol == "vllm"
    _, (plain,) = up(monkeypatch)  # without --pd: as ever
    assert plain.pd is None and plain.flavor == "sglang"
    for bad in (
        ["--pd", "--flavor", "sglang", "--pd-protocol", "vllm"],
        ["--pd", "--engine", "vllm"],
        ["--pd", "--kv-link-gbps", "-1"],
        ["--pd-protocol", "vllm"],
        ["--kv-link-gbps", "5"],
        ["--pd", "--front-doors", "2"],
    ):
        assert up(monkeypatch, *bad)[0] == 2, bad
        assert "gorgo up:" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_each_region_runs_a_prefill_and_a_decode_twin_that_gorgo_engine_reads(
    protocol: str,
) -> None:
    s = pd_settings(protocol)
    pd = s.pd_layout()
    for i, r in enumerate(TWO):
        p_argv, p_env = prefill_argv(s, i)
        d_argv, d_env = decode_argv(s, i)
        p_args, d_args = (build_parser().parse_args(a[3:]) for a in (p_argv, d_argv))
        # the decode takes the engine's place: its name (the backend id), port and seed
        assert (d_args.name, d_args.port, d_args.seed) == (r.id, s.ports.engine(i), i)
        assert (p_args.name, p_args.port) == (f"{r.id}-prefill", pd.prefill(i))
        assert p_args.flavor == d_args.flavor == protocol
        p, d = disagg_settings(p_args, p_env), disagg_settings(d_args, d_env)
        assert p is not None and d is not None
        assert (p.mode, d.mode) == ("prefill", "decode")
        assert p.kv_byte_scale == d.kv_byte_scale == 1024
        # the side server listens where the region's local KV link points ...
        side = p.bootstrap_port if protocol == "sglang" else p.side_channel_port
        assert side == pd.side(i)
        # ... and is advertised as that link
        assert p.advertised() == ("127.0.0.1", pd.kv_link(i, i))
        if protocol == "vllm":
            assert json.loads(flag(p_argv, "--kv-transfer-config"))["kv_role"] == "kv_producer"
            assert json.loads(flag(d_argv, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
            assert d.side_channel_port == 0  # a free one: nobody reads a decode's KV
        else:
            assert p_env == d_env == {}


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_every_transfer_crosses_the_link_between_the_two_twins_regions(protocol: str) -> None:
    """Prefill a advertises an address; decode b dials it through its route; that address
    is the KV link a->b, which leads to a's side server at the pair's RTT and the KV
    bandwidth, charging each byte as the twins' scale."""
    s = pd_settings(protocol, pd={"kv_link_gbps": 2.5})
    pd = s.pd_layout()
    links = {}
    for a in range(2):
        for b in range(2):
            argv = kv_link_argv(s, a, b)[3:]
            args = build_parser().parse_args(argv)
            links[args.listen] = (args.target, args.rtt_ms, args.gbps, args.byte_scale)
    assert len(links) == 4 == len(set(links))
    for b in range(2):
        d_argv, d_env = decode_argv(s, b)
        decode = disagg_settings(build_parser().parse_args(d_argv[3:]), d_env)
        assert decode is not None
        for a in range(2):
            p_argv, p_env = prefill_argv(s, a)
            prefill = disagg_settings(build_parser().parse_args(p_argv[3:]), p_env)
            assert prefill is not None
            host, port = prefill.advertised()
            dialled = decode.via(f"{host}:{port}")
            target, rtt_ms, gbps, scale = links[dialled]
            assert dialled == f"127.0.0.1:{pd.kv_link(a, b)}"
            assert target == f"127.0.0.1:{pd.side(a)}"
            assert rtt_ms == region_rtt_ms(TWO[a].id, TWO[b].id) == (1.0 if a == b else 90.0)
            assert (gbps, scale) == (2.5, 1024.0)


def test_the_stack_starts_twins_links_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What Stack.start spawns for `--pd --regions 2` (recorded, not started), what the
    router is told (both roles, the prefills behind links of their own), and the ready line."""
    s = pd_settings(ports=StackPorts.ephemeral(2), workdir=tmp_path)
    stack = Stack(s)
    spawned: dict[str, tuple[list[str], dict[str, str] | None]] = {}

    def spawn(name: str, argv: list[str], env: dict[str, str] | None = None, **_: Any) -> None:
        spawned[name] = (argv, env)

    monkeypatch.setattr(stack, "_spawn", spawn)
    for i in range(2):
        stack.start_engine(i)
        stack.start_wan(i)
    from emulator.stack.pd_twins import start_kv_links

    start_kv_links(stack)
    names = {"us-ashburn", "eu-frankfurt"}
    assert set(spawned) == {
        *(f"{kind}-{r}" for kind in ("prefill", "decode", "wan") for r in names),
        *(f"wan-{r}-prefill" for r in names),
        *(f"kv-{a}-to-{b}" for a in names for b in names),
    }
    # the front door's link leads to the decode, as to the engine without --pd
    wan = build_parser().parse_args(spawned["wan-eu-frankfurt"][0][3:])
    assert wan.target == f"127.0.0.1:{s.ports.engine(1)}"
    raw = config_as_dict(stack.config)
    pd = s.pd_layout()
    assert [(b["id"], b["address"], b["role"]) for b in raw["backends"]] == [
        *((r.id, f"127.0.0.1:{s.ports.wan(i)}", "decode") for i, r in enumerate(TWO)),
        *(
            (f"{r.id}-prefill", f"127.0.0.1:{pd.prefill_door(i)}", "prefill")
            for i, r in enumerate(TWO)
        ),
    ]
    # the prefill's front-door link leads to the prefill twin
    door = build_parser().parse_args(spawned["wan-eu-frankfurt-prefill"][0][3:])
    assert door.target == f"127.0.0.1:{pd.prefill(1)}"
    line = stack.ready_line()
    assert "P/D twins (sglang protocol, prefills and decodes routed)" in line
    assert f"us-ashburn prefill :{pd.prefill(0)}" in line
    assert f"decode :{s.ports.engine(1)}" in line
    assert f"us-ashburn->eu-frankfurt :{pd.kv_link(0, 1)} 90 ms" in line
    assert "KV links at 10 Gbit/s" in line


def test_roles_reach_the_router_config_by_default() -> None:
    """route_roles (on by default): the decodes with role decode, the
    prefills as backends of their own, behind front-door links, SGLang's with the
    bootstrap port a P/D router names (the advertised one)."""
    s = pd_settings()
    pd = s.pd_layout()
    backends = s.router_backends()
    assert [(b["id"], b["role"]) for b in backends] == [
        ("us-ashburn", "decode"),
        ("eu-frankfurt", "decode"),
        ("us-ashburn-prefill", "prefill"),
        ("eu-frankfurt-prefill", "prefill"),
    ]
    assert backends[3]["address"] == f"127.0.0.1:{pd.prefill_door(1)}"
    assert backends[3]["bootstrap_port"] == pd.kv_link(1, 1)
    vllm = pd_settings("vllm").router_backends()
    assert [b["role"] for b in vllm] == ["decode", "decode", "prefill", "prefill"]
    assert not any("bootstrap_port" in b for b in vllm)  # NIXL: the prefill's answer says
    off = pd_settings(pd={"route_roles": False}).router_backends()
    assert [b["id"] for b in off] == ["us-ashburn", "eu-frankfurt"]  # the decodes, whole
    assert all("role" not in b for b in off)
    # the router's schema takes them (backends[].role, bootstrap_port on the address's host)
    parsed = pd_settings().gorgo_config().backends
    assert [(b.id, b.role.value) for b in parsed][1:3] == [
        ("eu-frankfurt", "decode"),
        ("us-ashburn-prefill", "prefill"),
    ]
    assert parsed[2].bootstrap_port == pd.kv_link(0, 0)
