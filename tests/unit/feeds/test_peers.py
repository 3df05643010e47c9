"""Several routers, one view of the load: each router's dispatches reach the others
(ext_proc.peers), load their queue estimates and counters, and teach them nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ext_proc.core.router import Router
from ext_proc.feeds.peers import PeerEvent, PeerKind, PeerPublisher
from ext_proc.prompt.parse import COMPLETIONS
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import RouteRequest, Status
from tests.builders import make_router
from tests.fakes import FakeClock
from tests.fuzz.runner import findings


def routers(n: int, share: bool, **raw: object) -> tuple[list[Router], FakeClock]:
    """n routers on one clock (from 0 s), each sending its dispatches to the others when
    they share."""
    clock = FakeClock(0.0)
    backends = [
        {"id": "near", "address": "127.0.0.1:1", "rtt_prior_ms": 5},
        {"id": "far", "address": "127.0.0.1:2", "rtt_prior_ms": 1000},
    ]
    rs = [
        make_router("gorgo", 900.0, backends=backends, seed=i, clock=clock, **raw)[0]
        for i in range(n)
    ]
    if share:
        for i, r in enumerate(rs):
            r.subscribe(PeerPublisher(f"r{i}", fan_out([o for o in rs if o is not r])))
    return rs, clock


def fan_out(others: list[Router]) -> Callable[[PeerEvent], None]:
    """A bus with no delay: the event reaches every other router at once."""

    def send(e: PeerEvent) -> None:
        for o in others:
            o.inputs.apply_peer(e)

    return send


def request(rid: str, tokens: int = 8000) -> RouteRequest:
    text = f"{rid} ".ljust(4 * tokens, "x")  # a prompt of its own: no prefix shared
    llm = LlmRequest(COMPLETIONS, (text,), (tokens,), 64, True, None, None)
    return RouteRequest(rid, llm, None)


def test_event_round_trips_and_bad_messages_are_named() -> None:
    e = PeerEvent(PeerKind.DISPATCHED, "r1", "req-1", "near", 8000, 64, 256, 812.5, 5.0, 40.0)
    assert PeerEvent.decode(e.encode()) == e
    with pytest.raises(ValueError, match="peer event"):
        PeerEvent.decode(b"{not json")
    with pytest.raises(ValueError, match="router"):
        PeerEvent.decode(b'{"kind": "closed", "request_id": "x", "backend": "near"}')
    with pytest.raises(ValueError, match="'sideways' is not a valid PeerKind"):
        PeerEvent.decode(b'{"kind": "sideways", "router": "r", "request_id": "x", "backend": "b"}')


def test_a_sync_round_trips_with_the_senders_requests_in_flight() -> None:
    from ext_proc.feeds.peers import sync_event

    e = sync_event("r1", ["req-1", "req-2"], ask=True)
    assert (e.kind, e.request_ids, e.ask) == (PeerKind.SYNC, ("req-1", "req-2"), True)
    assert PeerEvent.decode(e.encode()) == e


def test_a_queues_claims_round_trip_and_load_nothing() -> None:
    sent: list[PeerEvent] = []
    PeerPublisher("r1", sent.append).claims(
        {"near": (10, 2.5, 0.5), "far": (0, None, 3.0)}, [(10, 2.5, 0.5)]
    )
    [e] = sent
    assert e.kind == PeerKind.WAITING
    assert e.claims == (("far", (0, None, 3.0)), ("near", (10, 2.5, 0.5)))
    assert PeerEvent.decode(e.encode()) == e
    with pytest.raises(ValueError, match="peer event"):
        PeerEvent.decode(
            b'{"kind": "waiting", "router": "r", "request_id": "", "backend": "",'
            b' "heads": [["high", null, 1]]}'
        )
    (r,), _ = routers(1, share=False)
    r.inputs.apply_peer(e)  # not a request: nothing in flight, nothing closed
    assert not r.peer_in_flight and all(b.load.waiting_first_byte == 0 for b in r.backends.values())


def test_peer_dispatches_load_the_queue_and_teach_nothing() -> None:
    (a, b), clock = routers(2, share=True)
    idle_ms = b.features.queue_estimate_ms("near", 0.0)
    d = a.decide(request("r-1"))
    sb = b.backends[d.backend]
    assert (sb.load.in_flight, sb.load.waiting_first_byte, sb.load.in_flight_tokens) == (1, 1, 8000)
    assert b.features.queue_estimate_ms(d.backend, 0.0) > idle_ms + 100  # an 8k prefill ahead
    assert b.decisions == 0 and b.backends[d.backend].prefix.size_blocks == 0
    clock.now_s = 1.0
    a.first_byte("r-1")
    assert (sb.load.in_flight, sb.load.waiting_first_byte) == (1, 0)
    a.close("r-1", Status.OK, 2000.0)
    assert (sb.load.in_flight, sb.load.in_flight_tokens, sb.stats.completed) == (0, 0, 0)
    assert not b.peer_in_flight and not sb.load.records


def test_an_echo_of_our_own_dispatch_is_ignored() -> None:
    (a,), _ = routers(1, share=False)
    d = a.decide(request("r-1"))
    a.inputs.apply_peer(PeerEvent(PeerKind.DISPATCHED, "me", "r-1", d.backend, 8000))
    assert a.backends[d.backend].load.in_flight == 1
    assert not a.peer_in_flight


def test_a_dead_peers_requests_stop_counting_after_the_ttl() -> None:
    (a, b), clock = routers(2, share=True, bus={"peer_ttl_s": 30})
    a.decide(request("r-1"))
    clock.now_s = 29.0
    b.expire()
    assert len(b.peer_in_flight) == 1
    clock.now_s = 31.0
    b.expire()
    assert not b.peer_in_flight
    assert sum(s.load.in_flight for s in b.backends.values()) == 0


@pytest.mark.parametrize("share", [False, True])
def test_routers_that_share_do_not_herd(share: bool) -> None:
    """Three long prompts arrive at three routers at once. Apart, each router sees an idle
    fleet and sends its request to the nearest backend, where the three then queue;
    sharing, the second sees the queue the first built there and goes to the far one.
    Either way each router counts what it knows: all of the fleet's requests, or its own."""
    rs, _ = routers(3, share)
    chosen = [r.decide(request(f"r-{i}", 16000)).backend for i, r in enumerate(rs)]
    if share:
        assert chosen == ["near", "far", "near"]
    else:
        assert chosen == ["near", "near", "near"]
    for i, r in enumerate(rs):
        seen = {b: s.load.in_flight for b, s in r.backends.items()}
        if share:
            assert seen == {"near": 2, "far": 1}
        else:
            assert seen == {"near": 1, "far": 0}, f"router {i}"


@pytest.mark.parametrize(
    "found", [p for p in findings("peer_events") if "attempts" in p.name], ids=lambda p: p.name
)
def test_a_count_past_64_bits_or_negative_is_refused(found: Path) -> None:
    """Found by fuzzing (tests/fuzz/peer_events.py): a 98-digit `attempts` was taken, and
    the event could not be encoded again (orjson's integers are 64-bit); a count a peer
    sends is 0..2**63-1, else the message is refused with ValueError (the bus drops it)."""
    with pytest.raises(ValueError, match=r"attempts: .* out of range"):
        PeerEvent.decode(found.read_bytes())
    ok = PeerEvent(PeerKind.COMPLETED, "r", "id", "b", input_tokens=2**63 - 1)
    assert PeerEvent.decode(ok.encode()) == ok
    with pytest.raises(ValueError, match="input_tokens"):
        PeerEvent.decode(ok.encode().replace(b'"input_tokens":9', b'"input_tokens":-9'))


def test_a_duration_that_is_not_finite_is_refused() -> None:
    """Found by fuzzing (tests/fuzz/peer_events.py): an `e2e_ms` of "2222e2222..." read as
    infinity, which encodes as null, so the event did not survive a round trip; NaN
    passed the same way. Every duration a peer sends is a finite number."""
    (found,) = [p for p in findings("peer_events") if "infinite" in p.name]
    with pytest.raises(ValueError, match="e2e_ms: inf is not a finite number"):
        PeerEvent.decode(found.read_bytes())
    ok = PeerEvent(PeerKind.COMPLETED, "r", "id", "b", e2e_ms=1.5, queue_ms=2.0)
    assert PeerEvent.decode(ok.encode()) == ok
    for key, bad in (("queue_ms", b'"nan"'), ("rtt_ms", b'"-inf"')):
        raw = ok.encode().replace(
            f'"{key}":'.encode() + (b"2.0" if key == "queue_ms" else b"0.0"),
            f'"{key}":'.encode() + bad,
        )
        with pytest.raises(ValueError, match=key):
            PeerEvent.decode(raw)
