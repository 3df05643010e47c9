"""A model of the fleet state, checked against every order of events (hypothesis stateful
testing, issue 51).

The router (core.router.Router, through its public surface) and Envoy's access-log
service in front of it (envoy.access_log.AccessLogService) are driven by: dispatches,
first bytes, closes by access-log entry (2xx, 4xx, 5xx, a client gone, Envoy's own
errors, a failover) or directly (a cancel, a first chunk's error), entries late,
duplicated, out of order or for ids never seen, access-log streams opened and ended (an
Envoy gone), engine load reports, KV events, other routers' dispatches, first bytes and
closes, backends drained (removed once empty) and added back, the clock moving on with
expiry, and a router restart (its view rebuilt from what it hears next). A plain model
says what must be open; after every step the router must agree:

- `in_flight` (and /state's count) is exactly what the model has open, per backend too,
  with the peers' requests on top; the per-backend counters are what the records say;
- nothing is negative (counters, tokens, queue estimates) and every estimate is finite;
- every request is closed exactly once (a second close is a no-op), and once closed it
  loads nothing;
- the estimates agree with the accounting: a backend with nothing in flight and an
  engine that reports nothing waiting has a queue estimate of 0.

`make test` runs 100 examples of up to 30 steps (~9 s); the long tier (`-m long`) runs
the same machine for 2,000 of up to 40 (~2.5 min on two busy cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from google.protobuf.duration_pb2 import Duration
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ext_proc.common.names import ACCESS_LOG_NAME, ACCESS_LOG_STARTS, ROUTE_FALLBACK
from ext_proc.core.build import build_router
from ext_proc.core.fleet import FleetConflict
from ext_proc.core.router import Router
from ext_proc.core.state import lost_after_s
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import AccessLogService
from ext_proc.envoy.proto import envoy_wire_pb2 as pb
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.kv_events import BlockRemoved, BlockStored, EventBatch
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.prompt.parse import CHAT, parse_body
from ext_proc.vocab.events import Closed, Listener
from ext_proc.vocab.types import BackendLifecycle, RouteRequest, Status
from tests.builders import chat, make_config
from tests.fakes import FakeClock

BACKENDS = ("a", "b", "c")
# "a" publishes KV events (its blocks come from the engine once its stream is up).
SPECS = (
    {"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:1"}},
    {"id": "b", "address": "127.0.0.1:2", "rtt_prior_ms": 40},
    {"id": "c", "address": "127.0.0.1:3", "rtt_prior_ms": 90},
)
TIMEOUT_S = 120.0
# The tests' config (make_config's), built once: a restart builds the router again from it.
CFG = make_config("gorgo", TIMEOUT_S, SPECS)
ENVOYS = ("edge-1", "edge-2", "")  # "": an Envoy that names itself nowhere (a mesh's)
# Access-log entries: (response code, Envoy's flags, details) as Envoy logs them.
ENTRIES = (
    (200, (), "via_upstream"),
    (200, ("DC",), "via_upstream"),
    (0, ("DC",), "downstream_remote_disconnect"),
    (404, (), "via_upstream"),
    (500, (), "via_upstream"),
    (503, ("UF",), "upstream_reset_before_response_started{connection_failure}"),
    (504, ("UT",), "upstream_response_timeout"),
    (503, ("UO",), "overflow"),
)


# How a request the router can no longer hear of closes: lost, unless the data plane said
# another backend answered it (then the chosen one's connect failure counts, however the
# request ended).
LOST = (Status.LOST, Status.FAILED_OVER)


class Closes(Listener):
    """Every Closed event the router emits, in order."""

    def __init__(self) -> None:
        self.events: list[Closed] = []

    def on_close(self, e: Closed) -> None:
        self.events.append(e)


@dataclass
class Open:
    backend: str
    envoy: str
    input_tokens: int
    first_byte: bool = False


@dataclass
class Peer:
    backend: str
    dispatched_s: float
    first_byte: bool = False


@dataclass
class LogStream:
    """An access-log stream Envoy holds open (one per worker and log)."""

    node: str
    log_name: str
    queue: asyncio.Queue[pb.StreamAccessLogsMessage | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[object] | None = None


def entry(
    rid: str, code: int, flags: tuple[str, ...], details: str, backend: str = "", attempts: int = 1
) -> pb.HTTPAccessLogEntry:
    e = pb.HTTPAccessLogEntry()
    e.request.request_id = rid
    e.response.response_code.value = code
    e.response.response_code_details = details
    e.common_properties.route_name = "gorgo"
    e.common_properties.upstream_request_attempt_count = attempts
    e.common_properties.time_to_last_downstream_tx_byte.CopyFrom(Duration(nanos=5_000_000))
    names = {"DC": "downstream_connection_termination", "UF": "upstream_connection_failure"}
    names |= {"UT": "upstream_request_timeout", "UO": "upstream_overflow"}
    for f in flags:
        setattr(e.common_properties.response_flags, names[f], True)
    if backend:
        e.response.response_headers["x-gorgo-backend"] = backend
    return e


class FleetModel(RuleBasedStateMachine):
    opened = Bundle("opened")  # request ids this router dispatched (open or closed since)
    runs = 0  # machines run (examples, with those hypothesis replays)

    def __init__(self) -> None:
        super().__init__()
        FleetModel.runs += 1
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.n = 0
        self.open: dict[str, Open] = {}
        self.closed: set[str] = set()  # ids closed once (a later request may reuse one)
        self.peers: dict[str, Peer] = {}
        self.lifecycle = {b: BackendLifecycle.ACTIVE for b in BACKENDS}
        self.streams: list[LogStream] = []
        self.seq = 0
        self._new_router()

    def _new_router(self) -> None:
        self.closes = Closes()
        # How many times each id must have closed in this router (once per request).
        self.close_count: Counter[str] = Counter()
        self.checked = 0  # the closes checked so far
        self.router: Router
        self.router = build_router(CFG, self.clock, random.Random(0), listeners=[self.closes])
        self.svc = AccessLogService(self.router)
        self.seen: dict[str, int] = {}

    def teardown(self) -> None:
        for s in self.streams:
            s.queue.put_nowait(None)
        self._settle()
        self.loop.close()

    # -- the loop that runs the access-log streams ---------------------------------------

    def _settle(self) -> None:
        for _ in range(5):
            self.loop.run_until_complete(asyncio.sleep(0))

    async def _messages(self, s: LogStream) -> AsyncIterator[pb.StreamAccessLogsMessage]:
        while (msg := await s.queue.get()) is not None:
            yield msg

    def _message(self, s: LogStream, *entries: pb.HTTPAccessLogEntry) -> pb.StreamAccessLogsMessage:
        msg = pb.StreamAccessLogsMessage()
        msg.identifier.node.id = s.node
        msg.identifier.log_name = s.log_name
        msg.http_logs.log_entry.extend(entries)
        return msg

    # -- the model's bookkeeping ----------------------------------------------------------

    def _close_in_model(self, rid: str) -> None:
        rec = self.open.pop(rid)
        self.closed.add(rid)
        self.close_count[rid] += 1
        self._forget_if_drained(rec.backend)

    def _forget_if_drained(self, backend: str) -> None:
        """A draining backend is removed once none of this router's requests is open there;
        the peers' requests there are forgotten with it."""
        if self.lifecycle.get(backend) is BackendLifecycle.DRAINING and not any(
            o.backend == backend for o in self.open.values()
        ):
            del self.lifecycle[backend]
            for rid in [r for r, p in self.peers.items() if p.backend == backend]:
                del self.peers[rid]

    def _expect_closes(self, before: int, rids: set[str]) -> None:
        new = [e.request_id for e in self.closes.events[before:]]
        assert sorted(new) == sorted(rids), (new, rids)

    # -- rules ----------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        pass

    @rule(
        target=opened,
        words=st.integers(1, 400),
        envoy=st.sampled_from(ENVOYS),
        streaming=st.booleans(),
        max_tokens=st.sampled_from([None, 16, 3000]),
    )
    def dispatch(self, words: int, envoy: str, streaming: bool, max_tokens: int | None) -> str:
        self.n += 1
        rid = f"r{self.n}"
        body: dict[str, object] = {"messages": [{"role": "user", "content": "word " * words}]}
        body |= {"stream": streaming} | ({} if max_tokens is None else {"max_tokens": max_tokens})
        llm = parse_body(CHAT, json.dumps(body).encode())
        before = len(self.closes.events)
        d = self.router.decide(RouteRequest(rid, llm, None, envoy=envoy))
        self._expect_closes(before, set())
        assert self.lifecycle[d.backend] is BackendLifecycle.ACTIVE  # never a draining one
        self.open[rid] = Open(d.backend, envoy, d.input_tokens)
        return rid

    @precondition(lambda self: bool(self.peers) or bool(self.closed))
    @rule(i=st.integers(0, 50), from_peer=st.booleans(), words=st.integers(1, 50))
    def dispatch_a_known_id(self, i: int, from_peer: bool, words: int) -> None:
        """A request whose id another router's request in flight has (ids are the
        clients' or Envoy's: nothing makes them unique across routers), or that one of
        ours had before it closed."""
        pool = sorted(self.peers) if from_peer and self.peers else sorted(self.closed)
        self._dispatch_again(pool[i % len(pool)] if pool else "", words)

    @precondition(lambda self: bool(self.open))
    @rule(i=st.integers(0, 50), words=st.integers(1, 50))
    def dispatch_an_open_id(self, i: int, words: int) -> None:
        """A request whose id one of ours in flight has (a client's id sent twice): the
        older can no longer be told apart, and is closed (lost) as the new one counts."""
        self._dispatch_again(sorted(self.open)[i % len(self.open)], words)

    def _dispatch_again(self, rid: str, words: int) -> None:
        if not rid:
            return
        before = len(self.closes.events)
        old = rid in self.open
        d = self.router.decide(RouteRequest(rid, chat("word " * words).llm, None))
        self._expect_closes(before, {rid} if old else set())
        if old:
            assert self.closes.events[-1].status in LOST
            self._close_in_model(rid)
        self.peers.pop(rid, None)  # ours now: the peer's record can no longer be told apart
        self.open[rid] = Open(d.backend, "", d.input_tokens)

    @rule(rid=opened, i=st.integers(0, 2))
    def served_elsewhere(self, rid: str, i: int) -> None:
        """The data plane says another backend answers (a connect failure, retried)."""
        self.router.inputs.served_by(rid, BACKENDS[i])

    @rule(backend=st.sampled_from(BACKENDS), port=st.integers(1, 3))
    def update_backend(self, backend: str, port: int) -> None:
        """A reload changes its address (another engine): counters and records stay."""
        if backend not in self.lifecycle:
            return
        spec = CFG.backends[BACKENDS.index(backend)]
        self.router.fleet.update(dataclasses.replace(spec, address=f"127.0.0.2:{port}"))

    @rule(rid=opened)
    def response_ended_first(self, rid: str) -> None:
        """Envoy's entry for a streamed response overtook its first-chunk message: the
        router notes the end and waits for the first byte (or closes without it)."""
        o = self.open.get(rid)
        waits = self.router.response_ended(rid, 5.0)
        assert waits == (
            o is not None and not o.first_byte and self.router.in_flight[rid].streaming
        )

    @rule(rid=opened)
    def first_byte(self, rid: str) -> None:
        o = self.open.get(rid)
        seen = self.router.first_byte(rid)
        assert (seen is not None) == (o is not None and not o.first_byte)
        if o is not None:
            o.first_byte = True

    @rule(rid=opened, kind=st.integers(0, len(ENTRIES) - 1), failover=st.booleans())
    def access_log_entry(self, rid: str, kind: int, failover: bool) -> None:
        """Envoy's entry for one of our requests: its completion, or a late duplicate, or
        one that overtakes the first byte (out of order)."""
        code, flags, details = ENTRIES[kind]
        o = self.open.get(rid)
        backend = o.backend if o is not None else "a"
        attempts = 1
        if failover and o is not None:  # Envoy retried a connect failure elsewhere
            others = [b for b in self.lifecycle if b != o.backend]
            if others:
                backend, attempts = others[0], 2
        before = len(self.closes.events)
        self.svc.observe(self._entry(rid, code, flags, details, backend, attempts))
        self._expect_closes(before, {rid} if o is not None else set())
        if o is not None:
            self._close_in_model(rid)

    def _entry(
        self,
        rid: str,
        code: int,
        flags: tuple[str, ...],
        details: str,
        backend: str,
        attempts: int = 1,
    ) -> codec.AccessLogEntry:
        """An entry as the service reads it off the wire."""
        msg = pb.StreamAccessLogsMessage()
        msg.http_logs.log_entry.append(entry(rid, code, flags, details, backend, attempts))
        (e,) = codec.access_log_entries(msg)
        return e

    @rule(
        rid=opened,
        kind=st.sampled_from([PeerKind.FIRST_CHUNK, PeerKind.COMPLETED]),
        error=st.booleans(),
    )
    def forwarded(self, rid: str, kind: PeerKind, error: bool) -> None:
        """Another router behind the same Envoy saw one of our requests' first chunk (a
        5xx: `error`) or its access-log entry, and forwarded it over the bus."""
        o = self.open.get(rid)
        before = len(self.closes.events)
        code = 503 if error else 200
        e = PeerEvent(kind, "other", rid, o.backend if o else "b", error=error, response_code=code)
        self.svc.apply_forwarded(dataclasses.replace(e, details="via_upstream"))
        closes = o is not None and (kind is PeerKind.COMPLETED or error)
        self._expect_closes(before, {rid} if closes else set())
        if closes:
            self._close_in_model(rid)
        elif o is not None:
            o.first_byte = True

    @rule(rid=st.text("xyz0123456789", min_size=1, max_size=6), fallback=st.booleans())
    def entry_for_an_unknown_id(self, rid: str, fallback: bool) -> None:
        """An entry for an id this router never dispatched (a fallback-route request, an
        old router's, garbage): nothing closes."""
        before = len(self.closes.events)
        e = self._entry(f"u-{rid}", 200, (), "via_upstream", "b")
        if fallback:
            e = dataclasses.replace(e, route_name=ROUTE_FALLBACK)
        self.svc.observe(e)
        self._expect_closes(before, set())

    @rule(rid=opened, status=st.sampled_from([Status.CANCELLED, Status.ERROR, Status.OK]))
    def close_directly(self, rid: str, status: Status) -> None:
        """A cancel (the client left before a response), a first chunk's 5xx, or a
        full-duplex stream's end: closed by the router itself; a second close is a no-op."""
        o = self.open.get(rid)
        closed = self.router.close(rid, status)
        assert (closed is not None) == (o is not None)
        if o is not None:
            self._close_in_model(rid)

    @rule(node=st.sampled_from(ENVOYS), starts=st.booleans())
    def open_log_stream(self, node: str, starts: bool) -> None:
        s = LogStream(node, ACCESS_LOG_STARTS if starts else ACCESS_LOG_NAME)
        s.task = self.loop.create_task(self.svc.stream_access_logs(self._messages(s), None))
        s.queue.put_nowait(self._message(s))
        self.streams.append(s)
        self._settle()

    @precondition(lambda self: any(s.log_name == ACCESS_LOG_STARTS for s in self.streams))
    @rule(rid=opened)
    def start_entry(self, rid: str) -> None:
        """A request's start entry on a log of starts: closes nothing, whatever it says."""
        s = next(s for s in self.streams if s.log_name == ACCESS_LOG_STARTS)
        before = len(self.closes.events)
        s.queue.put_nowait(self._message(s, entry(rid, 0, (), "")))
        self._settle()
        self._expect_closes(before, set())

    @precondition(lambda self: bool(self.streams))
    @rule(
        i=st.integers(0, 7),
        entries=st.lists(st.tuples(st.integers(0, 10**6), st.booleans()), max_size=3),
    )
    def end_log_stream(self, i: int, entries: list[tuple[int, bool]]) -> None:
        """One of Envoy's access-log streams ends (a worker's, or the Envoy's last: it went
        away, and the requests it carried are lost), after a batch for unknown ids."""
        s = self.streams.pop(i % len(self.streams))
        before = len(self.closes.events)
        batch = [entry(f"gone-{n}", 200 if ok else 503, (), "via_upstream") for n, ok in entries]
        if s.log_name == ACCESS_LOG_NAME:
            s.queue.put_nowait(self._message(s, *batch))
        s.queue.put_nowait(None)
        self._settle()
        assert s.task is not None and s.task.done()
        alive = {x.node for x in self.streams}
        gone: set[str] = set()
        if s.node not in alive:
            gone = {s.node} if self.streams else {s.node, ""}
        lost = {rid for rid, o in self.open.items() if o.envoy in gone}
        failures = {b: x.health.request_failures for b, x in self.router.backends.items()}
        self._expect_closes(before, lost)
        for e in self.closes.events[before:]:
            assert e.status in LOST  # not held against the backend
            b = self.router.backends.get(e.backend)
            if e.status is Status.LOST and b is not None:
                assert b.health.request_failures == failures[e.backend]
        for rid in lost:
            self._close_in_model(rid)

    @rule(
        backend=st.sampled_from(BACKENDS),
        waiting=st.integers(0, 6),
        running=st.integers(0, 12),
        pool=st.sampled_from([None, 50_000, 200_000]),
    )
    def engine_report(self, backend: str, waiting: int, running: int, pool: int | None) -> None:
        report = EngineReport(waiting, running, min(1.0, running / 12), kv_capacity_tokens=pool)
        self.router.inputs.record_engine_report(backend, report)

    @rule(
        up=st.booleans(),
        stored=st.lists(st.integers(1, 50), max_size=4, unique=True),
        removed=st.lists(st.integers(1, 50), max_size=2, unique=True),
    )
    def kv_events(self, up: bool, stored: list[int], removed: list[int]) -> None:
        self.seq += 1
        events = [
            BlockStored(tuple(stored), None, tuple(range(16 * len(stored))), 16),
            BlockRemoved(tuple(removed)),
        ]
        self.router.inputs.set_event_stream("a", up)
        self.router.inputs.apply_kv_events(
            "a", EventBatch("", self.seq, 1000.0 + self.seq, tuple(events), 0)
        )

    @rule(backend=st.sampled_from(BACKENDS), tokens=st.integers(0, 4000))
    def peer_dispatch(self, backend: str, tokens: int) -> None:
        self.n += 1
        rid = f"p{self.n}"
        e = PeerEvent(
            PeerKind.DISPATCHED, "other", rid, backend, input_tokens=tokens, prefill_ms=tokens / 10
        )
        self.router.inputs.apply_peer(e)
        if backend in self.lifecycle:  # a backend this router does not route to: ignored
            self.peers[rid] = Peer(backend, self.clock())

    @precondition(lambda self: bool(self.peers))
    @rule(
        i=st.integers(0, 50),
        kind=st.sampled_from([PeerKind.FIRST_BYTE, PeerKind.CLOSED]),
        twice=st.booleans(),
    )
    def peer_event(self, i: int, kind: PeerKind, twice: bool) -> None:
        rid = sorted(self.peers)[i % len(self.peers)]
        for _ in range(2 if twice else 1):  # a duplicate on the bus changes nothing more
            self.router.inputs.apply_peer(
                PeerEvent(kind, "other", rid, self.peers[rid].backend)
                if rid in self.peers
                else PeerEvent(kind, "other", rid, "")
            )
            if kind is PeerKind.FIRST_BYTE and rid in self.peers:
                self.peers[rid].first_byte = True
            elif rid in self.peers:
                del self.peers[rid]

    @rule(rid=opened)
    def peer_echo_of_our_own(self, rid: str) -> None:
        """Our own dispatch comes back over the bus: not a peer's."""
        o = self.open.get(rid)
        self.router.inputs.apply_peer(
            PeerEvent(PeerKind.DISPATCHED, "us", rid, o.backend if o else "a")
        )
        if o is None and "a" in self.lifecycle:  # closed here: a peer's id now, as far as we know
            self.peers[rid] = Peer("a", self.clock())

    @rule(backend=st.sampled_from(BACKENDS))
    def drain(self, backend: str) -> None:
        if backend not in self.lifecycle:
            return
        others_active = any(
            lc is BackendLifecycle.ACTIVE for b, lc in self.lifecycle.items() if b != backend
        )
        if self.lifecycle[backend] is BackendLifecycle.ACTIVE and not others_active:
            with pytest.raises(FleetConflict):
                self.router.fleet.drain(backend)
            return
        self.router.fleet.drain(backend)
        self.lifecycle[backend] = BackendLifecycle.DRAINING
        self._forget_if_drained(backend)

    @rule(backend=st.sampled_from(BACKENDS))
    def add_back(self, backend: str) -> None:
        """Removed: added again (as new); draining: back in rotation."""
        spec = CFG.backends[BACKENDS.index(backend)]
        lc = self.lifecycle.get(backend)
        if lc is None:
            self.router.fleet.add(spec)
        elif lc is BackendLifecycle.DRAINING:
            self.router.fleet.reactivate(backend)
        else:
            with pytest.raises(FleetConflict):
                self.router.fleet.add(spec)
        self.lifecycle[backend] = BackendLifecycle.ACTIVE

    @rule(dt=st.sampled_from([0.0, 0.01, 0.5, 3.0, 30.0, 130.0]))
    def tick(self, dt: float) -> None:
        """Time passes; overdue requests expire (their completions were lost), peers'
        requests past the fleet's TTL are forgotten."""
        self.clock.advance(dt)
        now = self.clock()
        overdue = {
            rid
            for rid, rec in self.router.in_flight.items()
            if now - rec.dispatched_s >= lost_after_s(rec, TIMEOUT_S)
        }
        ttl = self.router.cfg.bus.peer_ttl_s
        before = len(self.closes.events)
        self.router.expire()
        self._expect_closes(before, overdue)
        for rid in overdue:
            self._close_in_model(rid)
        for rid in [r for r, p in self.peers.items() if now - p.dispatched_s >= ttl]:
            del self.peers[rid]

    @rule()
    def restart(self) -> None:
        """The router restarts: what it knew is gone (its Envoy's later entries for the old
        requests are unknown ids to it); its config's backends, the engines' next reports
        and the peers' next messages rebuild its view."""
        for s in self.streams:  # its gRPC server went down: every stream ended
            s.queue.put_nowait(None)
        self._settle()
        self.streams = []
        self.closed |= set(self.open)  # never closed by that router: it died
        self.open = {}
        self.peers = {}
        self.lifecycle = {b: BackendLifecycle.ACTIVE for b in BACKENDS}
        self._new_router()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def in_flight_is_what_is_open(self) -> None:
        r = self.router
        assert set(r.in_flight) == set(self.open)
        assert set(r.peer_in_flight) == set(self.peers)
        assert set(r.backends) == set(self.lifecycle)
        for b, lc in self.lifecycle.items():
            assert r.backends[b].lifecycle is lc
        assert r.snapshot(decisions=False)["in_flight"] == len(self.open)

    @invariant()
    def each_backends_counters_are_its_records(self) -> None:
        for bid, b in self.router.backends.items():
            mine = {rid for rid, o in self.open.items() if o.backend == bid}
            theirs = {rid for rid, p in self.peers.items() if p.backend == bid}
            assert set(b.load.records) == mine | theirs
            assert b.load.in_flight == len(mine) + len(theirs)
            assert self.router.fleet.state.own_in_flight(bid) == len(mine)
            unseen = [r for r in b.load.records.values() if r.first_byte_s is None]
            assert b.load.waiting_first_byte == len(unseen)
            assert b.load.in_flight_tokens == sum(r.input_tokens for r in b.load.records.values())
            for rid in mine:
                assert (b.load.records[rid].first_byte_s is not None) == self.open[rid].first_byte

    @invariant()
    def nothing_is_negative(self) -> None:
        now = self.clock()
        for bid, b in self.router.backends.items():
            load, s = b.load, b.stats
            assert min(load.in_flight, load.waiting_first_byte, load.in_flight_tokens) >= 0
            counters = (s.completed, s.errors, s.client_errors, s.cancelled, s.gateway_errors)
            assert min((*counters, s.lost, s.failovers, s.fallback_completed)) >= 0
            assert math.isfinite(load.mean_prefill_ms) and load.mean_prefill_ms >= 0
            q = self.router.features.queue_estimate_ms(bid, now)
            assert math.isfinite(q) and q >= 0, (bid, q)

    @invariant()
    def estimates_agree_with_the_accounting(self) -> None:
        now = self.clock()
        for bid, b in self.router.backends.items():
            report = self.router.features.fresh_engine_report(b, now)
            idle_engine = report is None or not report.waiting
            if not b.load.records and idle_engine:
                assert self.router.features.queue_estimate_ms(bid, now) == 0, bid

    @invariant()
    def every_close_is_consistent_and_shown_finite(self) -> None:
        for e in self.closes.events[self.checked :]:
            assert e.e2e_ms >= 0
            if e.ttft_ms is not None:  # the first byte came no later than the end
                assert 0 <= e.ttft_ms <= e.e2e_ms + 1e-6, (e.request_id, e.ttft_ms, e.e2e_ms)
        self.checked = len(self.closes.events)
        json.dumps(self.router.snapshot(), allow_nan=False)  # /state: no NaN, no infinity

    @invariant()
    def each_request_closes_exactly_once(self) -> None:
        assert Counter(e.request_id for e in self.closes.events) == self.close_count


# 100 examples in `make test` (~9 s here); the long tier runs 2,000.
QUICK = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LONG = settings(QUICK, max_examples=2000, stateful_step_count=40)


def run_machine(profile: settings) -> int:
    """Run the machine under `profile`; returns how many examples ran."""
    before = FleetModel.runs
    machine = FleetModel.TestCase
    machine.settings = profile
    machine().runTest()
    ran = FleetModel.runs - before
    print(f"state model: {ran} examples of up to {profile.stateful_step_count} steps")
    return ran


def test_the_fleet_state_agrees_with_its_model_in_every_order() -> None:
    assert run_machine(QUICK) >= QUICK.max_examples


@pytest.mark.long  # `make test-long`
def test_the_fleet_state_agrees_with_its_model_in_every_order_long() -> None:
    assert run_machine(LONG) >= 2000
