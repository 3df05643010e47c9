"""The local stack's settings: its regions, its port layout, and StackSettings (what to
start and how), with the defaults `gorgo up` runs; `gorgo_config` is the router's config
they make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from emulator.stack.pd import PdLayout, PdSettings, layout_of
from emulator.stack.ports import free_ports
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config


@dataclass(frozen=True)
class Region:
    id: str
    rtt_ms: float


# The default local fleet and its network profile.
DEFAULT_REGIONS = (
    Region("us-ashburn", 1.0),
    Region("eu-frankfurt", 90.0),
    Region("ap-seoul", 180.0),
)


@dataclass(frozen=True)
class StackPorts:
    front_door: int = 10000
    envoy_admin: int = 9901
    grpc: int = 50051
    admin: int = 9180
    # Engines listen on engine_base+i, their WAN links on wan_base+i (i = 1, 2, ...).
    engine_base: int = 18000
    wan_base: int = 18100

    @staticmethod
    def ephemeral(n_regions: int) -> StackPorts:
        """Free ports picked by the OS (for tests and benchmarks beside a running stack)."""
        ports = free_ports(4 + 2 * n_regions)
        engine, wan = ports[4 : 4 + n_regions], ports[4 + n_regions :]
        return _ExplicitPorts(ports[0], ports[1], ports[2], ports[3], 0, 0, engine, wan)

    def engine(self, i: int) -> int:
        return self.engine_base + i + 1

    def wan(self, i: int) -> int:
        return self.wan_base + i + 1

    def all(self, n_regions: int) -> list[tuple[str, int]]:
        named = [
            ("front door", self.front_door),
            ("envoy admin", self.envoy_admin),
            ("ext_proc gRPC", self.grpc),
            ("gorgo admin", self.admin),
        ]
        named += [(f"engine {i + 1}", self.engine(i)) for i in range(n_regions)]
        named += [(f"WAN link {i + 1}", self.wan(i)) for i in range(n_regions)]
        return named


@dataclass(frozen=True)
class _ExplicitPorts(StackPorts):
    engine_ports: Sequence[int] = ()
    wan_ports: Sequence[int] = ()

    def engine(self, i: int) -> int:
        return self.engine_ports[i]

    def wan(self, i: int) -> int:
        return self.wan_ports[i]


@dataclass
class StackSettings:
    policy: str = "gorgo"
    regions: Sequence[Region] = DEFAULT_REGIONS
    ports: StackPorts = field(default_factory=StackPorts)
    # Engine timing; zero_delay makes an engine answer at once (overhead benchmarks).
    engine_args: Sequence[str] = ()
    # Which engine the emulated backends are the twin of: "sglang" or "vllm". Each runs
    # with the flags the router relies on (metrics, cache report), as a real fleet should.
    flavor: str = "sglang"
    # Real vLLM instances (CPU, a tiny local model built on first use) instead of emulated
    # engines, from this virtual environment (`make vllm` makes it); the regions listed
    # get a small KV pool, so queueing and eviction show.
    real_engine: bool = False
    vllm_venv: Path = Path(__file__).resolve().parents[2] / ".venv-vllm"  # the repo's
    vllm_small_pool: Sequence[int] = (1,)
    # More `vllm serve` flags for every real engine (e.g. --trust-request-chat-template).
    vllm_args: Sequence[str] = ()
    # The tiny model's seed by region (emulator/vllm/tiny.py; 0 where not named): regions
    # given different seeds serve different models. Their served names and adapters are
    # engine_models and engine_loras, as for the emulated engines.
    vllm_model_seeds: Mapping[str, int] = field(default_factory=dict)
    # The emulated engines' --tokenizer: "tiny" (the tiny model's real BPE and chat
    # template, what a real vLLM here serves), "approx" (4 bytes per token) or a path.
    engine_tokenizer: str = "tiny"
    # The router subscribes to the engines' KV cache events (each engine binds a publisher
    # and a replay endpoint): its prefix state is then the engines' own.
    kv_events: bool = False
    kv_ports: list[int] = field(default_factory=list)
    # More front doors, one per region named (each an Envoy and a router of its own, with
    # WAN links to every backend at that region's RTTs, emulator/wan.py REGION_RTT_MS);
    # the first front door is the stack's own (its regions' RTTs).
    front_door_regions: Sequence[str] = ()
    # With front doors, the routers share their dispatches through NATS (ext_proc.feeds.
    # peers): a server per door, joined as one cluster, each door's routers connecting to
    # their own first (`nats_url_for`); False: each decides from its own view and the
    # engines'.
    share_dispatches: bool = True
    # The servers' client ports and cluster ports, one each per door (drawn once).
    nats_ports: list[int] = field(default_factory=list)
    nats_cluster_ports: list[int] = field(default_factory=list)
    # Router processes behind the (first) front door's Envoy: its ext_proc cluster lists
    # them all (envoy.ext_proc_addresses); more than 1 share dispatches over NATS.
    routers: int = 1
    # The extra routers' (grpc, admin) ports, picked with the config.
    router_ports: list[tuple[int, int]] = field(default_factory=list)
    workdir: Path | None = None
    # False: Envoy reaches the engines directly (benchmarks that measure the proxy alone).
    wan_links: bool = True
    # Envoy worker threads; 0 = one per core (Envoy's default).
    envoy_concurrency: int = 0
    # WAN links follow this RTT profile (emulator/wan.py: network, paper) when the region
    # is in it, with jitter; otherwise each link is a constant Region.rtt_ms.
    rtt_profile: str | None = None
    # Give each WAN link an HTTP control port (GET/POST /rtt) to change its delay.
    wan_control: bool = False
    # How Envoy applies decisions: "cluster" or "endpoint_picker" (ext_proc/config/schema.py).
    envoy_mode: str = "cluster"
    # Engine profile (name or YAML) for the engines and the router's estimates alike.
    engine_profile: str | None = None
    # The engines' own profiles by region (a fleet file's, emulator/stack/fleet.py), which the
    # router is not told: it keeps engine_profile (else the shipped one) and must learn.
    engine_profiles: Mapping[str, str] = field(default_factory=dict)
    # The model name each region's emulated engine serves and the LoRA adapters it loads
    # at start (a fleet file's `model` and `lora_modules`: NAME or NAME=PATH); a region
    # not named serves the engine's default name, without adapters.
    engine_models: Mapping[str, str] = field(default_factory=dict)
    engine_loras: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # The router's weight tuner: paired by default, "off" for static weights (benchmarks
    # that compare against the simulator's static runs).
    tuner_mode: str = "paired"
    # Router settings the tests and benchmarks tune (see ext_proc/config/schema.py).
    probe_interval_s: float = 2.0
    metrics_interval_s: float = 1.0
    # "" = each engine's path that does no work (ext_proc/config/schema.py PROBE_PATH).
    probe_path: str = ""
    seed: int = 0
    # More `gorgo serve` flags for the stack's router (e.g. --profile FILE).
    serve_args: Sequence[str] = ()
    # Another program in the router's place, given `--config PATH` (a benchmark's floor:
    # loadgen/bench/live/floor.py); empty: `gorgo serve`.
    router_argv: Sequence[str] = ()
    # The routers' admin token (GORGO_ADMIN_TOKEN in their environment): "" = a random one
    # per stack (Stack.admin_token, printed in the ready line), so that no web page in the
    # operator's browser can change a router's state (docs/reliability.md, Security).
    admin_token: str = ""
    # Keep the logs (and the configs written) in the temporary work directory when the
    # stack stops, and say where; False removes it (tests that start many stacks).
    keep_logs: bool = True
    # P/D disaggregation (`gorgo up --pd`, emulator/stack/pd.py): each region a prefill and
    # a decode twin of `flavor` (the protocol's) in place of its engine, and KV links.
    pd: PdSettings | None = None

    def pd_layout(self) -> PdLayout:
        """The P/D twins' ports and links (ValueError without P/D)."""
        if self.pd is None:
            raise ValueError("the stack runs no P/D twins")
        return layout_of(self.pd, [r.id for r in self.regions])

    def engine_profile_of(self, region: str) -> str | None:
        """The profile region's emulated engine runs (None: the engine's default)."""
        return self.engine_profiles.get(region, self.engine_profile)

    def kv_event_ports(self, i: int) -> tuple[int, int]:
        """Where region i's engine publishes (events, replay): free ports, chosen once.
        With P/D, i is region i's decode; n + i its prefill (n regions)."""
        if not self.kv_ports:
            self.kv_ports = free_ports(2 * len(self.regions) * (2 if self.pd else 1))
        return self.kv_ports[2 * i], self.kv_ports[2 * i + 1]

    def _kv_events_of(self, i: int) -> dict[str, Any]:
        """Backend i's `kv_events`: the engine's own publisher and replay endpoint, emulated
        or real. The engine binds both (`tcp://*:P`) and every router connects (mode
        connect, the default) to the engine's port itself, not to the WAN link (address)."""
        if not self.kv_events:
            return {}
        pub, replay = self.kv_event_ports(i)
        return {
            "kv_events": {
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
        }

    @property
    def nats_servers(self) -> int:
        """NATS servers to start: one per front door (a cluster when several), none for one
        router or without sharing."""
        if not ((self.front_door_regions or self.routers > 1) and self.share_dispatches):
            return 0
        return 1 + len(self.front_door_regions)

    def nats_url_for(self, door: int) -> str:
        """What door `door`'s routers connect to (0: the stack's own door): its own server
        first, then the cluster's others, tried in that order ("" without NATS)."""
        n = self.nats_servers
        if not n:
            return ""
        if len(self.nats_ports) != n:
            self.nats_ports = free_ports(n)
            self.nats_cluster_ports = free_ports(n) if n > 1 else []
        order = [door, *(k for k in range(n) if k != door)]
        return ",".join(f"nats://127.0.0.1:{self.nats_ports[k]}" for k in order)

    @property
    def nats_url(self) -> str:
        """The first door's routers' NATS servers ("" for one router, or no sharing)."""
        return self.nats_url_for(0)

    def extra_router_ports(self) -> list[tuple[int, int]]:
        if len(self.router_ports) < self.routers - 1:
            free = free_ports(2 * (self.routers - 1))
            self.router_ports = list(zip(free[0::2], free[1::2], strict=True))
        return self.router_ports

    def backend_port(self, i: int) -> int:
        return self.ports.wan(i) if self.wan_links else self.ports.engine(i)

    def gorgo_config(self) -> Config:
        p = self.ports
        return config_from_dict(
            {
                "policy": self.policy,
                "seed": self.seed,
                "listen": {"grpc": f"127.0.0.1:{p.grpc}", "admin": f"127.0.0.1:{p.admin}"},
                "tuner": {"mode": self.tuner_mode},
                **(
                    {"bus": {"nats_url": url, "router_id": "main"}}
                    if (url := self.nats_url)
                    else {}
                ),
                "probes": {
                    "interval_s": self.probe_interval_s,
                    "metrics_interval_s": self.metrics_interval_s,
                    "path": self.probe_path,
                },
                "envoy": {
                    "listen": f"127.0.0.1:{p.front_door}",
                    "admin": f"127.0.0.1:{p.envoy_admin}",
                    "mode": self.envoy_mode,
                    **(
                        {
                            "ext_proc_addresses": [
                                f"127.0.0.1:{p.grpc}",
                                *(f"127.0.0.1:{g}" for g, _ in self.extra_router_ports()),
                            ]
                        }
                        if self.routers > 1
                        else {}
                    ),
                },
                "backends": self.router_backends(),
            }
        )

    def router_backends(self) -> list[dict[str, Any]]:
        """The router config's `backends:`, one per region's engine. With P/D (`pd`) and
        `pd.route_roles` (the default) each backend has its role: the decode twins
        `decode`, and the prefill twins, listed after them, `prefill` (id {region}-prefill,
        behind a front-door link of their own; SGLang's with the bootstrap_port a P/D router
        names, their advertised one). Without route_roles only the decode twins are
        listed, each taking a request whole as an engine does (role both)."""
        engine = "vllm" if self.real_engine else self.flavor
        profile = {"engine_profile": self.engine_profile} if self.engine_profile else {}
        out = [
            {
                "id": r.id,
                "region": r.id,
                "address": f"127.0.0.1:{self.backend_port(i)}",
                **self._kv_events_of(i),
                "engine": engine,
                "rtt_prior_ms": r.rtt_ms,
                **profile,
            }
            for i, r in enumerate(self.regions)
        ]
        if self.pd is None or not self.pd.route_roles:
            return out
        pd, n = self.pd_layout(), len(self.regions)
        for b in out:
            b["role"] = "decode"
        for i, r in enumerate(self.regions):
            port = pd.prefill_door(i) if self.wan_links else pd.prefill(i)
            bootstrap = pd.kv_link(i, i) if engine == "sglang" else None
            out.append(
                {
                    "id": f"{r.id}-prefill",
                    "region": r.id,
                    "address": f"127.0.0.1:{port}",
                    **self._kv_events_of(n + i),
                    "engine": engine,
                    "rtt_prior_ms": r.rtt_ms,
                    **profile,
                    "role": "prefill",
                    **({"bootstrap_port": bootstrap} if bootstrap else {}),
                }
            )
        return out


def regions_for_profile(profile: str) -> tuple[Region, ...]:
    """The default fleet with the profile's mean RTTs (raises ValueError if unknown)."""
    from emulator.wan import rtt_profile_ms

    return tuple(Region(r.id, rtt_profile_ms(profile, r.id)[0]) for r in DEFAULT_REGIONS)


def config_yaml(cfg: Config) -> str:
    """A router config as the YAML file a `gorgo serve` child reads."""
    return yaml.safe_dump(config_as_dict(cfg), sort_keys=False)


def replica_config(
    c: Config, grpc_port: int, admin_port: int, router_id: str, xds_dir: Path
) -> Config:
    """Another router behind the same Envoy: `c` on its own ports and bus id, with its own
    (unread) xDS directory, as only the first router writes Envoy's files."""
    return replace(
        c,
        listen=replace(c.listen, grpc=f"127.0.0.1:{grpc_port}", admin=f"127.0.0.1:{admin_port}"),
        bus=replace(c.bus, router_id=router_id),
        envoy=replace(c.envoy, xds_dir=str(xds_dir)),
    )
