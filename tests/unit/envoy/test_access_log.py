"""Several routers behind one Envoy: an access-log entry (or a first chunk) that reaches a
router other than the one that decided is forwarded, and the one that decided applies it
as its own; a fallback-routed entry or a forwarded one is never sent on."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.router import Router
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import AccessLogService, first_chunk_event
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.types import Status
from tests.builders import REGIONS, chat, make_router
from tests.fakes import FakeClock


@dataclass
class Pair:
    """Routers a and b behind one Envoy; what either forwards lands in `sent`."""

    a: Router
    clock: FakeClock
    log_a: AccessLogService
    log_b: AccessLogService
    sent: list[PeerEvent]


def pair() -> Pair:
    a, clock = make_router("gorgo", backends=REGIONS)
    b, _ = make_router("gorgo", backends=REGIONS, clock=clock)
    sent: list[PeerEvent] = []
    log_a = AccessLogService(a, Telemetry(TelemetryConfig(), a).fallback, sent.append)
    log_b = AccessLogService(b, Telemetry(TelemetryConfig(), b).fallback, sent.append)
    return Pair(a, clock, log_a, log_b, sent)


def over_nats(e: PeerEvent) -> PeerEvent:
    return PeerEvent.decode(e.encode())


def test_another_routers_completion_is_forwarded_and_closes_it_there() -> None:
    p = pair()
    d = p.a.decide(chat("hello", rid="x"))
    p.clock.advance(0.2)
    p.log_a.apply_forwarded(over_nats(first_chunk_event("x", error=False)))  # seen at b
    p.clock.advance(0.3)
    p.log_b.observe(codec.AccessLogEntry("x", d.backend, "gorgo", 200, 500.0, 1))
    (e,) = p.sent
    assert (e.kind, e.request_id, e.response_code, e.e2e_ms) == ("completed", "x", 200, 500.0)
    p.log_a.apply_forwarded(over_nats(e))
    assert "x" not in p.a.in_flight
    shown = p.a.recent.find("x")
    assert shown is not None
    assert shown.observed == {"status": "ok", "ttft_ms": 200.0, "e2e_ms": 500.0}
    assert len(p.sent) == 1  # applied where it was decided: nothing sent on


def test_fallback_and_forwarded_entries_are_not_sent_on() -> None:
    p = pair()
    p.log_b.observe(codec.AccessLogEntry("fb", "near", "fallback", 200, 5.0, 1))
    assert p.sent == []
    gone = PeerEvent(PeerKind.COMPLETED, "b", "unknown", "near", response_code=200, e2e_ms=5.0)
    p.log_a.apply_forwarded(gone)  # not ours (any more): dropped, not bounced back
    assert p.sent == []


def test_an_error_event_seen_elsewhere_fails_the_request_where_it_was_decided() -> None:
    p = pair()
    p.a.decide(chat("boom", rid="y"))
    p.log_a.apply_forwarded(over_nats(first_chunk_event("y", error=True)))
    shown = p.a.recent.find("y")
    assert "y" not in p.a.in_flight and shown is not None and shown.observed is not None
    assert shown.observed["status"] == str(Status.ERROR)
