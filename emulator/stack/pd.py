"""`gorgo up --pd`'s layout, pure: P/D disaggregation in the local stack, each region a
prefill twin and a decode twin (emulator/engine/disagg/) in place of its engine, and the
KV links between them.

For regions r_0 .. r_{n-1} (region i; every port here but the decode's is drawn once from
free_ports, `PdSettings.ports`):
- decode-{r}: the routed backend, in the engine's place: ports.engine(i), behind the front
  door's link wan-{r}, named {r} (the router's backend id, as without --pd).
- prefill-{r}: named {r}-prefill, on an HTTP port of its own, its side server on another
  (SGLang's --disaggregation-bootstrap-port; vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT).
- kv-{a}-to-{b}, for every ordered pair of regions (prefill region a, decode region b): a
  `gorgo wan` link in front of a's side server, the KV's way from a's prefill to b's
  decode: RTT region_rtt_ms(a, b) (emulator/wan.py REGION_RTT_MS, the extra front doors'
  matrix; a == b: the region's local RTT, 1 ms), constant; --gbps the KV link bandwidth;
  --byte-scale the twins' KV scale, so scaled-down KV takes its real bytes' time.

Addresses: loopback has no routing, so the stack gives the twins the network's. A prefill
advertises (--kv-advertise) its side server as its own region reaches it, the local link
kv-{a}-to-{a}: SGLang's /route rank address (and the bootstrap address a P/D router puts
in the body), vLLM's remote_host/remote_port. A decode in region b routes each other
region's advertised address through the link from there (--kv-route
127.0.0.1:K(a,a)=127.0.0.1:K(a,b)); its own region's it dials as it is. So every transfer
crosses exactly the link between the two twins' regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from emulator.engine.disagg.config import DEFAULT_KV_BYTE_SCALE
from emulator.stack.ports import free_ports
from emulator.wan import region_rtt_ms

PROTOCOLS = ("sglang", "vllm")
DEFAULT_KV_LINK_GBPS = 10.0


@dataclass
class PdSettings:
    """`gorgo up --pd`: which protocol the twins speak (their flavor too), the KV links'
    bandwidth and byte scale, and the ports of the layout (module docstring)."""

    protocol: str = "sglang"
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS  # 0: unlimited
    kv_byte_scale: float = DEFAULT_KV_BYTE_SCALE
    # Write each backend's role (and the prefills as backends) into the router's config,
    # so the router picks both legs (ext_proc/core/pairs.py); off, the decodes alone are
    # routed, each serving a request whole as an engine does.
    route_roles: bool = True
    # The layout's ports (`ports_for`): drawn once, or given (tests).
    ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"P/D protocol: one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not self.kv_link_gbps >= 0:
            raise ValueError(f"--kv-link-gbps must be >= 0, got {self.kv_link_gbps}")


@dataclass(frozen=True)
class PdLayout:
    """The ports and links of `n` regions' twins (module docstring), from a flat list:
    prefill HTTP ports, side ports, the prefills' door links, then the n x n KV links
    (prefill region major)."""

    regions: tuple[str, ...]
    ports: tuple[int, ...]

    @staticmethod
    def size(n: int) -> int:
        return 3 * n + n * n

    @property
    def n(self) -> int:
        return len(self.regions)

    def prefill(self, i: int) -> int:
        return self.ports[i]

    def side(self, i: int) -> int:
        return self.ports[self.n + i]

    def prefill_door(self, i: int) -> int:
        """The front door's link to prefill i (started only when roles are routed)."""
        return self.ports[2 * self.n + i]

    def kv_link(self, a: int, b: int) -> int:
        """The link carrying KV from region a's prefill to region b's decode."""
        return self.ports[3 * self.n + a * self.n + b]

    def kv_rtt_ms(self, a: int, b: int) -> float:
        return region_rtt_ms(self.regions[a], self.regions[b])

    def advertised(self, a: int) -> str:
        """What prefill a names for its side server: its region's local link."""
        return f"127.0.0.1:{self.kv_link(a, a)}"

    def routes(self, b: int) -> list[str]:
        """Decode b's --kv-route items: each other region's prefill through its link to b."""
        return [
            f"{self.advertised(a)}=127.0.0.1:{self.kv_link(a, b)}" for a in range(self.n) if a != b
        ]

    def links(self) -> list[tuple[int, int]]:
        """Every (prefill region, decode region) pair, one KV link each."""
        return [(a, b) for a in range(self.n) for b in range(self.n)]


def layout_of(pd: PdSettings, regions: Sequence[str]) -> PdLayout:
    """The layout for these regions, its ports drawn on first use and kept in `pd`; a
    pair of regions without a known RTT is a ValueError here, before anything starts."""
    if not pd.ports:
        pd.ports = free_ports(PdLayout.size(len(regions)))
    if len(pd.ports) != PdLayout.size(len(regions)):
        raise ValueError(f"P/D ports: {PdLayout.size(len(regions))} needed, {len(pd.ports)} given")
    layout = PdLayout(tuple(regions), tuple(pd.ports))
    for a, b in layout.links():
        layout.kv_rtt_ms(a, b)
    return layout
