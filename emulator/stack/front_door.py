"""More front doors for the local stack: each an Envoy and routers of its own in another
region (as many as the stack's door has: `--routers M`, all in its Envoy's ext_proc
cluster), reaching the stack's engines over WAN links at that region's RTTs
(emulator/wan.py REGION_RTT_MS).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from emulator.stack.ports import free_ports
from emulator.stack.processes import wan_argv
from emulator.stack.settings import StackSettings, config_yaml, replica_config
from emulator.wan import region_rtt_ms
from ext_proc.common.files import write_atomic
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.envoy_config.xds import write_xds


class DoorHost(Protocol):
    """What a front door needs of the stack it joins (emulator/stack/stack.py's Stack):
    its settings, router config and work directory, and its ways to start children."""

    @property
    def settings(self) -> StackSettings: ...

    @property
    def config(self) -> Config: ...

    @property
    def workdir(self) -> Path: ...

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, group: bool = False
    ) -> None: ...

    def spawn_router(self, name: str, config: Path, args: Sequence[str] = ()) -> None: ...

    def start_envoy(self, name: str = "envoy", config_text: str | None = None) -> None: ...


class FrontDoor:
    """One more front door: an Envoy and `stack.settings.routers` routers in `region`,
    reaching every backend over WAN links of its own at that region's RTTs; the engines
    (and their KV events) are the stack's."""

    def __init__(self, region: str, stack: DoorHost) -> None:
        self.region = region
        regions = stack.settings.regions
        n_routers = max(1, stack.settings.routers)
        ports = free_ports(2 + 2 * n_routers + len(regions))
        self.front_door, self.envoy_admin = ports[:2]
        mine = ports[2 : 2 + 2 * n_routers]  # (grpc, admin) per router
        router_ports = list(zip(mine[0::2], mine[1::2], strict=True))
        (self.grpc, self.admin), extra = router_ports[0], router_ports[1:]
        self.links = ports[2 + 2 * n_routers :]
        raw = config_as_dict(stack.config)
        raw["listen"].update(grpc=f"127.0.0.1:{self.grpc}", admin=f"127.0.0.1:{self.admin}")
        raw["envoy"].update(
            listen=f"127.0.0.1:{self.front_door}", admin=f"127.0.0.1:{self.envoy_admin}"
        )
        # Its Envoy reaches its own routers, never the stack's door's (the copied list).
        raw["envoy"]["ext_proc_address"] = ""
        raw["envoy"]["ext_proc_addresses"] = (
            [f"127.0.0.1:{g}" for g, _ in router_ports] if n_routers > 1 else []
        )
        raw["envoy"]["xds_dir"] = str(stack.workdir / f"door-{region}-xds")
        raw["bus"]["router_id"] = f"door-{region}"
        door = 1 + list(stack.settings.front_door_regions).index(region)
        raw["bus"]["nats_url"] = stack.settings.nats_url_for(door)  # its own server first
        for b, r, link in zip(raw["backends"], regions, self.links, strict=True):
            b["address"] = f"127.0.0.1:{link}"
            b["rtt_prior_ms"] = region_rtt_ms(region, r.id)
        self.config = config_from_dict(raw)
        # The door's other routers (emulator.stack.settings.replica_config).
        names = [f"door-{region}-{k + 2}" for k in range(len(extra))]
        self.extra_routers = [
            replica_config(self.config, g, a, name, stack.workdir / f"{name}-xds")
            for name, (g, a) in zip(names, extra, strict=True)
        ]

    @property
    def admin_urls(self) -> list[str]:
        """Every router's admin URL behind this door, the first's first."""
        return [self.admin_url, *(f"http://{c.listen.admin}" for c in self.extra_routers)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front_door}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin}"

    def start(self, stack: DoorHost) -> None:
        name = f"door-{self.region}"
        for i, (r, link) in enumerate(zip(stack.settings.regions, self.links, strict=True)):
            rtt_ms = region_rtt_ms(self.region, r.id)
            target = stack.settings.ports.engine(i)
            stack._spawn(f"{name}-wan-{r.id}", wan_argv(link, target, ["--rtt-ms", str(rtt_ms)]))
        cfg_path = stack.workdir / f"{name}-gorgo.yaml"
        write_atomic(cfg_path, config_yaml(self.config))
        stack.spawn_router(f"{name}-gorgo-serve", cfg_path)
        for k, cfg in enumerate(self.extra_routers):
            path = stack.workdir / f"{name}-{k + 2}-gorgo.yaml"
            write_atomic(path, config_yaml(cfg))
            stack.spawn_router(f"{name}-{k + 2}-gorgo-serve", path)
        write_xds(self.config)
        stack.start_envoy(f"{name}-envoy", render_envoy_config(self.config))
