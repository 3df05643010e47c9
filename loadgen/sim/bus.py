"""The message bus between the simulated routers (NATS live: ext_proc.feeds.peers
and ext_proc.service.loops.fleet_bus), on the simulator's clock: each router's lifecycle
events reach the others one hop later (in one place: BUS_HOP_S; between front doors: half
their RTT), its dispatches are confirmed to it a round trip to the server later (flow
control's bound, ext_proc.flow.shared), and its gateway queue's claims go out as the live
Holding sends them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from emulator.wan import region_rtt_ms
from ext_proc.core.router import Router
from ext_proc.director.recipe import Director
from ext_proc.feeds.peers import PeerEvent, PeerKind, PeerPublisher

# One hop through the message bus between routers in one place (NATS on a LAN).
BUS_HOP_S = 0.0005

# Schedules (time, event kind, data) on the simulation's event queue.
Push = Callable[[float, int, Any], None]


class Bus:
    def __init__(
        self,
        routers_at: Mapping[str, list[Router]],
        directors: Mapping[int, Director],
        clock: Callable[[], float],
        push: Push,
        kinds: tuple[int, int],
        on_room: Callable[[], None],
    ) -> None:
        """kinds: the simulation's event kinds for (a delivery, a confirmation); on_room:
        called when room may have come (a peer's claim withdrawn, a release confirmed)."""
        self.routers_at = routers_at
        self.directors = directors
        self.clock = clock
        self.push = push
        self.peer_kind, self.confirm_kind = kinds
        self.on_room = on_room
        # Each router's voice on the bus, by id(router).
        self.publishers: dict[int, PeerPublisher] = {}

    def connect(self) -> None:
        for door, rs in self.routers_at.items():
            for i, router in enumerate(rs):
                pub = PeerPublisher(f"{door}/{i}", self._sender(door, router))
                router.subscribe(pub)
                self.publishers[id(router)] = pub

    def _sender(self, door: str, sender: Router) -> Callable[[PeerEvent], None]:
        def send(e: PeerEvent) -> None:
            now_s = self.clock()
            if e.kind == PeerKind.DISPATCHED:
                self.push(now_s + 2 * BUS_HOP_S, self.confirm_kind, (sender, e.request_id))
            for to in self.routers_at:
                hop_s = BUS_HOP_S if to == door else region_rtt_ms(door, to) / 2000
                self.push(now_s + hop_s, self.peer_kind, (to, sender, e))

        return send

    def deliver(self, door: str, sender: Router, e: PeerEvent) -> None:
        for router in self.routers_at[door]:
            if router is sender:
                continue
            if e.kind == PeerKind.WAITING:
                self.directors[id(router)].admission.hear_claims(
                    e.router, dict(e.claims), list(e.heads)
                )
            else:
                router.inputs.apply_peer(e)
        if e.kind == PeerKind.WAITING:
            self.on_room()  # a claim withdrawn may free room held back for it

    def confirm(self, sender: Router, request_id: str) -> None:
        if self.directors[id(sender)].admission.confirm([request_id]):
            self.on_room()

    def tell(self, director: Director) -> None:
        """The director's claims, when due (after each of its pumps)."""
        pub = self.publishers.get(id(director.router))
        if pub is not None and (claims := director.admission.claims_to_send()) is not None:
            pub.claims(*claims)
