"""Room shared by several routers (flow.shared.Releases): one release per backend until the
bus confirms it, and a release the bus never confirms times out (fail open)."""

import pytest

from ext_proc.flow.shared import CONFIRM_TIMEOUT_S, Releases
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
