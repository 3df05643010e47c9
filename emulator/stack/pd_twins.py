"""`gorgo up --pd`'s children: each region's prefill and decode twin and the KV links
between regions (the layout: emulator/stack/pd.py), their command lines, starting them,
and what the ready line says of them.
"""

from __future__ import annotations

import json
from typing import Protocol

from emulator.stack.pd import PdLayout
from emulator.stack.processes import engine_argv, wan_argv
from emulator.stack.settings import StackSettings

# vLLM's roles for a prefill-only and a decode-only instance (vllm/config/kv_transfer.py).
NIXL_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


class TwinHost(Protocol):
    """What the twins need of the stack they run in (emulator/stack/stack.py's Stack)."""

    @property
    def settings(self) -> StackSettings: ...

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, group: bool = False
    ) -> None: ...

    def door_delay(self, i: int) -> list[str]: ...


def twin_flags(settings: StackSettings, name: str, role: str) -> list[str]:
    """The P/D flags of a `role` twin named `name` speaking the stack's protocol: SGLang's
    --disaggregation-mode; vLLM's --kv-transfer-config with NIXL (its side channel's port
    is in VLLM_NIXL_SIDE_CHANNEL_PORT, as vLLM reads it)."""
    assert settings.pd is not None
    scale = ["--kv-byte-scale", f"{settings.pd.kv_byte_scale:g}"]
    if settings.pd.protocol == "sglang":
        return ["--disaggregation-mode", role, *scale]
    spec = {"kv_connector": "NixlConnector", "kv_role": NIXL_ROLES[role], "engine_id": name}
    return ["--kv-transfer-config", json.dumps(spec), *scale]


def prefill_argv(settings: StackSettings, i: int) -> tuple[list[str], dict[str, str]]:
    """Region i's prefill twin: its side server on the layout's port, advertised as its
    region's local KV link (pd.py)."""
    pd, n, region = settings.pd_layout(), len(settings.regions), settings.regions[i].id
    name = f"{region}-prefill"
    argv = engine_argv(settings, n + i, name, pd.prefill(i), settings.seed + n + i, region)
    flags, env = twin_flags(settings, name, "prefill"), {}
    if settings.flavor == "sglang":
        flags += ["--disaggregation-bootstrap-port", str(pd.side(i))]
    else:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(pd.side(i))
    return [*argv, *flags, "--kv-advertise", pd.advertised(i)], env


def decode_argv(settings: StackSettings, i: int) -> tuple[list[str], dict[str, str]]:
    """Region i's decode twin, in the engine's place (its port, name and seed), routing the
    other regions' prefills through their links to it (pd.py)."""
    pd, region = settings.pd_layout(), settings.regions[i].id
    argv = engine_argv(settings, i, region, settings.ports.engine(i), settings.seed + i)
    flags, env = twin_flags(settings, region, "decode"), {}
    if settings.flavor == "vllm":
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "0"  # any free port: nobody reads a decode's KV
    for item in pd.routes(i):
        flags += ["--kv-route", item]
    return [*argv, *flags], env


def kv_link_argv(settings: StackSettings, a: int, b: int) -> list[str]:
    """The link carrying KV from region a's prefill to region b's decode (pd.py)."""
    assert settings.pd is not None
    pd = settings.pd_layout()
    return wan_argv(
        pd.kv_link(a, b),
        pd.side(a),
        [
            "--rtt-ms", f"{pd.kv_rtt_ms(a, b):g}",
            "--gbps", f"{settings.pd.kv_link_gbps:g}",
            "--byte-scale", f"{settings.pd.kv_byte_scale:g}",
        ],
    )  # fmt: skip


def start_twins(host: TwinHost, i: int) -> None:
    """Region i's prefill and decode twins (and, when the router is told of the prefills,
    the front door's link to the prefill, with the region's delay)."""
    s = host.settings
    assert s.pd is not None
    region = s.regions[i].id
    for role, (argv, env) in (("prefill", prefill_argv(s, i)), ("decode", decode_argv(s, i))):
        host._spawn(f"{role}-{region}", argv, env or None)
    if s.pd.route_roles and s.wan_links:
        pd = s.pd_layout()
        host._spawn(
            f"wan-{region}-prefill", wan_argv(pd.prefill_door(i), pd.prefill(i), host.door_delay(i))
        )


def start_kv_links(host: TwinHost) -> None:
    s = host.settings
    for a, b in s.pd_layout().links():
        name = f"kv-{s.regions[a].id}-to-{s.regions[b].id}"
        host._spawn(name, kv_link_argv(s, a, b))


def ready_ports(settings: StackSettings) -> list[int]:
    """Ports the twins' children listen on beyond the engines' HTTP: the KV links (and the
    prefills' door links, when started)."""
    pd = settings.pd_layout()
    ports = [pd.kv_link(a, b) for a, b in pd.links()]
    if settings.pd is not None and settings.pd.route_roles and settings.wan_links:
        ports += [pd.prefill_door(i) for i in range(pd.n)]
    return ports


def pd_summary(settings: StackSettings, layout: PdLayout) -> str:
    """The ready line's account of the twins and the KV links."""
    assert settings.pd is not None
    twins = "; ".join(
        f"{r.id} prefill :{layout.prefill(i)} (side :{layout.side(i)}, advertised "
        f"{layout.advertised(i)}) decode :{settings.ports.engine(i)}"
        for i, r in enumerate(settings.regions)
    )
    gbps = settings.pd.kv_link_gbps
    links = ", ".join(
        f"{settings.regions[a].id}->{settings.regions[b].id} :{layout.kv_link(a, b)} "
        f"{layout.kv_rtt_ms(a, b):g} ms"
        for a, b in layout.links()
    )
    routed = "decodes routed" if not settings.pd.route_roles else "prefills and decodes routed"
    return (
        f"P/D twins ({settings.pd.protocol} protocol, {routed}): {twins} | KV links at "
        f"{f'{gbps:g} Gbit/s' if gbps else 'unlimited bandwidth'}: {links}"
    )
