"""More front doors for the local stack: each an Envoy and a router of its own in another
region, reaching the stack's engines over WAN links at that region's RTTs
(emulator/wan.py REGION_RTT_MS).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from emulator.stack.ports import free_ports
from emulator.stack.processes import wan_argv
from emulator.stack.settings import StackSettings, config_yaml
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
    """One more front door: an Envoy and a router in `region`, reaching every backend over
    WAN links of its own at that region's RTTs; the engines (and their KV events) are the
    stack's."""

    def __init__(self, region: str, stack: DoorHost) -> None:
        self.region = region
        regions = stack.settings.regions
        ports = free_ports(4 + len(regions))
        self.front_door, self.envoy_admin, self.grpc, self.admin = ports[:4]
        self.links = ports[4:]
        raw = config_as_dict(stack.config)
        raw["listen"].update(grpc=f"127.0.0.1:{self.grpc}", admin=f"127.0.0.1:{self.admin}")
        raw["envoy"].update(
            listen=f"127.0.0.1:{self.front_door}", admin=f"127.0.0.1:{self.envoy_admin}"
        )
        raw["envoy"]["ext_proc_address"] = ""
        raw["envoy"]["xds_dir"] = str(stack.workdir / f"door-{region}-xds")
        raw["bus"]["router_id"] = f"door-{region}"
        for b, r, link in zip(raw["backends"], regions, self.links, strict=True):
            b["address"] = f"127.0.0.1:{link}"
            b["rtt_prior_ms"] = region_rtt_ms(region, r.id)
        self.config = config_from_dict(raw)

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
        write_xds(self.config)
        stack.start_envoy(f"{name}-envoy", render_envoy_config(self.config))
