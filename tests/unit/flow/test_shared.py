"""Room shared by several routers (flow.shared.Releases): one release per backend until the
bus confirms it, and a release the bus never confirms times out (fail open)."""

import pytest

from ext_proc.flow.shared import (
    CLAIM_REFRESH_S,
    CLAIM_TTL_S,
    CONFIRM_TIMEOUT_S,
    Claims,
    Releases,
)
from tests.fakes import FakeClock


def test_a_release_blocks_its_backend_until_the_bus_confirms_it() -> None:
    clock = FakeClock()
    r = Releases(clock)
    assert not r.blocked("a")
    r.released("a", "r1")
    assert r.blocked("a") and not r.blocked("b") and len(r) == 1
    assert r.confirm(["r1"]) == 1
    assert not r.blocked("a") and len(r) == 0 and r.confirmed == 1


def test_a_backend_stays_blocked_while_any_of_its_releases_is_open() -> None:
    clock = FakeClock()
    r = Releases(clock)
    r.released("a", "r1")
    r.released("a", "r2")  # a second one (the timeout let it through)
    r.confirm(["r1"])
    assert r.blocked("a")
    r.confirm(["r2"])
    assert not r.blocked("a")


def test_ids_not_released_here_confirm_nothing() -> None:
    r = Releases(FakeClock())
    r.released("a", "r1")
    assert r.confirm(["peer-1", "r1", "r1"]) == 1 and r.confirmed == 1


def test_a_release_the_bus_never_confirms_times_out() -> None:
    clock = FakeClock()
    r = Releases(clock)
    r.released("a", "r1")
    assert r.next_timeout_s() == pytest.approx(clock.now_s + CONFIRM_TIMEOUT_S)
    clock.advance(CONFIRM_TIMEOUT_S / 2)
    assert r.blocked("a")
    clock.advance(CONFIRM_TIMEOUT_S)
    assert not r.blocked("a") and r.timed_out == 1 and r.next_timeout_s() is None
    assert r.confirm(["r1"]) == 0  # too late: already let go


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Releases(FakeClock(), 0.0)


# -- priority across routers: the peers' claims on backends' room ---------------------------

INF = float("inf")


def test_a_peers_higher_band_waiting_for_a_backend_holds_back_a_lower_one_there_only() -> None:
    c = Claims(FakeClock(), tries_per_pump=4)
    c.hear("peer", {"a": (10, 20.0, 1.0), "b": (0, None, 1.0)}, [])
    assert c.outranked("a", 0, INF, 0.0) and not c.outranked("a", 10, INF, 0.0)
    assert not c.outranked("b", 0, INF, 0.0)  # the same band: each router's own order
    assert not c.outranked("c", -5, INF, 0.0)  # a backend nobody waits for
    assert c.deferred == 1


def test_a_peer_that_waits_for_nothing_any_more_or_fell_silent_holds_nothing_back() -> None:
    clock = FakeClock()
    c = Claims(clock, tries_per_pump=4)
    c.hear("p1", {"a": (10, None, 0.0)}, [])
    c.hear("p2", {"a": (10, None, 0.0)}, [(10, None, 0.0)])
    c.hear("p1", {}, [])  # its queue emptied
    assert c.snapshot() == {"p2": {"backends": {"a": 10}, "heads": {"10": 1}}}
    clock.advance(CLAIM_TTL_S + 0.01)  # p2 died: no refresh
    assert not c.outranked("a", 0, INF, 0.0) and c.snapshot() == {}


def test_ours_go_out_when_they_change_and_as_a_refresh_while_they_stand() -> None:
    clock = FakeClock()
    c = Claims(clock, tries_per_pump=4)
    assert not c.due(False, ((), ()))  # nothing waits and nothing was said
    assert c.due(True, (("a", 1),))
    assert not c.due(True, (("a", 1),))
    clock.advance(CLAIM_REFRESH_S)
    assert c.due(True, (("a", 1),))  # standing: refreshed before the peers forget it
    assert c.due(True, (("a", 1), ("b", 2)))
    assert c.due(False, ((), ()))  # emptied: said at once
    clock.advance(CLAIM_REFRESH_S)
    assert not c.due(False, ((), ()))  # and not repeated
