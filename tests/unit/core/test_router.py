import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.vocab.types import Status
from tests.builders import chat, make_router


def test_lifecycle_counts_ttft_and_e2e() -> None:
    router, clock = make_router(seed=1)
    d = router.decide(chat(rid="r1", stream=False))
    b = router.backends[d.backend]
    assert (b.load.in_flight, b.load.waiting_first_byte) == (1, 1)
    assert d.input_tokens == 7
    clock.advance(0.25)
    first = router.first_byte("r1")
    assert first is not None and (first.backend, first.ttft_ms) == (d.backend, pytest.approx(250.0))
    assert router.first_byte("r1") is None  # only the first byte counts
    assert (b.load.in_flight, b.load.waiting_first_byte) == (1, 0)
    clock.advance(1.0)
    done = router.close("r1", Status.OK, e2e_ms=1300.0)
    assert done is not None
    assert (done.status, done.ttft_ms, done.e2e_ms) == (Status.OK, pytest.approx(250.0), 1300.0)
    assert (b.load.in_flight, b.stats.completed, list(b.stats.recent_e2e_ms)) == (0, 1, [1300.0])
    assert router.close("r1", Status.OK) is None  # idempotent: the loop closes once


def test_cancel_before_first_byte_releases_everything() -> None:
    router, clock = make_router(seed=1)
    d = router.decide(chat(rid="r1", stream=False))
    clock.advance(0.1)
    done = router.close("r1", Status.CANCELLED)
    assert done is not None and done.ttft_ms is None and done.e2e_ms == pytest.approx(100.0)
    b = router.backends[d.backend]
    assert (b.load.in_flight, b.load.waiting_first_byte, b.stats.errors, b.stats.completed) == (
        0,
        0,
        0,
        0,
    )
    assert b.stats.cancelled == 1  # the client went away: not the backend's failure
    assert not router.in_flight


def test_lost_completions_expire_oldest_first() -> None:
    router, clock = make_router(timeout_s=10.0, seed=1)
    router.decide(chat(rid="old", stream=False))
    clock.advance(6)
    router.decide(chat(rid="young", stream=False))
    clock.advance(5)
    expired = router.expire()
    assert [(c.request_id, c.status) for c in expired] == [("old", Status.EXPIRED)]
    assert list(router.in_flight) == ["young"]


def test_reused_request_id_does_not_leak_in_flight() -> None:
    router, _ = make_router(seed=1)
    router.decide(chat(rid="dup", stream=False))
    router.decide(chat(rid="dup", stream=False))
    router.close("dup", Status.OK)
    assert sum(b.load.in_flight for b in router.backends.values()) == 0
    assert sum(b.load.waiting_first_byte for b in router.backends.values()) == 0


def test_error_completion_counts_as_error() -> None:
    router, _ = make_router(seed=1)
    d = router.decide(chat(rid="r", stream=False))
    router.close("r", Status.ERROR)
    assert router.backends[d.backend].stats.errors == 1


def test_snapshot_shows_recent_decisions_without_prompt() -> None:
    router, _ = make_router(seed=1)
    router.decide(chat(rid="r1", stream=False))
    snap = router.snapshot()
    assert snap["decisions"] == 1 and snap["recent_decisions"][0]["request_id"] == "r1"
    assert "hello" not in repr(snap)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("dfcx"), st.integers(0, 5)), max_size=60))
def test_in_flight_accounting_stays_consistent(ops: list[tuple[str, int]]) -> None:
    """Random decide/first-byte/complete/expire sequences: counters match the table."""
    router, clock = make_router(timeout_s=3.0, seed=1)
    for op, n in ops:
        rid = f"r{n}"
        if op == "d":
            router.decide(chat(rid=rid, stream=False))
        elif op == "f":
            router.first_byte(rid)
        elif op == "c":
            router.close(rid, Status.OK)
        else:
            clock.advance(1.0)
            router.expire()
        for b in router.backends.values():
            recs = [r for r in router.in_flight.values() if r.backend == b.id]
            assert b.load.in_flight == len(recs) >= 0
            assert b.load.waiting_first_byte == sum(r.first_byte_s is None for r in recs)


def test_our_dispatch_of_an_id_a_peer_has_in_flight_takes_it_over() -> None:
    """Found by the state model (issue 51): a request whose id another router's request
    in flight has (ids are the clients' or Envoy's, not unique across routers) was counted
    twice on its backend and once in its records, and the peer's close then released our
    record: counters off by one for good, and our own close failed (KeyError)."""
    from ext_proc.feeds.peers import PeerEvent, PeerKind

    router, _ = make_router(backends=["a"])
    router.inputs.apply_peer(PeerEvent(PeerKind.DISPATCHED, "other", "x", "a", input_tokens=7))
    d = router.decide(chat(rid="x"))
    a = router.backends["a"]
    assert "x" not in router.peer_in_flight  # ours now
    assert (a.load.in_flight, a.load.waiting_first_byte) == (1, 1)
    assert a.load.in_flight_tokens == d.input_tokens
    router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "other", "x", "a"))  # a no-op now
    assert set(a.load.records) == {"x"} and a.load.in_flight == 1
    closed = router.close("x", Status.OK)
    assert closed is not None and closed.request_id == "x"
    assert (a.load.in_flight, a.load.waiting_first_byte, a.load.in_flight_tokens) == (0, 0, 0)


def test_a_request_id_dispatched_again_while_in_flight_closes_the_older_once() -> None:
    """Found by the state model (issue 51): the older request of a reused id (a client's
    id twice in the gateway queue) left the books without a close, so no listener (the
    decision log, the learners) ever heard of its end."""
    from ext_proc.vocab.events import Closed, Listener

    class Closes(Listener):
        def __init__(self) -> None:
            self.events: list[Closed] = []

        def on_close(self, e: Closed) -> None:
            self.events.append(e)

    closes = Closes()
    router, _ = make_router(backends=["a", "b"], listeners=[closes])
    router.decide(chat(rid="x"))
    router.decide(chat(rid="x"))
    assert [(e.request_id, e.status, e.reason) for e in closes.events] == [
        ("x", Status.LOST, "request id reused")
    ]
    assert sum(b.load.in_flight for b in router.backends.values()) == 1
    assert sum(b.stats.lost for b in router.backends.values()) == 1
    assert router.close("x", Status.OK) is not None  # the newer one closes once, too
    assert router.close("x", Status.OK) is None
    assert len(closes.events) == 2
