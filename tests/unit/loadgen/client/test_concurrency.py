"""The client's concurrency cap (loadgen.client.concurrency), shared by the simulator and the live
replay: at most N in flight, the rest first come first served, each one's slip."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.client.concurrency import Admitted, ConcurrencyCap


def drive(due: list[float], service: list[float], limit: int) -> list[Admitted[int]]:
    """The cap on a virtual clock: request i arrives at due[i] (sorted) and takes
    service[i] once sent; a slot that frees at an arrival's instant is free for it."""
    now = [0.0]
    cap: ConcurrencyCap[int] = ConcurrencyCap(limit, lambda: now[0])
    finishing: list[float] = []
    out: list[Admitted[int]] = []

    def send(a: Admitted[int] | None) -> None:
        if a is not None:
            out.append(a)
            heapq.heappush(finishing, now[0] + service[a.item])

    i = 0
    while i < len(due) or finishing:
        if finishing and (i == len(due) or finishing[0] <= due[i]):
            now[0] = heapq.heappop(finishing)
            send(cap.release())
        else:
            now[0] = due[i]
            send(cap.arrive(i))
            i += 1
    return out


def sent(due: list[float], service: list[float], cap: int) -> list[tuple[float, bool]]:
    return [(a.sent_s, a.throttled) for a in drive(due, service, cap)]


def test_requests_never_wait_for_earlier_ones_below_the_cap() -> None:
    # a 10 s request does not hold back the ones after it
    assert sent([0.0, 0.1, 0.2], [10.0, 1.0, 1.0], cap=8) == [
        (0.0, False),
        (0.1, False),
        (0.2, False),
    ]


def test_a_full_cap_holds_arrivals_until_a_slot_frees_in_order() -> None:
    ds = drive([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], limit=1)
    assert [(d.item, d.sent_s, d.throttled) for d in ds] == [
        (0, 0.0, False),
        (1, 1.0, True),
        (2, 2.0, True),
    ]
    assert [d.slip_s for d in ds] == [0.0, 1.0, 2.0]
    # cap 2: the third arrival waits for the first completion, the fourth is on time
    assert sent([0.0, 0.5, 0.6, 3.0], [1.0, 1.0, 1.0, 1.0], cap=2) == [
        (0.0, False),
        (0.5, False),
        (1.0, True),
        (3.0, False),
    ]


def test_an_arrival_at_the_instant_a_slot_frees_is_on_time() -> None:
    assert sent([0.0, 1.0], [1.0, 1.0], cap=1) == [(0.0, False), (1.0, False)]


@given(
    st.lists(st.tuples(st.floats(0, 5), st.floats(0.01, 3)), min_size=1, max_size=40),
    st.integers(1, 5),
)
def test_schedule_invariants(rows: list[tuple[float, float]], cap: int) -> None:
    due = sorted(a for a, _ in rows)
    service = [s for _, s in rows]
    ds = drive(due, service, cap)
    assert [d.item for d in ds] == list(range(len(due)))  # all, in arrival order
    finish = [d.sent_s + service[d.item] for d in ds]
    for d in ds:
        assert d.sent_s >= d.due_s and d.slip_s >= 0
        running = sum(1 for e in ds[: d.item] if finish[e.item] > d.sent_s)
        assert running < cap  # a slot was free when it went
        # only the cap makes a request late, and then it goes the instant a slot frees
        assert d.throttled == (d.slip_s > 0)
        if d.throttled:
            assert d.sent_s in finish[: d.item]
    if cap >= len(due):
        assert all(d.slip_s == 0 for d in ds)


def test_a_given_due_time_counts_the_slip_from_it_never_below_zero() -> None:
    """The live replay passes each request's scheduled time: a late timer is slip, an
    early one is not."""
    now = [0.75]
    cap: ConcurrencyCap[str] = ConcurrencyCap(2, lambda: now[0])
    late = cap.arrive("late", due_s=0.5)
    early = cap.arrive("early", due_s=1.0)
    assert late is not None and late.slip_s == 0.25 and not late.throttled
    assert early is not None and early.sent_s == 1.0 and early.slip_s == 0.0
    assert cap.arrive("third", due_s=0.75) is None and cap.waiting == 1
    now[0] = 2.0
    third = cap.release()
    assert third is not None and (third.item, third.slip_s, third.throttled) == (
        "third",
        1.25,
        True,
    )
    assert cap.in_flight == 2 and cap.waiting == 0


def test_the_cap_rejects_misuse() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        ConcurrencyCap(0, lambda: 0.0)
    with pytest.raises(RuntimeError):
        ConcurrencyCap(1, lambda: 0.0).release()  # nothing in flight
