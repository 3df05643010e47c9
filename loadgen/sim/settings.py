"""What one simulation runs: the policy, the time scale, the RTT profile, the fleet, how
many routers and front doors, the client protocol, the router config's overrides, and the
request classes (`loadgen.sim.classes`)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from emulator.engine.priority import PriorityScheduling
from emulator.stack.fleet import NO_FLEET, Fleet
from emulator.stack.settings import DEFAULT_REGIONS
from emulator.wan import NETWORK_JITTER_FRACTION, region_rtt_ms, rtt_profile_ms
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.vocab.backend import DEFAULT_PROFILE
from loadgen.client.protocol import OPEN, Protocol
from loadgen.sim.classes import Classes
from loadgen.sim.rivals.names import is_rival

# The single proxy of the paper's setup (front_doors 0): its RTTs are the RTT profile's.
PROXY = ""
# A region's prefill engine's backend id: the region's id with this after it (pd).
PREFILL_SUFFIX = "-prefill"


@dataclass
class SimSettings:
    policy: str = "gorgo"
    time_scale: float = 1.0
    rtt_profile: str = "network"
    engine_profile: str = DEFAULT_PROFILE
    seed: int = 0
    regions: Sequence[str] = tuple(r.id for r in DEFAULT_REGIONS)
    # Extra router config (weights, routing, probes), merged into the generated config.
    router: dict[str, Any] = field(default_factory=dict)
    # Tune the weights online: "off", "paired" or "paper" (the router config's tuner mode).
    tune: str = "off"
    # "approximate": the router's own estimate of what each engine caches; "precise": the
    # engines' own cache changes reach it (as KV events would, one WAN half-trip later).
    prefix_state: str = "approximate"
    # Routers deciding side by side (replicas; with front doors, this many behind each
    # door), each with its own state; a session always goes through the same one of its
    # door's (crc32 of its key). With
    # precise state they all see every engine's cache changes; approximate, each knows only
    # what it dispatched.
    routers: int = 1
    # The engines' own load reports (/metrics), scraped by every router each
    # probes.metrics_interval_s as live; the report reaches it a WAN half-trip after the
    # engine's reading.
    engine_reports: bool = False
    # 0: the paper's setup, one proxy with its clients beside it. N >= 1: a front door
    # (Envoy + router) in each of the first N regions, at the inter-region RTTs of
    # emulator.wan.REGION_RTT_MS; each session comes from an origin region (a crc32 of its
    # key over origin_shares, per region, equal by default) and enters the door of its own
    # region (the first door when its region has none): TTFT and E2E then include that
    # access leg. --front-doors 1 is the single proxy with clients spread over the regions.
    front_doors: int = 0
    origin_shares: Sequence[float] = ()
    # The routers publish their dispatches to each other (ext_proc.feeds.peers, over NATS live):
    # one bus hop later, or the half-trip between two front doors' regions.
    share_dispatches: bool = False
    # The client protocol (loadgen.client.protocol): a concurrency cap with slip, output lengths
    # forced, long prompts dropped. OPEN: the trace as it is, open loop.
    protocol: Protocol = OPEN
    # The live front door's pace: it takes in one request at a time (client, Envoy and
    # the router's ext_proc in turn), door_spacing_ms apart, so requests the trace sends at
    # one instant are decided, and reach an engine, in the order sent. 0: all decided at
    # that instant, and their order at an engine is the WAN jitter's.
    door_spacing_ms: float = 0.0
    # Envoy's upstream connections (HTTP/1.1: one per request in flight, kept open when
    # idle), one pool per Envoy worker thread, each request on a worker at random: a
    # request that finds every connection of its worker to its backend busy opens one and
    # waits for the TCP handshake, one more round trip (emulator/wan.py). 0: not modelled.
    envoy_workers: int = 0
    # The engines' truth per region (emulator/stack/fleet.py; a region it does not list runs
    # engine_profile). The router is configured as a user would be, engine_profile for
    # every backend, unless router_knows_fleet tells it each engine's own (the reference).
    fleet: Fleet = NO_FLEET
    router_knows_fleet: bool = False
    # Flow control in the router (the gateway queue), and the classes the sessions are
    # shared into (None: one default class, no SLO, one tenant).
    flow_control: bool = False
    classes: Classes | None = None
    # The engines' own priority scheduling (SGLang's --enable-priority-scheduling and its
    # flags, emulator/engine/priority.py; None: off, FCFS): each request reaches its
    # engine with its class's `priority` in the engine's sign (higher first unless
    # low_values_first), a request of no class with none.
    engine_priority: PriorityScheduling | None = None
    # Prefill and decode apart (issue 59): each region a prefill engine ({region}-prefill)
    # and a decode engine ({region}), the prompt's KV moving between them over a link of
    # kv_link_gbps (each pair of regions one wire, transfers in turn) and the regions' RTT;
    # a decode engine starts a request as `pd_protocol`'s engine does
    # (emulator/engine/disagg/prebuilt.py). `pd_aggregated`: the same engines, two per
    # region, each taking requests whole (the baseline without P/D).
    pd: bool = False
    pd_aggregated: bool = False
    kv_link_gbps: float = 10.0
    pd_protocol: str = "sglang"
    # The link between two engines of one region (its own fabric: RDMA, NVLink between
    # hosts), Gbit/s.
    local_kv_link_gbps: float = 100.0

    def __post_init__(self) -> None:
        if self.pd and self.pd_aggregated:
            raise ValueError("pd and pd_aggregated: one layout or the other")
        if (self.pd or self.pd_aggregated) and self.rtt_profile != "network":
            raise ValueError("pd: the links between regions are the `network` profile's RTTs")
        for key in ("kv_link_gbps", "local_kv_link_gbps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.pd_protocol not in ("sglang", "vllm"):
            raise ValueError(f"pd_protocol: sglang or vllm, got {self.pd_protocol!r}")
        if not 0 <= self.front_doors <= len(self.regions):
            raise ValueError(
                f"front_doors: 0..{len(self.regions)} (one per region), got {self.front_doors}"
            )
        if self.front_doors and self.rtt_profile != "network":
            raise ValueError("front_doors: the inter-region RTTs are the `network` profile's")
        if self.origin_shares and (
            len(self.origin_shares) != len(self.regions)
            or min(self.origin_shares) < 0
            or sum(self.origin_shares) <= 0
        ):
            raise ValueError(
                f"origin_shares: one non-negative share per region ({', '.join(self.regions)}), "
                f"not all zero; got {list(self.origin_shares)}"
            )

    @property
    def doors(self) -> list[str]:
        """The front doors' regions ([PROXY]: the single proxy of the paper's setup)."""
        return list(self.regions[: self.front_doors]) or [PROXY]

    @property
    def backends(self) -> dict[str, str]:
        """Each engine's backend id -> its region: one per region, or two with `pd`
        (a decode engine under the region's id, its prefill engine beside it) or
        `pd_aggregated` ({region}-2 beside it)."""
        out = {r: r for r in self.regions}
        second = PREFILL_SUFFIX if self.pd else "-2" if self.pd_aggregated else ""
        if second:
            out.update({f"{r}{second}": r for r in self.regions})
        return out

    def rtt_ms(self, door: str, backend: str) -> tuple[float, float]:
        """(mean, std) of the round trip from a front door to a backend."""
        backend = self.backends.get(backend, backend)  # its region's
        if door == PROXY:
            return rtt_profile_ms(self.rtt_profile, backend)
        mean_ms = region_rtt_ms(door, backend)
        return mean_ms, mean_ms * NETWORK_JITTER_FRACTION

    def origin(self, session: str) -> str:
        """The region a session's client is in (deterministic in its key)."""
        shares = list(self.origin_shares) or [1.0] * len(self.regions)
        x = zlib.crc32(f"origin:{session}".encode()) / 2**32 * sum(shares)
        for region, share in zip(self.regions, shares, strict=True):
            x -= share
            if x < 0:
                return region
        return self.regions[-1]

    def kv_gbps(self, a: str, b: str) -> float:
        """The bandwidth of the KV link between regions a and b."""
        return self.local_kv_link_gbps if a == b else self.kv_link_gbps

    def role_of(self, backend: str) -> str:
        """A P/D fleet's backend role: its prefill engines', else decode."""
        return "prefill" if backend.endswith(PREFILL_SUFFIX) else "decode"

    def door_of(self, origin: str) -> str:
        doors = self.doors
        return origin if origin in doors else doors[0]

    def engine_profile_of(self, region: str) -> str:
        """The profile region's engine runs."""
        return self.fleet.profile_of(region, self.engine_profile)

    def router_profile_of(self, region: str) -> str:
        """The profile the router is told region's engine runs."""
        return self.engine_profile_of(region) if self.router_knows_fleet else self.engine_profile

    def config(self, door: str = PROXY) -> Config:
        raw: dict[str, Any] = {
            # A rival router's rule is no product policy: the router is configured with a
            # stand-in and handed the rival (loadgen/sim/rivals).
            "policy": "round_robin" if is_rival(self.policy) else self.policy,
            "seed": self.seed,
            "backends": [
                {
                    "id": b,
                    "address": f"127.0.0.1:{18101 + i}",
                    "region": r,
                    "rtt_prior_ms": self.rtt_ms(door, b)[0],
                    "engine_profile": self.router_profile_of(r),
                    **({"role": self.role_of(b), "engine": self.pd_protocol} if self.pd else {}),
                }
                for i, (b, r) in enumerate(self.backends.items())
            ],
        }
        if self.pd:  # the links as the user would write them: the bandwidth, each RTT
            links = [
                {"regions": [a, b], "gbps": self.kv_gbps(a, b), "rtt_ms": region_rtt_ms(a, b)}
                for i, a in enumerate(self.regions)
                for b in self.regions[i:]
            ]
            raw["routing"] = {"kv_link": {"gbps": self.kv_link_gbps, "links": links}}
        raw["tuner"] = {"mode": self.tune}
        for key, value in self.router.items():  # the overrides, a section's keys merged
            merge = isinstance(value, dict) and isinstance(raw.get(key), dict)
            raw[key] = {**raw[key], **value} if merge else value
        if self.flow_control or self.classes is not None:
            flow = dict(raw.get("flow_control", {}))
            flow["enabled"] = self.flow_control
            if self.classes is not None:
                flow["objectives"] = list(self.classes.objectives)
            raw["flow_control"] = flow
        return config_from_dict(raw)
