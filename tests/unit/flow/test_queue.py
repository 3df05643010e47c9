"""The gateway queue's order (flow.queue.FlowQueue): bands first, the starvation bound,
tenants by decaying service, then deadline and arrival; the caps and the expiry."""

import math

import pytest

from ext_proc.config.flow import FlowControl
from ext_proc.flow.queue import FlowQueue, Waiting
from ext_proc.vocab.types import RouteRequest


def waiting(
    rid: str,
    arrival_s: float = 0.0,
    priority: int = 0,
    tenant: str = "",
    deadline_s: float = math.inf,
    expires_s: float = 60.0,
    body_bytes: int = 100,
) -> Waiting:
    return Waiting(
        RouteRequest(rid, None, None),
        "default",
        tenant,
        priority,
        arrival_s,
        deadline_s,
        expires_s,
        False,
        body_bytes,
        tokens=1000,
    )


def ids(q: FlowQueue, now_s: float) -> list[str]:
    return [w.request.request_id for w in q.order(now_s)]


def queue(*items: Waiting, **settings: object) -> FlowQueue:
    q = FlowQueue(FlowControl(enabled=True, **settings))  # type: ignore[arg-type]
    for w in items:
        q.push(w)
    return q


@pytest.mark.parametrize(
    ("case", "items", "now_s", "expected"),
    [
        ("arrival order in one band", [waiting("a", 1), waiting("b", 0)], 2, ["b", "a"]),
        (
            "a higher band first, whatever its arrival",
            [waiting("low", 0, priority=0), waiting("high", 5, priority=10)],
            6,
            ["high", "low"],
        ),
        (
            "earliest deadline first in a band, no deadline last",
            [
                waiting("none", 0),
                waiting("late", 1, deadline_s=30),
                waiting("soon", 2, deadline_s=10),
            ],
            3,
            ["soon", "late", "none"],
        ),
        (
            "past the starvation bound a low band goes first",
            [waiting("old-low", 0, priority=0), waiting("high", 20, priority=10)],
            31,
            ["old-low", "high"],
        ),
    ],
)
def test_the_order(case: str, items: list[Waiting], now_s: float, expected: list[str]) -> None:
    q = queue(*items)
    assert ids(q, now_s)[: len(expected)] == expected, case


def test_a_starved_request_is_offered_once_a_pump() -> None:
    q = queue(waiting("old-low", 0, priority=0), waiting("high", 20, priority=10))
    assert ids(q, 31) == ["old-low", "high"]


def test_the_tenant_with_less_recent_service_goes_first_and_service_decays() -> None:
    q = queue(waiting("heavy-1", 0, tenant="heavy"), waiting("light-1", 1, tenant="light"))
    q.charge("heavy", 10_000, now_s=0.0)
    q.charge("light", 1_000, now_s=0.0)
    assert ids(q, 1.0) == ["light-1", "heavy-1"]
    # one half-life (60 s) halves it: 10,000 -> 5,000
    assert q.service("heavy", 60.0) == pytest.approx(5_000)
    assert q.service("heavy", 120.0) == pytest.approx(2_500)


def test_a_removed_request_is_not_offered_and_the_caps_count_what_waits() -> None:
    a, b = waiting("a", 0, body_bytes=600), waiting("b", 1, body_bytes=300)
    q = queue(a, b, max_queued_requests=2, max_queued_bytes=1000)
    assert q.full(0, body_bytes=1)  # two requests already: the band is full
    q.remove(a)
    assert ids(q, 2) == ["b"] and len(q) == 1
    assert not q.full(0, body_bytes=700) and q.full(0, body_bytes=701)  # 300 + 701 > 1000
    assert not q.full(5, body_bytes=10**6 - 1)  # another band is another queue


def test_expired_requests_leave_the_queue_in_expiry_order() -> None:
    q = queue(waiting("a", 0, expires_s=10), waiting("b", 0, expires_s=5), waiting("c", 0))
    assert q.next_expiry_s() == 5
    assert [w.request.request_id for w in q.expired(9.9)] == ["b"]
    assert [w.request.request_id for w in q.expired(10)] == ["a"]
    assert ids(q, 11) == ["c"] and q.next_expiry_s() == 60


def test_depth_by_band_and_tenant() -> None:
    q = queue(
        waiting("a", priority=10, tenant="t1"),
        waiting("b", priority=0, tenant="t1"),
        waiting("c", priority=0, tenant="t2"),
    )
    assert q.depth() == {"bands": {"10": 1, "0": 2}, "tenants": {"t1": 2, "t2": 1}}


def test_in_the_highest_band_an_old_request_of_a_heavy_tenant_does_not_jump_a_light_one() -> None:
    q = queue(waiting("heavy-old", 0, tenant="heavy"), waiting("light-new", 40, tenant="light"))
    q.charge("heavy", 10_000, now_s=0.0)
    assert ids(q, 41) == ["light-new", "heavy-old"]  # 41 s > the 30 s starvation bound


def test_a_pump_that_stops_early_leaves_every_unreleased_request_waiting() -> None:
    q = queue(*(waiting(f"r{i}", i) for i in range(5)))
    order = q.order(10)
    first, second = next(order), next(order)
    q.remove(first)  # released; the pump stops after the second finds no room
    order.close()
    assert ids(q, 11) == ["r1", "r2", "r3", "r4"] and second.request.request_id == "r1"


# -- what each tenant has in the engines, and its share -----------------------------------


def test_a_tenants_tokens_in_the_engines_count_until_its_requests_end() -> None:
    q = queue()
    q.sent("h1", "heavy", prompt_tokens=30_000, output_tokens=500)
    q.sent("h2", "heavy", prompt_tokens=10_000, output_tokens=200)
    assert q.in_engine("heavy") == 40_700 and q.in_engine("light") == 0
    q.finished("h1")
    q.finished("h1")  # ended once
    assert q.in_engine("heavy") == 10_200
    q.sent("h2", "heavy", prompt_tokens=1_000, output_tokens=0)  # a reused id replaces
    assert q.in_engine("heavy") == 1_000
    q.finished("h2")
    q.finished("unknown")
    assert q.in_engine("heavy") == 0


def test_tenants_go_in_order_of_what_they_have_in_the_engines_plus_recent_service() -> None:
    q = queue(waiting("h", 0, tenant="heavy"), waiting("l", 1, tenant="light"))
    q.charge("light", 5_000, now_s=0.0)
    assert ids(q, 1.0) == ["h", "l"]  # heavy has less service, nothing in the engines
    q.sent("h0", "heavy", prompt_tokens=8_000, output_tokens=0)
    # light's service has decayed for 1 s of its 60 s half-life
    assert q.usage("heavy", 1.0) == 8_000
    assert q.usage("light", 1.0) == pytest.approx(5_000 * 0.5 ** (1 / 60))
    assert ids(q, 1.0) == ["l", "h"]
    q.finished("h0")
    assert ids(q, 1.0) == ["h", "l"]


@pytest.mark.parametrize(
    ("case", "seen", "now_s", "settings", "expected"),
    [
        ("two tenants active: half each", {"heavy": 0.0, "light": 10.0}, 30.0, {}, 500_000),
        ("three: a third", {"a": 0.0, "b": 0.0, "c": 0.0}, 1.0, {}, 1_000_000 / 3),
        ("one tenant: no limit", {"heavy": 0.0}, 1.0, {}, math.inf),
        ("the other quiet past the window", {"heavy": 70.0, "light": 10.0}, 71.0, {}, math.inf),
        ("a shorter window", {"heavy": 0.0, "light": 0.0}, 20.0, {"tenant_window_s": 10}, math.inf),
        ("two equal shares each", {"h": 0.0, "l": 0.0}, 1.0, {"tenant_share": 2}, 1_000_000),
        ("tenant_share 0: no limit", {"h": 0.0, "l": 0.0}, 1.0, {"tenant_share": 0}, math.inf),
    ],
)
def test_a_tenants_share_of_the_engines(
    case: str, seen: dict[str, float], now_s: float, settings: dict[str, float], expected: float
) -> None:
    q = queue(**settings)
    for tenant, at_s in seen.items():
        q.seen(tenant, at_s)
    assert q.share(now_s, capacity_tokens=1_000_000) == pytest.approx(expected), case


def test_a_tenant_over_its_share_waits_but_one_request_always_may_go() -> None:
    q = queue()
    assert not q.over_share("heavy", 900_000, share_tokens=500_000)  # nothing of it there
    q.sent("h1", "heavy", prompt_tokens=450_000, output_tokens=0)
    assert not q.over_share("heavy", 50_000, share_tokens=500_000)
    assert q.over_share("heavy", 50_001, share_tokens=500_000)
    assert not q.over_share("heavy", 10**9, share_tokens=math.inf)
    q.finished("h1")
    assert not q.over_share("heavy", 900_000, share_tokens=500_000)
