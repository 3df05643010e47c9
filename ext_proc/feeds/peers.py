"""What several routers tell each other: the requests each one dispatched, so that every
router's queue estimate counts the whole fleet's load, not only its own share.

The cache state needs no sharing (every router subscribes to every engine's KV events),
and the engines' load reports come every probes.metrics_interval_s; between two reports a
router would not see what the others just sent, and N routers that agree on the best
backend herd onto it. Each router therefore publishes its lifecycle events on a NATS
subject (`bus.nats_url`, `bus.subject`; the shell is `ext_proc.service.loops.fleet_bus`) and applies
the others'. Pure: events in, JSON out, and back.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from ext_proc.vocab.events import Closed, Dispatched, FirstByte, Listener


class PeerKind(enum.StrEnum):
    """Which lifecycle event a PeerEvent carries: one every router applies (dispatched,
    first byte, closed), or what one router saw of another's request and forwards to it."""

    DISPATCHED = "dispatched"
    FIRST_BYTE = "first_byte"
    CLOSED = "closed"
    # Behind one Envoy with several router processes, the observing and access-log
    # streams reach any of them: what one saw of another's request goes to the router
    # that decided it (it alone learns from it). FIRST_CHUNK: the first response chunk
    # (`error`: an error event inside the stream); COMPLETED: the access-log entry.
    FIRST_CHUNK = "first_chunk"
    COMPLETED = "completed"
    # Flow control: what the sender's gateway queue waits for (`claims`: per backend the
    # highest priority waiting for it; none: nothing), ext_proc.flow.shared.Claims.
    WAITING = "waiting"
    # After a router (re)joins the bus: the requests the sender has in flight, all of them
    # (`request_ids`), so a receiver forgets the sender's requests it still counts but
    # whose close it missed while one of them was cut off; `ask`: every receiver answers
    # with its own (core NATS keeps nothing for a subscriber that was away).
    SYNC = "sync"


@dataclass(frozen=True)
class PeerEvent:
    """One router's lifecycle event, as the others need it (no prompt, no timing of the
    sender's clock: a receiver stamps events with its own)."""

    kind: PeerKind
    router: str
    request_id: str
    backend: str
    # DISPATCHED only: what the request will load the backend with.
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms: float = 0.0
    # The sender's estimates: with them a receiver knows when the first token is due (a
    # request late past that makes the backend look stalled).
    rtt_ms: float = 0.0
    queue_ms: float = 0.0
    streaming: bool = True
    # FIRST_CHUNK and COMPLETED: what Envoy said (ext_proc.envoy.codec.AccessLogEntry).
    error: bool = False
    response_code: int = 0
    e2e_ms: float | None = None
    attempts: int = 1
    route_name: str = ""
    flags: tuple[str, ...] = ()
    details: str = ""
    # WAITING only: per backend the first request of its queue waiting for it, and the
    # heads of its queue that found no room, each as (priority, seconds to its deadline
    # or None, seconds waited).
    claims: tuple[tuple[str, tuple[int, float | None, float]], ...] = ()
    heads: tuple[tuple[int, float | None, float], ...] = ()
    # SYNC only: the sender's requests in flight, and whether it asks for the others'.
    request_ids: tuple[str, ...] = ()
    ask: bool = False

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @staticmethod
    def decode(data: bytes) -> PeerEvent:
        """ValueError names what is wrong with a message."""
        try:
            raw: Any = orjson.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object")
            return PeerEvent(
                kind=PeerKind(raw["kind"]),
                router=str(raw["router"]),
                request_id=str(raw["request_id"]),
                backend=str(raw["backend"]),
                input_tokens=_count(raw.get("input_tokens", 0), "input_tokens"),
                output_tokens=_count(raw.get("output_tokens", 0), "output_tokens"),
                cached_tokens=_count(raw.get("cached_tokens", 0), "cached_tokens"),
                prefill_ms=_ms(raw.get("prefill_ms", 0.0), "prefill_ms"),
                rtt_ms=_ms(raw.get("rtt_ms", 0.0), "rtt_ms"),
                queue_ms=_ms(raw.get("queue_ms", 0.0), "queue_ms"),
                streaming=bool(raw.get("streaming", True)),
                error=bool(raw.get("error", False)),
                response_code=_count(raw.get("response_code", 0), "response_code"),
                e2e_ms=None if raw.get("e2e_ms") is None else _ms(raw["e2e_ms"], "e2e_ms"),
                attempts=_count(raw.get("attempts", 1), "attempts"),
                route_name=str(raw.get("route_name", "")),
                flags=tuple(str(f) for f in raw.get("flags", ())),
                details=str(raw.get("details", "")),
                claims=tuple((str(b), _head(h)) for b, h in raw.get("claims", ())),
                heads=tuple(_head(h) for h in raw.get("heads", ())),
                request_ids=tuple(str(r) for r in raw.get("request_ids", ())),
                ask=bool(raw.get("ask", False)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"peer event: {e}") from e


# A count in a peer's message: what a 64-bit counter holds (orjson's integers).
MAX_COUNT = 2**63 - 1


def _count(value: Any, key: str) -> int:
    """A count from a peer: an integer (or its text) in 0..MAX_COUNT. Found by fuzzing: a
    98-digit one was taken, and the event then failed to encode."""
    number = int(value)
    if not 0 <= number <= MAX_COUNT:
        raise ValueError(f"peer event: {key}: {number} is out of range")
    return number


def _ms(value: Any, key: str) -> float:
    """A duration from a peer: a finite number. Found by fuzzing: the text "2222e2222..."
    read as infinity, which JSON cannot carry (it encoded as null: the event changed)."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"peer event: {key}: {number} is not a finite number")
    return number


class PeerPublisher(Listener):
    """A router listener that hands each lifecycle event to `send` as a PeerEvent."""

    def __init__(self, router_id: str, send: Callable[[PeerEvent], None]) -> None:
        self.router_id = router_id
        self.send = send

    def on_dispatch(self, e: Dispatched) -> None:
        r = e.record
        self.send(
            PeerEvent(
                kind=PeerKind.DISPATCHED,
                router=self.router_id,
                request_id=r.request_id,
                backend=r.backend,
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                cached_tokens=r.cached_tokens,
                prefill_ms=r.prefill_ms,
                rtt_ms=r.rtt_ms,
                queue_ms=r.queue_ms,
                streaming=r.streaming,
            )
        )

    def on_first_byte(self, e: FirstByte) -> None:
        self.send(PeerEvent(PeerKind.FIRST_BYTE, self.router_id, e.request_id, e.backend))

    def on_close(self, e: Closed) -> None:
        self.send(PeerEvent(PeerKind.CLOSED, self.router_id, e.request_id, e.backend))

    def claims(self, claims: dict[str, Head], heads: list[Head]) -> None:
        """What our gateway queue waits for now (flow control, several routers)."""
        self.send(waiting_event(self.router_id, claims, heads))


# A head of a router's queue: (priority, seconds to its deadline or None, seconds waited).
Head = tuple[int, float | None, float]


def _head(raw: Any) -> Head:
    p, due, waited = raw
    return (int(p), None if due is None else _ms(due, "due"), _ms(waited, "waited"))


def waiting_event(router_id: str, claims: dict[str, Head], heads: list[Head]) -> PeerEvent:
    """A WAITING event: per backend the first request waiting for it, and the heads of
    the queue that found no room."""
    return PeerEvent(
        PeerKind.WAITING,
        router_id,
        "",
        "",
        claims=tuple(sorted(claims.items())),
        heads=tuple(heads),
    )


def sync_event(router_id: str, in_flight: Iterable[str], ask: bool) -> PeerEvent:
    """A SYNC event: every request the sender has in flight (PeerKind.SYNC)."""
    return PeerEvent(PeerKind.SYNC, router_id, "", "", request_ids=tuple(in_flight), ask=ask)
