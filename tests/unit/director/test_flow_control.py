"""Flow control behind the admission seam (director.flow_control.FlowController): the
gateway queue between admission and scheduling, the room rule, several routers over one
view; what every transport gets back."""

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from ext_proc.director.flow_control import MAX_TRIES_PER_PUMP
from ext_proc.director.outcomes import Queued, Refused, Routed
from ext_proc.director.recipe import Director
from ext_proc.feeds.peers import PeerEvent, PeerKind, PeerPublisher
from ext_proc.vocab.errors import RATE_LIMITED
from ext_proc.vocab.types import Status
from tests.builders import BackendSpec, chat, load, make_router
from tests.fakes import FakeClock

# -- flow control: the gateway queue between admission and scheduling ----------------------

FLOW = {
    "enabled": True,
    "objectives": [
        {"name": "interactive", "priority": 10, "ttft_slo_ms": 30000},
        {"name": "batch", "priority": 0, "max_wait_s": 20},
        {"name": "cheap", "priority": 0, "ttft_slo_ms": 1000, "sheddable": True},
        {"name": "eu-only", "regions": ["eu"]},
    ],
}


def flow_router(
    backends: Sequence[BackendSpec] = (), mixed: bool = True
) -> tuple[Director, FakeClock]:
    one: list[BackendSpec] = [{"id": "a", "address": "127.0.0.1:1", "region": "eu"}]
    router, clock = make_router("gorgo", backends=backends or one, flow_control=FLOW)
    director = Director(router)
    if mixed:
        another_class(director)
    return director, clock


def another_class(director: Director) -> None:
    """A request of another class arrived a moment ago: holding can gain (flow.room.Mix)."""
    director.admission.mix.seen((99, "another tenant", "", 0.0), director.router.clock())


def busy(director: Director, backend: str = "a", prefill_ms: float = 5000.0) -> None:
    """Another router's request there, 5 s of prefill not yet started: no room."""
    load(director.router, f"peer-{prefill_ms}", backend, 4000, 10, prefill_ms=prefill_ms)


def test_with_room_a_request_passes_straight_through() -> None:
    director, _ = flow_router()
    out = director.handle(chat(rid="r1"))
    assert isinstance(out, Routed) and out.decision.waited_ms == 0.0
    assert director.admission.counts["straight"] == 1 and not director.admission.queue


def test_without_room_it_waits_and_goes_when_room_comes_its_wait_in_its_ttft() -> None:
    director, clock = flow_router()
    busy(director)
    out = director.handle(replace(chat(rid="r1"), objective="batch"))
    assert isinstance(out, Queued) and not director.router.in_flight.get("r1")
    clock.advance(2.0)
    assert not director.admission.pump()  # 5 s of work still ahead of it there, less 2 s done
    clock.advance(3.0)
    [(w, released)] = director.admission.pump()
    assert w is out.ticket and isinstance(released, Routed)
    assert released.decision.waited_ms == 5000.0
    rec = director.router.in_flight["r1"]
    assert rec.waited_ms == 5000.0 and rec.arrived_s == clock.now_s - 5.0
    clock.advance(0.5)
    first = director.router.first_byte("r1")
    assert first is not None and first.ttft_ms == 5500.0  # from its arrival at the router


def test_a_higher_band_is_released_first() -> None:
    director, clock = flow_router()
    busy(director)
    low = director.handle(replace(chat(rid="low"), objective="batch"))
    high = director.handle(replace(chat(rid="high"), objective="interactive"))
    assert isinstance(low, Queued) and isinstance(high, Queued)
    clock.advance(5.0)
    # room for one: after the first goes, its prefill is work ahead of the next
    w, first = director.admission.pump()[0]
    assert w.request.request_id == "high"
    # one was waiting when it joined: its position on arrival, on its decision and span
    assert isinstance(first, Routed) and first.decision.queued_behind == 1
    assert first.decision.as_json()["queued_behind"] == 1


def test_a_wait_past_its_objectives_longest_is_refused_429_with_the_reason() -> None:
    director, clock = flow_router()
    busy(director, prefill_ms=60_000)
    out = director.handle(replace(chat(rid="r1"), objective="batch"))
    assert isinstance(out, Queued)
    clock.advance(19.9)
    assert not director.admission.pump()
    clock.advance(0.1)
    [(_, refused)] = director.admission.pump()
    assert isinstance(refused, Refused)
    assert (refused.refusal.status, refused.refusal.reason) == (429, "rejected-ttl-expired")
    assert refused.refusal.retry_after_s == 2.0 and not director.admission.queue


def test_a_sheddable_request_whose_slo_cannot_be_met_is_refused_at_once() -> None:
    director, _ = flow_router()
    busy(director)  # 5 s of prefill ahead: its 1 s SLO cannot be met
    out = director.handle(replace(chat(rid="r1"), objective="cheap"))
    assert isinstance(out, Refused)
    assert (out.refusal.status, out.refusal.reason) == (429, "rejected-slo")
    assert out.refusal.retry_after_s is not None and out.refusal.retry_after_s >= 5.0


def test_a_regions_constraint_is_obeyed_and_a_region_with_no_backend_is_503() -> None:
    backends = [
        {"id": "us", "address": "127.0.0.1:1", "region": "us"},
        {"id": "eu", "address": "127.0.0.1:2", "region": "eu"},
    ]
    director, _ = flow_router(backends)
    for i in range(6):
        out = director.handle(replace(chat(rid=f"r{i}"), objective="eu-only"))
        assert isinstance(out, Routed) and out.decision.backend == "eu"
    director.router.fleet.drain("eu", "test")
    out = director.handle(replace(chat(rid="r9"), objective="eu-only"))
    assert isinstance(out, Refused) and out.refusal.status == 503
    assert out.refusal.reason == "rejected-no-endpoints"


def test_a_full_band_is_refused_429_and_a_client_gone_leaves_the_queue() -> None:
    flow = {"enabled": True, "max_queued_requests": 1, "retry_after_s": 0.25}
    router, _ = make_router("gorgo", backends=["a"], flow_control=flow)
    director = Director(router)
    another_class(director)
    busy(director)
    first = director.handle(chat(rid="r1"))
    assert isinstance(first, Queued)
    second = director.handle(chat(rid="r2"))
    assert isinstance(second, Refused) and second.refusal.reason == "rejected-saturated"
    assert (second.refusal.error, second.refusal.retry_after_s) == (RATE_LIMITED, 0.25)
    director.admission.cancel(first.ticket)
    assert not director.admission.queue and director.admission.counts["cancelled"] == 1
    assert isinstance(director.handle(chat(rid="r3")), Queued)  # its place is free again


def test_a_lower_band_does_not_put_a_long_prefill_ahead_of_a_higher_bands_slo() -> None:
    flow = {
        "enabled": True,
        "objectives": [
            {"name": "interactive", "priority": 10, "ttft_slo_ms": 1000},
            {"name": "batch", "priority": 0},
        ],
    }
    router, clock = make_router("gorgo", backends=["a"], flow_control=flow)
    director = Director(router)
    another_class(director)
    long_prompt = "many words " * 6000
    big = director.handle(replace(chat(long_prompt, rid="big"), objective="batch"))
    # an idle backend, but its prefill (> 500 ms, half the interactive SLO) would hold it
    assert isinstance(big, Queued)
    assert director.objectives.protected_ms(director.objectives.by_name["batch"]) == 500
    small = director.handle(replace(chat("hi", rid="small"), objective="batch"))
    assert isinstance(small, Routed)  # a short prefill leaves the SLO its room
    vip = director.handle(replace(chat(long_prompt, rid="vip"), objective="interactive"))
    assert isinstance(vip, Routed)  # the top band protects no one above it
    clock.advance(31.0)  # past the starvation bound it goes
    [(w, out)] = director.admission.pump()
    assert w is big.ticket and isinstance(out, Routed)


def test_one_class_alone_goes_straight_through_without_room_as_without_flow_control() -> None:
    director, clock = flow_router(mixed=False)
    busy(director, prefill_ms=120_000)  # two minutes of prefill ahead: no room
    out = director.handle(replace(chat(rid="r1"), objective="batch"))
    # one class, not sheddable: waiting could only delay it (its order is arrival order)
    assert isinstance(out, Routed) and out.decision.waited_ms == 0.0
    assert director.admission.counts["straight"] == 1 and not director.admission.queue
    # another class arrives: the queue can put it first, so both wait for room
    assert isinstance(director.handle(replace(chat(rid="r2"), objective="interactive")), Queued)
    assert isinstance(director.handle(replace(chat(rid="r3"), objective="batch")), Queued)
    clock.advance(59.9)  # the interactive class last seen 59.9 s ago: still two classes
    assert [type(o) for _, o in director.admission.pump()] == [Refused]  # r3: batch waits 20 s
    clock.advance(0.1)  # 60 s on: neither class arrived within the window
    director.admission.pump()
    out = director.handle(replace(chat(rid="r4"), objective="batch"))
    assert isinstance(out, Routed) and out.decision.waited_ms == 0.0


def test_one_class_alone_still_sheds_and_keeps_the_caps() -> None:
    director, _ = flow_router(mixed=False)
    busy(director)  # 5 s of prefill ahead: its 1 s SLO cannot be met
    out = director.handle(replace(chat(rid="r1"), objective="cheap"))
    assert isinstance(out, Refused) and out.refusal.reason == "rejected-slo"  # sheddable
    router, _ = make_router(
        "gorgo", backends=["a"], flow_control={"enabled": True, "max_waiting_requests": 1}
    )
    capped = Director(router)
    assert isinstance(capped.handle(chat(rid="c1")), Routed)
    assert isinstance(capped.handle(chat(rid="c2")), Queued)  # one waits there already


# -- several routers over one view (flow.shared) -------------------------------------------


class FakeBus:
    """NATS between routers, with its delay: what a router publishes reaches the others
    (and is confirmed to it) only when the test calls `deliver`."""

    def __init__(self) -> None:
        self.pending: list[tuple[Director, PeerEvent]] = []
        self.directors: list[Director] = []

        self.publishers: dict[int, PeerPublisher] = {}

    def join(self, director: Director, name: str) -> None:
        self.directors.append(director)
        pub = PeerPublisher(name, lambda e: self.pending.append((director, e)))
        director.router.subscribe(pub)
        self.publishers[id(director)] = pub

    def tell_claims(self) -> None:
        """Each router's claims, when due (as the live Holding does after a pump)."""
        for d in self.directors:
            if (claims := d.admission.claims_to_send()) is not None:
                self.publishers[id(d)].claims(*claims)

    def deliver(self) -> None:
        pending, self.pending = self.pending, []
        for sender, e in pending:
            for d in self.directors:
                if d is sender:
                    continue
                if e.kind == PeerKind.WAITING:
                    d.admission.hear_claims(e.router, dict(e.claims), list(e.heads))
                else:
                    d.router.inputs.apply_peer(e)
            sender.admission.confirm([e.request_id])


# requests waiting for a first token per backend: not a multiple of the routers, so the
# last round finds room for fewer than all of them
SHARED_ROOM = 4


def shared_routers(n: int, shared: bool) -> tuple[list[Director], FakeBus, FakeClock]:
    clock = FakeClock()
    bus = FakeBus()
    directors = []
    for i in range(n):
        router, _ = make_router(
            "gorgo",
            backends=["a"],
            clock=clock,
            seed=i,
            # room by count alone: the margin leaves the time rule out of it
            flow_control={
                "enabled": True,
                "max_waiting_requests": SHARED_ROOM,
                "room_margin_ms": 1e9,
            },
        )
        d = Director(router, shared=shared)
        bus.join(d, f"router-{i}")
        directors.append(d)
    return directors, bus, clock


def waiting_at_a(directors: list[Director]) -> int:
    """What the engine has waiting for a first token: every router's own dispatches."""
    return sum(1 for d in directors for rec in d.router.in_flight.values() if not rec.first_byte_s)


def burst(directors: list[Director], bus: FakeBus, per_router: int) -> int:
    """Every router takes `per_router` requests at the same instant, then pumps as the bus
    delivers, round after round: the most ever waiting at the backend."""
    for i, d in enumerate(directors):
        for j in range(per_router):
            d.handle(chat(rid=f"r{i}-{j}"))
    most = waiting_at_a(directors)
    for _ in range(per_router + 2):
        bus.deliver()
        for d in directors:
            d.admission.pump()
        most = max(most, waiting_at_a(directors))
    return most


def test_several_routers_overshoot_the_room_by_at_most_one_request_per_peer() -> None:
    directors, bus, _ = shared_routers(3, shared=True)
    most = burst(directors, bus, per_router=6)
    # each router knows its own exactly; at most one release of each peer unheard (here
    # the last round: 3 of room 4 heard, each router sends one)
    assert most == SHARED_ROOM + len(directors) - 1
    assert waiting_at_a(directors) == most  # the rest still wait in the routers' queues
    assert sum(len(d.admission.queue or ()) for d in directors) == 3 * 6 - most
    assert all(d.admission.snapshot()["releases"]["confirmed"] >= 1 for d in directors)


def test_without_the_rule_routers_that_see_the_same_room_all_fill_it() -> None:
    directors, bus, _ = shared_routers(3, shared=False)
    assert burst(directors, bus, per_router=6) == 3 * SHARED_ROOM


def test_one_router_is_not_held_back_by_a_bus() -> None:
    router, _ = make_router("gorgo", backends=["a"], flow_control={"enabled": True})
    assert Director(router).admission.releases is None  # no bus.nats_url: alone
    shared, _ = make_router(
        "gorgo",
        backends=["a"],
        flow_control={"enabled": True},
        bus={"nats_url": "nats://127.0.0.1:4222"},
    )
    assert Director(shared).admission.releases is not None


def test_priority_holds_across_routers_a_peers_interactive_request_takes_the_room_first() -> None:
    def run(tell: bool) -> list[str]:
        """Router 0 holds a batch request, router 1 an interactive one, both waiting for
        backend a; room comes for one, and router 0 pumps first: who gets it."""
        clock = FakeClock()
        bus = FakeBus()
        flow = {**FLOW, "max_waiting_requests": 1, "room_margin_ms": 1e9}
        directors = []
        for i in range(2):
            router, _ = make_router(
                "gorgo",
                backends=[{"id": "a", "address": "127.0.0.1:1", "region": "eu"}],
                clock=clock,
                seed=i,
                flow_control=flow,
            )
            d = Director(router, shared=True)
            bus.join(d, f"router-{i}")
            directors.append(d)
            load(router, "elsewhere", "a", 1000, 10)  # a third router's: no room
        low = directors[0].handle(replace(chat(rid="batch"), objective="batch"))
        high = directors[1].handle(replace(chat(rid="vip"), objective="interactive"))
        assert isinstance(low, Queued) and isinstance(high, Queued)
        if tell:
            bus.tell_claims()
            bus.deliver()
        for d in directors:
            d.router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "x", "elsewhere", "a"))
        settled = [s for d in directors for s in d.admission.pump()]  # router 0 first
        return [w.request.request_id for w, _ in settled]

    assert run(tell=True) == ["vip"]  # router 0 left the room to router 1's higher band
    # without the claims the lower band, pumped first, takes the room (and router 1, not
    # yet told, goes one over it: the bound)
    assert run(tell=False) == ["batch", "vip"]


def test_a_router_tells_its_peers_what_its_queue_waits_for() -> None:
    [d, _], _, clock = shared_routers(2, shared=True)
    assert d.admission.claims_to_send() is None  # nothing waits, nothing to say
    for i in range(SHARED_ROOM):
        assert isinstance(d.handle(chat(rid=f"fill-{i}")), Routed)
        d.admission.confirm([f"fill-{i}"])
    for i in range(MAX_TRIES_PER_PUMP + 1):
        assert isinstance(d.handle(chat(rid=f"w{i}")), Queued)
        clock.advance(1.0)
    told = d.admission.claims_to_send()
    assert told is not None
    claims, heads = told
    # the first waiting for backend a (default band, no deadline, waited longest), and
    # the heads a pump would offer room first
    assert claims == {"a": (0, None, MAX_TRIES_PER_PUMP + 1.0)}
    assert len(heads) == MAX_TRIES_PER_PUMP
    assert [waited for _, _, waited in heads] == [5.0, 4.0, 3.0, 2.0]
    assert d.admission.claims_to_send() is None  # said; not again until it changes or is due


@pytest.mark.parametrize("tenant_share", [1.0, 0.0])
def test_a_tenant_over_its_share_of_the_engines_waits_though_a_backend_has_room(
    tenant_share: float,
) -> None:
    # two backends of 4,000 tokens of KV each: two active tenants have 4,000 each
    backends = [
        {"id": "a", "address": "127.0.0.1:1", "kv_capacity_tokens": 4000},
        {"id": "b", "address": "127.0.0.1:2", "kv_capacity_tokens": 4000},
    ]
    flow = {"enabled": True, "tenant_share": tenant_share}
    router, _ = make_router("gorgo", backends=backends, flow_control=flow)
    director = Director(router)
    long_prompt = "many words " * 1000  # 2,754 prompt tokens + 256 output

    def send(rid: str, tenant: str, text: str = long_prompt) -> object:
        return director.handle(replace(chat(text, rid=rid), tenant=tenant))

    assert isinstance(send("l0", "light", "hi"), Routed)
    router.close("l0", Status.OK)
    assert isinstance(send("h1", "heavy"), Routed)  # nothing of heavy's in the engines
    h1 = router.in_flight["h1"]
    assert (h1.input_tokens, h1.output_tokens) == (2754, 256)
    assert (
        director.admission.queue is not None and director.admission.queue.in_engine("heavy") == 3010
    )
    assert director.admission.queue.share(0.0, 8000) == (4000 if tenant_share else math.inf)
    state = director.admission.snapshot()
    assert state["in_engine_tokens"] == {"heavy": 3010}
    assert state["tenant_share_tokens"] == (4000 if tenant_share else None)
    h2 = send("h2", "heavy")  # 6,020 tokens would be past its 4,000
    if not tenant_share:
        assert isinstance(h2, Routed)  # no limit: the other backend had room
        return
    assert isinstance(h2, Queued)
    assert isinstance(send("l1", "light"), Routed)  # the light tenant's goes on
    assert not director.admission.pump()
    router.close("h1", Status.OK)
    [(w, out)] = director.admission.pump()
    assert w is h2.ticket and isinstance(out, Routed)
    assert director.admission.queue.in_engine("heavy") == 3010
