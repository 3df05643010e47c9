"""Backends added, drained and removed at run time, in the pure core: a draining backend
gets no new decision from any policy, its requests in flight finish, and then it leaves
every per-backend structure; nothing a peer or a late probe says about it breaks that."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config.dump import changed_keys
from ext_proc.config.load import backend_from_dict, config_from_dict
from ext_proc.config.schema import TelemetryConfig
from ext_proc.core.features import NoActiveBackend
from ext_proc.core.fleet import FleetConflict, UnknownBackend
from ext_proc.core.router import Router
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.kv_events import EventBatch
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.policy.catalog import POLICIES
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.service.telemetry.spans import A_DRAINING_BACKENDS
from ext_proc.vocab.backend import Backend, KvEventsSource
from ext_proc.vocab.events import BackendChanged, Listener
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.types import BackendChange, BackendLifecycle, Status
from tests.builders import Stream, chat, make_router
from tests.fakes import FakeClock

ACTIVE, PENDING = BackendLifecycle.ACTIVE, BackendLifecycle.PENDING
DRAINING, REMOVED = BackendLifecycle.DRAINING, BackendLifecycle.REMOVED


class Changes(Listener):
    def __init__(self) -> None:
        self.events: list[BackendChanged] = []

    def on_backend(self, e: BackendChanged) -> None:
        self.events.append(e)

    def seen(self) -> list[tuple[str, str]]:
        out = [(e.backend, str(e.change)) for e in self.events]
        self.events.clear()
        return out


def backend(bid: str, port: int = 9, **extra: object) -> Backend:
    return backend_from_dict({"id": bid, "address": f"127.0.0.1:{port}", **extra})


def fleet(
    policy: str = "least_request",
    ids: tuple[str, ...] = ("a", "b", "c"),
    timeout_s: float = 60.0,
    **extra: object,
) -> tuple[Router, FakeClock, Changes]:
    """Backends whose engines publish KV events, and what the router says of them."""
    changes = Changes()
    router, clock = make_router(
        policy,
        timeout_s,
        backends=[
            {"id": b, "address": f"127.0.0.1:{i + 1}", "kv_events": {"endpoint": "tcp://*:1"}}
            for i, b in enumerate(ids)
        ],
        seed=3,
        listeners=[changes],
        **extra,
    )
    return router, clock, changes


def shown(router: Router) -> dict[str, set[str]]:
    """Every place the core shows its backends, by the ids it holds: one record per
    backend, so each must name exactly the records' ids."""
    assert all(b.id == b.config.id == bid for bid, b in router.backends.items())
    return {
        "records": set(router.backends),
        "cfg": set(router.cfg.backend_ids),
        "snapshot": set(router.snapshot()["backends"]),
        "backends_json": {b["id"] for b in router.fleet.backends_json()},
    }


def assert_complete(router: Router, bid: str) -> None:
    """The backend's record holds everything the core keeps of it."""
    b = router.backends[bid]
    bt = router.cfg.routing.block_tokens
    assert b.profile.name == b.config.engine_profile
    assert b.prefill.prefill_ms(1000, 0) > 0
    assert b.prefix.capacity_blocks == b.profile.kv_capacity_tokens // bt
    assert b.engine.blocks is not None  # its config names a KV-event endpoint
    assert b.learned.prediction.as_json() == {}


def test_an_added_backend_gets_every_structure_and_decisions() -> None:
    router, _clock, changes = fleet("round_robin")
    router.fleet.add(backend("d", kv_events={"endpoint": "tcp://*:7"}))
    assert changes.seen() == [("d", "added")]
    assert router.fleet.lifecycle("d") == ACTIVE
    assert all("d" in ids for ids in shown(router).values())
    assert_complete(router, "d")
    assert router.cfg.backend_ids == ("a", "b", "c", "d")  # the order they came in
    chosen = Counter(router.decide(chat(rid=f"r{i}")).backend for i in range(8))
    assert chosen == {"a": 2, "b": 2, "c": 2, "d": 2}
    with pytest.raises(FleetConflict, match="'d' exists"):
        router.fleet.add(backend("d"))


def test_drain_with_requests_in_flight_removes_it_when_the_last_one_closes() -> None:
    router, clock, changes = fleet("round_robin")
    for i in range(6):
        router.decide(chat(rid=f"r{i}"))
    on_b = sorted(router.backends["b"].load.records)
    assert len(on_b) == 2
    assert router.fleet.drain("b") == DRAINING
    assert changes.seen() == [("b", "draining")]
    assert router.fleet.draining == ("b",)
    assert "b" in router.cfg.backend_ids  # Envoy keeps its cluster while they finish
    # No decision reaches it, whatever the policy would have chosen.
    for i in range(30):
        d = router.decide(chat(rid=f"n{i}"))
        assert d.backend != "b" and "b" not in {c.backend_id for c in d.candidates}
        assert d.draining == ("b",) and d.as_json()["draining"] == ["b"]
        router.close(f"n{i}", Status.OK)
    # Its requests in flight finish normally: first byte, completion, learners.
    clock.advance(0.2)
    assert router.first_byte(on_b[0]) is not None
    closed = router.close(on_b[0], Status.OK, cached_tokens=0)
    assert closed is not None and closed.backend == "b"
    assert router.fleet.lifecycle("b") == DRAINING and not changes.seen()
    router.close(on_b[1], Status.ERROR)
    assert changes.seen() == [("b", "removed")]
    for name, ids in shown(router).items():
        assert ids == {"a", "c"}, name
    assert router.fleet.draining == ()
    with pytest.raises(UnknownBackend):
        router.fleet.lifecycle("b")
    removed = router.snapshot()["removed_backends"]
    assert [(r["id"], r["completed"], r["errors"]) for r in removed] == [("b", 1, 1)]
    # An id that was removed can be added again, from scratch.
    router.fleet.add(backend("b"))
    assert router.backends["b"].stats.completed == 0


def test_drain_of_an_idle_backend_removes_it_at_once_and_again_is_unknown() -> None:
    router, _clock, changes = fleet()
    assert router.fleet.drain("c") == REMOVED
    assert changes.seen() == [("c", "draining"), ("c", "removed")]
    with pytest.raises(UnknownBackend):
        router.fleet.drain("c")
    # Draining a draining backend changes nothing.
    router.decide(chat(rid="r1"))
    busy = next(iter(router.in_flight.values())).backend
    assert router.fleet.drain(busy) == DRAINING
    assert router.fleet.drain(busy) == DRAINING
    assert changes.seen() == [(busy, "draining")]


def test_expiry_while_draining_removes_it() -> None:
    router, clock, changes = fleet(timeout_s=30.0)
    router.decide(chat(rid="r1"))
    busy = router.in_flight["r1"].backend
    router.fleet.drain(busy)
    clock.advance(29.0)
    assert router.expire() == [] and router.fleet.lifecycle(busy) == DRAINING
    clock.advance(2.0)
    expired = router.expire()
    assert [(c.request_id, c.status) for c in expired] == [("r1", Status.EXPIRED)]
    assert busy not in router.backends
    assert changes.seen()[-1] == (busy, "removed")


def test_a_reused_request_id_closes_the_older_and_lets_its_draining_backend_go() -> None:
    router, _clock, changes = fleet()
    router.decide(chat(rid="r1"))
    busy = router.in_flight["r1"].backend
    router.fleet.drain(busy)
    # A reused request id closes the older record (lost) before the new one counts (the
    # new one goes elsewhere: busy is draining), so busy's last request has closed.
    assert router.decide(chat(rid="r1")).backend != busy
    assert busy not in router.backends
    assert changes.seen()[-1] == (busy, "removed")


def test_a_record_released_without_a_close_still_lets_it_go_at_the_next_expiry_pass() -> None:
    router, _clock, _changes = fleet()
    router.decide(chat(rid="r1"))
    rec = router.in_flight["r1"]
    router.fleet.drain(rec.backend)
    # The fleet's records released by a way other than a close (none is left in the
    # router; the state's own reuse path): the next expiry pass removes the backend.
    router.fleet.state.dispatch(rec)
    router.fleet.state.close("r1", 0.0, Status.LOST)
    assert router.fleet.state.own_in_flight(rec.backend) == 0
    assert router.fleet.lifecycle(rec.backend) == DRAINING
    router.expire()
    assert rec.backend not in router.backends


def test_the_last_active_backend_cannot_be_drained() -> None:
    router, _clock, _changes = fleet(ids=("a", "b"))
    router.fleet.drain("a")
    with pytest.raises(FleetConflict, match="last active"):
        router.fleet.drain("b")
    assert router.fleet.lifecycle("b") == ACTIVE


def test_a_pending_backend_is_no_candidate_until_activated() -> None:
    router, _clock, changes = fleet(ids=("a",))
    router.fleet.confirm_new_backends = True
    assert router.fleet.add(backend("b")) == PENDING
    assert all(router.decide(chat(rid=f"r{i}")).backend == "a" for i in range(10))
    assert "b" in router.cfg.backend_ids  # Envoy must learn it first
    assert router.fleet.activate("b") and not router.fleet.activate("b")
    assert changes.seen() == [("b", "added"), ("b", "activated")]
    assert {router.decide(chat(rid=f"s{i}")).backend for i in range(20)} == {"a", "b"}


def test_no_active_backend_is_said_plainly() -> None:
    """A fleet replaced whole: the old one draining, the new one pending (the shell
    answers such a request by the fallback route)."""
    router, _clock, _changes = fleet(ids=("a",))
    router.fleet.confirm_new_backends = True
    router.decide(chat(rid="r0"))
    router.fleet.reconcile([backend("z")])
    assert (router.fleet.lifecycle("a"), router.fleet.lifecycle("z")) == (DRAINING, PENDING)
    assert router.admit(chat(rid="r1")) is None
    with pytest.raises(NoActiveBackend):
        router.decide(chat(rid="r1"))
    router.fleet.activate("z")
    assert router.decide(chat(rid="r2")).backend == "z"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_chooses_a_draining_backend_as_the_set_changes(policy: str) -> None:
    router, clock, _changes = fleet(policy, ids=("a", "b", "c"))
    seen: Counter[str] = Counter()
    rid = 0

    def burst(n: int) -> None:
        nonlocal rid
        for _ in range(n):
            rid += 1
            d = router.decide(chat(f"hello {rid % 5}", f"u{rid % 7}", rid=f"r{rid}"))
            assert router.fleet.lifecycle(d.backend) == ACTIVE
            assert all(router.fleet.lifecycle(c.backend_id) == ACTIVE for c in d.candidates)
            assert set(d.ranked()) <= {b for b in router.backends if b not in router.fleet.draining}
            seen[d.backend] += 1
            clock.advance(0.01)
            if rid % 2:
                router.close(f"r{rid}", Status.OK)

    burst(20)
    router.fleet.add(backend("d"))
    burst(40)
    router.fleet.drain("a")
    burst(40)
    router.fleet.drain("d")
    router.fleet.add(backend("e"))
    burst(40)
    assert seen["e"] > 0 or policy in ("session_affinity", "prefix_cache")


def test_round_robin_shares_evenly_whatever_the_set() -> None:
    router, _clock, _changes = fleet("round_robin")
    router.decide(chat(rid="r0"))  # the rotation is at an odd place
    router.fleet.add(backend("d"))
    got = Counter(router.decide(chat(rid=f"r{i}")).backend for i in range(1, 41))
    assert got == {"a": 10, "b": 10, "c": 10, "d": 10}
    router.fleet.drain("b")
    got = Counter(router.decide(chat(rid=f"s{i}")).backend for i in range(30))
    assert got == {"a": 10, "c": 10, "d": 10}


def test_session_affinity_moves_only_the_sessions_of_a_drained_backend() -> None:
    router, _clock, _changes = fleet("session_affinity")
    before = {u: router.decide(chat(user=f"u{u}", rid=f"b{u}")).backend for u in range(60)}
    router.fleet.drain("b")
    after = {u: router.decide(chat(user=f"u{u}", rid=f"a{u}")).backend for u in range(60)}
    assert all(after[u] == before[u] for u in before if before[u] != "b")
    assert all(after[u] != "b" for u in after)


def test_peers_events_naming_unknown_or_removed_backends_are_ignored() -> None:
    router, clock, _changes = fleet()

    def peer(kind: PeerKind, rid: str, bid: str) -> PeerEvent:
        return PeerEvent(kind, "other", rid, bid, input_tokens=10)

    router.inputs.apply_peer(peer(PeerKind.DISPATCHED, "p0", "nowhere"))
    assert not router.peer_in_flight
    # A peer's request on a draining backend loads it, but does not keep it alive.
    router.decide(chat(rid="r1"))
    busy = router.in_flight["r1"].backend
    router.inputs.apply_peer(peer(PeerKind.DISPATCHED, "p1", busy))
    router.fleet.drain(busy)
    router.close("r1", Status.OK)
    assert busy not in router.backends and not router.peer_in_flight
    # Its first byte and close, arriving later, change nothing.
    router.inputs.apply_peer(peer(PeerKind.FIRST_BYTE, "p1", busy))
    router.inputs.apply_peer(peer(PeerKind.CLOSED, "p1", busy))
    router.inputs.apply_peer(peer(PeerKind.DISPATCHED, "p2", busy))
    assert not router.peer_in_flight
    for b in router.backends.values():
        assert (b.load.in_flight, b.load.waiting_first_byte, b.load.in_flight_tokens) == (0, 0, 0)
    clock.advance(1.0)


def test_late_probes_scrapes_and_kv_events_of_a_removed_backend_are_ignored() -> None:
    router, _clock, _changes = fleet()
    router.fleet.drain("c")
    router.inputs.record_probe("c", 12.0)
    router.inputs.record_probe("c", None)
    router.inputs.record_engine_report("c", EngineReport(3, 0, 0.1))
    applied = router.inputs.apply_kv_events("c", EventBatch("", 1, 0.0, (), None))
    assert not applied.gap
    router.inputs.set_event_stream("c", True)
    assert "c" not in router.backends
    assert all(ids == {"a", "b"} for ids in shown(router).values())


def test_reconcile_adds_updates_reactivates_and_drains() -> None:
    router, clock, changes = fleet(ids=("a", "b", "c"))
    router.decide(chat(rid="r1"))
    busy = router.in_flight["r1"].backend
    keep = [router.backends[b].config for b in ("a", "b", "c") if b != busy]
    # The file loses `busy` (drained: a request is in flight there) and gains d.
    done = router.fleet.reconcile([*keep, backend("d")])
    assert (done.added, done.draining) == (("d",), (busy,))
    assert router.fleet.lifecycle(busy) == DRAINING
    # Named again before it was removed: back in rotation, nothing lost.
    done = router.fleet.reconcile([*keep, router.backends[busy].config, backend("d")])
    assert done.reactivated == (busy,) and router.fleet.lifecycle(busy) == ACTIVE
    assert "r1" in router.backends[busy].load.records
    changes.seen()
    # Estimates only: in place, nothing forgotten.
    a = router.backends["a"]
    for _ in range(4):
        router.inputs.record_probe("a", 33.0)
    assert (a.health.rtt_ms, a.health.rtt_samples) == (33.0, 4)
    router.backends["a"].prefix.insert(
        router.features.prompt_blocks(chat("x" * 4000, rid="x"))[0], clock()
    )
    blocks = router.backends["a"].prefix.size_blocks
    changed = [
        backend("a", 1, rtt_prior_ms=7, region="eu", kv_events={"endpoint": "tcp://*:1"}),
        *[router.backends[b].config for b in ("b", "c")],
        backend("d"),
    ]
    done = router.fleet.reconcile(changed)
    assert done.updated == ("a",) and router.backends["a"].config.region == "eu"
    assert (a.health.rtt_ms, a.rtt_prior_ms, router.backends["a"].prefix.size_blocks) == (
        33.0,
        7.0,
        blocks,
    )
    assert [(e.backend, e.change, e.reset) for e in changes.events] == [
        ("a", BackendChange.UPDATED, False)
    ]
    changes.seen()
    # Another engine behind the id: what the router knew of the old one is forgotten.
    router.inputs.set_event_stream("a", True)
    assert router.backends["a"].precise
    changed[0] = backend("a", 5, kv_events={"endpoint": "tcp://*:1"})
    router.fleet.reconcile(changed)
    assert [(e.backend, e.change, e.reset) for e in changes.events] == [
        ("a", BackendChange.UPDATED, True)
    ]
    assert (a.health.rtt_ms, a.health.rtt_samples, router.backends["a"].prefix.size_blocks) == (
        50.0,
        0,
        0,
    )
    engine = router.backends["a"].engine.blocks
    assert not router.backends["a"].precise and engine is not None and engine.blocks == 0
    assert router.backends["a"].config.address == "127.0.0.1:5"


def test_decision_span_and_metric_show_the_lifecycle() -> None:
    router, _clock, _changes = fleet()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(), router, exporter)
    router.subscribe(telemetry)
    router.decide(chat(rid="r0"))
    busy = router.in_flight["r0"].backend
    router.fleet.drain(busy)
    router.decide(chat(rid="r1"))
    router.close("r1", Status.OK)
    idle = next(b for b in ("a", "b", "c") if b != busy and not router.backends[b].load.records)
    router.fleet.drain(idle)  # removed at once
    router.close("r0", Status.OK)
    telemetry.shutdown()
    spans = {s.attributes["gorgo.request_id"]: s for s in exporter.get_finished_spans()}
    assert A_DRAINING_BACKENDS not in spans["r0"].attributes
    assert list(spans["r1"].attributes[A_DRAINING_BACKENDS]) == [busy]
    text = telemetry.metrics.render().decode()
    for bid in ("a", "b", "c"):
        state = "active" if bid not in (busy, idle) else "removed"
        assert f'gorgo_backend_lifecycle{{backend="{bid}",state="{state}"}} 1.0' in text


def test_a_backend_object_is_checked_as_the_config_checks_it() -> None:
    assert backend_from_dict({"id": "x", "address": "h:1"}).kv_events == KvEventsSource()
    for raw, key in [
        ({"id": "x"}, "address: required key is missing"),
        ({"id": "X y", "address": "h:1"}, "id: 'X y' must be"),
        ({"id": "x", "address": "nope"}, "address: expected host:port"),
        ({"id": "x", "address": "h:1", "rtt_prior_ms": -1}, "rtt_prior_ms: must be >= 0"),
        ({"id": "x", "address": "h:1", "kv_events": {"endpoint": "udp://a"}}, "kv_events.endpoint"),
        ({"id": "x", "address": "h:1", "colour": "red"}, "colour: unknown key"),
        ({"id": "x", "address": "h:1", "engine_profile": "nope"}, "engine_profile:"),
    ]:
        with pytest.raises(ConfigError) as e:
            backend_from_dict(raw)
        assert str(e.value).startswith(key.split(":")[0]) and key in str(e.value)


def test_changed_keys_name_each_leaf() -> None:
    base = {"backends": [{"id": "a", "address": "h:1"}]}
    old = config_from_dict(base)
    new = config_from_dict(
        {
            "backends": [{"id": "a", "address": "h:2"}],
            "routing": {"shed_queue_ms": 5},
            "probes": {"interval_s": 3},
            "listen": {"tls": {}},
        }
    )
    assert sorted(changed_keys(old, new)) == ["probes.interval_s", "routing.shed_queue_ms"]
    assert sorted(changed_keys(old, new, skip=())) == [
        "backends",
        "probes.interval_s",
        "routing.shed_queue_ms",
    ]


def test_live_keys_apply_and_the_rest_are_left() -> None:
    router, _clock, _changes = fleet()
    new = config_from_dict(
        {
            "backends": [{"id": "a", "address": "h:1"}],
            "routing": {"shed_queue_ms": 250, "block_tokens": 64, "ttft_model": "profile"},
        }
    )
    assert router.fleet.apply_live_keys(new) == ["routing.shed_queue_ms"]
    assert router.cfg.routing.shed_queue_ms == 250 and router.cfg.routing.block_tokens == 256
    assert sorted(changed_keys(router.cfg, new)) == [
        "policy",
        "request_timeout_s",
        "routing.block_tokens",
    ]


# -- a property: whatever happens to the fleet, the invariants hold ----------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("decide"), st.integers(0, 9)),
        st.tuples(st.just("close"), st.integers(0, 60)),
        st.tuples(st.just("add"), st.integers(0, 5)),
        st.tuples(st.just("drain"), st.integers(0, 5)),
        st.tuples(st.just("activate"), st.integers(0, 5)),
        st.tuples(st.just("expire"), st.integers(1, 40)),
        st.tuples(st.just("peer"), st.integers(0, 5)),
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=st.sampled_from(sorted(POLICIES)), confirm=st.booleans())
def test_decisions_only_reach_active_backends_and_removed_ones_leave_no_trace(
    ops: list[tuple[str, int]], policy: str, confirm: bool
) -> None:
    router, clock, changes = fleet(policy, timeout_s=30.0)
    router.fleet.confirm_new_backends = confirm
    ids = ["a", "b", "c", "d", "e", "f"]
    n = 0
    for op, k in ops:
        clock.advance(0.5)
        if op == "decide":
            n += 1
            try:
                d = router.decide(chat(f"p{k}", f"s{k}", rid=f"r{n}"))
            except NoActiveBackend:
                assert not any(b.lifecycle == ACTIVE for b in router.backends.values())
                continue
            assert router.fleet.lifecycle(d.backend) == ACTIVE
            assert all(router.fleet.lifecycle(c.backend_id) == ACTIVE for c in d.candidates)
        elif op == "close":
            router.close(f"r{k}", Status.OK)
        elif op == "add":
            try:
                router.fleet.add(backend(ids[k]))
            except FleetConflict:
                assert ids[k] in router.backends
        elif op == "drain":
            with contextlib.suppress(UnknownBackend, FleetConflict):
                router.fleet.drain(ids[k])
        elif op == "activate":
            router.fleet.activate(ids[k])
        elif op == "expire":
            clock.advance(k)
            router.expire()
        else:
            router.inputs.apply_peer(PeerEvent(PeerKind.DISPATCHED, "peer", f"p{n}", ids[k], 5))
        # Invariants after every step.
        present = set(router.backends)
        for name, held in shown(router).items():
            assert held == present, name
        assert set(router.fleet.draining) == {
            b for b, s in router.backends.items() if s.lifecycle == DRAINING
        }
        for b in router.fleet.draining:
            assert router.fleet.state.own_in_flight(b) > 0  # else it would be gone
        for rec in [*router.in_flight.values(), *router.peer_in_flight.values()]:
            assert rec.backend in present
        for b in router.backends.values():
            assert b.load.in_flight == len(b.load.records)
    removed = [e.backend for e in changes.events if e.change == BackendChange.REMOVED]
    drained = [e.backend for e in changes.events if e.change == BackendChange.DRAINING]
    assert Counter(removed) <= Counter(drained)


def test_with_no_active_backend_the_stream_takes_the_fallback_route() -> None:
    from tests.messages import body, headers

    router, _clock, _changes = fleet(ids=("a",))
    router.fleet.confirm_new_backends = True
    router.fleet.reconcile([backend("z")])  # a (idle) removed, z pending
    s = Stream(router)
    s.handle(headers("/v1/chat/completions", "r1"))
    resp = s.handle(body(b'{"messages": [{"role": "user", "content": "hi"}]}'))
    assert resp is not None and resp.WhichOneof("response") == "request_body"
    assert not resp.request_body.response.header_mutation.set_headers  # no backend named
    assert s.done and not router.in_flight


def test_the_endpoint_picker_names_new_addresses_and_never_a_draining_one() -> None:
    from ext_proc.envoy.encoders import EndpointPickerEncoder, decision_encoder

    router, _clock, _changes = fleet(
        ids=("a", "b"), envoy={"mode": "endpoint_picker", "connect_retries": 3}
    )
    encoder = decision_encoder(router.cfg)
    assert isinstance(encoder, EndpointPickerEncoder)
    router.fleet.add(backend("c", 33))
    router.decide(chat(rid="r0"))
    router.fleet.drain("a")
    encoder.set_backends(router.cfg.backends)
    for i in range(6):
        d = router.decide(chat(rid=f"r{i + 1}"))
        picked = encoder.encode(d).request_body.response.header_mutation.set_headers
        endpoints = picked[0].header.raw_value.decode().split(",")
        assert "127.0.0.1:1" not in endpoints  # a's address: draining
        assert sorted(endpoints) == ["127.0.0.1:2", "127.0.0.1:33"]


def test_the_last_backend_active_or_pending_cannot_be_drained() -> None:
    """b pending, a drained (b will serve): b is then the last one that can serve."""
    router, _clock, _changes = fleet(ids=("a",))
    router.fleet.confirm_new_backends = True
    assert router.fleet.add(backend("b")) == PENDING
    router.fleet.drain("a")
    with pytest.raises(FleetConflict, match="last active or pending"):
        router.fleet.drain("b")
    assert router.fleet.lifecycle("b") == PENDING


def test_a_rollouts_shares_move_by_reload() -> None:
    router, _clock, _changes = fleet()
    served = [{"model": "v1", "weight": 1}, {"model": "v2", "weight": 1}]
    new = replace(
        router.cfg,
        models=config_from_dict(
            {
                "backends": [{"id": "a", "address": "h:1"}],
                "models": [{"name": "chat", "served": served}],
            }
        ).models,
    )
    assert router.fleet.apply_live_keys(new) == ["models"]
    names = {router.served_name("chat", f"s{i}") for i in range(50)}
    assert names == {"v1", "v2"}
    assert "models" not in changed_keys(router.cfg, new)
