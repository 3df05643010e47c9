"""The soak's verdict: which failures a fault is blamed for, and flat memory."""

from loadgen.soak.judge import (
    FRONT_DOOR,
    GRACE_S,
    FaultRecord,
    Outcome,
    Sample,
    flatness,
    judge,
    table,
)

KILL = FaultRecord("engine kill -9", "eu", at_s=100.0, healed_s=100.0, recovered_s=110.0)
ENVOY = FaultRecord("Envoy kill -9", FRONT_DOOR, at_s=300.0, healed_s=300.0, recovered_s=301.0)


def ok(sent_s: float, end_s: float, backend: str = "us") -> Outcome:
    return Outcome(sent_s, end_s, backend, ok=True)


def failed(sent_s: float, end_s: float, backend: str, error: str = "HTTP 503: x") -> Outcome:
    return Outcome(sent_s, end_s, backend, ok=False, error=error)


def test_failures_in_a_faults_window_are_its_own_and_on_its_part_or_not() -> None:
    outcomes = [
        ok(10, 20),  # long before: in no window
        failed(95, 101, "eu", "stream cut: ServerDisconnectedError"),  # open at the kill
        failed(105, 106, "us"),  # in the window, another backend: a defect
        ok(115, 119, "eu"),  # served after the recovery, within the grace
        failed(110 + GRACE_S + 1, 130, "eu"),  # after the window: unexplained
        failed(299, 300.5, ""),  # the front door's fault: any request through it is its
        Outcome(302, 302.1, "", ok=False, refused=True, error="HTTP 429: shed"),  # by design
    ]
    rows, unexplained = judge([KILL, ENVOY], outcomes)
    kill, envoy = rows
    assert (kill.requests, kill.failed, kill.failed_elsewhere) == (3, 2, 1)
    assert kill.reasons == {"stream cut": 1, "HTTP 503": 1}
    assert kill.recover_s == 10.0
    assert (envoy.requests, envoy.failed, envoy.failed_elsewhere) == (2, 1, 0)
    assert unexplained == [outcomes[4]]


def test_a_failure_in_two_windows_belongs_to_the_fault_that_explains_it() -> None:
    """A stream on another backend cut by an Envoy kill while a stall's window is still
    open is the Envoy kill's; one on the stalled backend is the stall's."""
    stall = FaultRecord("engine stall", "ap", at_s=160.0, healed_s=180.0, recovered_s=189.0)
    envoy = FaultRecord("Envoy kill -9", FRONT_DOOR, at_s=195.0, healed_s=195.0, recovered_s=197.0)
    rows, _ = judge(
        [stall, envoy], [failed(185, 195.1, "us"), failed(170, 195.2, "ap"), failed(150, 175, "us")]
    )
    assert [(r.failed, r.failed_elsewhere) for r in rows] == [(2, 1), (1, 0)]


def test_a_part_that_never_recovered_keeps_its_window_to_its_heal_and_says_so() -> None:
    stall = FaultRecord("engine stall", "ap", at_s=50.0, healed_s=70.0, recovered_s=None)
    rows, unexplained = judge([stall], [failed(75, 79, "ap"), failed(90, 91, "ap")])
    assert rows[0].failed == 1 and rows[0].recover_s is None
    assert len(unexplained) == 1
    assert "not within the limit" in table(rows)


def test_memory_is_flat_when_the_last_window_is_within_ten_percent_of_the_first() -> None:
    grows = [Sample(float(t), 100.0 + t / 10, 40) for t in range(0, 1800, 10)]
    steady = [Sample(float(t), 100.0 + (t % 30) / 10, 40) for t in range(0, 1800, 10)]
    f = flatness(grows, warm_s=120, window_s=300)
    assert f is not None and not f.flat and f.rss_ratio > 1.5
    g = flatness(steady, warm_s=120, window_s=300)
    assert g is not None and g.flat and abs(g.rss_ratio - 1) < 0.01
    leak = [Sample(float(t), 100.0, 40 + t // 60) for t in range(0, 1800, 10)]
    h = flatness(leak, warm_s=120, window_s=300)
    assert h is not None and not h.flat  # open files growing is a leak too
    assert flatness(grows[:40], warm_s=120, window_s=300) is None  # too short to judge
