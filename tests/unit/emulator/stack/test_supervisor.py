"""`gorgo up`'s supervision: the restart policy on a fake clock, and a stack's ports handed
out once. Stack.tend applying the policy to real (trivial) child processes:
tests/component/emulator/stack/test_supervisor.py."""

from __future__ import annotations

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.supervisor import GiveUp, Restart, RestartPolicy, Supervisor

# -- the policy, on a fake clock ---------------------------------------------------------


def test_backoff_doubles_from_half_a_second_to_the_cap() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=100, window_s=1000))
    now, delays = 0.0, []
    sup.started("engine", now)
    for _ in range(7):
        now += 1.0  # dies a second after each start: never healthy
        r = sup.exited("engine", now)
        assert isinstance(r, Restart)
        delays.append(r.delay_s)
        assert r.at_s == now + r.delay_s
        now = r.at_s
        sup.started("engine", now)
    assert delays == [0.5, 1, 2, 4, 8, 8, 8]


def test_a_restart_is_due_only_once_its_backoff_is_over() -> None:
    sup = Supervisor()
    sup.started("router", 0.0)
    r = sup.exited("router", 3.0)
    assert isinstance(r, Restart) and (r.attempt, r.delay_s) == (1, 0.5)
    assert sup.pending("router")
    assert sup.due(3.49) == []
    assert sup.due(3.5) == [r]
    sup.started("router", 3.5)  # restarted: no longer pending
    assert not sup.pending("router") and sup.due(10.0) == []


def test_a_child_that_ran_long_enough_starts_its_backoff_afresh() -> None:
    sup = Supervisor(RestartPolicy(healthy_after_s=10, window_s=30))
    sup.started("wan", 0.0)
    assert sup.exited("wan", 1.0) == Restart("wan", 1, 0.5, 1.5)
    sup.started("wan", 1.5)
    assert sup.exited("wan", 2.0) == Restart("wan", 2, 1.0, 3.0)
    sup.started("wan", 3.0)
    # ran 40 s: healthy, and the earlier restarts are out of the window too
    assert sup.exited("wan", 43.0) == Restart("wan", 1, 0.5, 43.5)


def test_more_than_max_restarts_within_the_window_is_a_crash_loop() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=5, window_s=60))
    now = 0.0
    sup.started("wan-ap-seoul", now)
    for attempt in range(1, 6):
        now += 0.2  # fails at once, every time
        r = sup.exited("wan-ap-seoul", now)
        assert isinstance(r, Restart) and r.attempt == attempt and not r.crash_loop
        now = r.at_s
        sup.started("wan-ap-seoul", now)
    assert now < 60  # 0.5 + 1 + 2 + 4 + 8 s of backoff, 1 s of running
    assert sup.exited("wan-ap-seoul", now + 0.2) == GiveUp("wan-ap-seoul", 5, 60)
    assert not sup.pending("wan-ap-seoul") and sup.due(1e9) == []


@pytest.mark.parametrize("name", ["gorgo-serve", "router-2-gorgo-serve", "door-eu-gorgo-serve"])
def test_a_router_is_never_given_up_on_past_the_crash_loop_it_waits_the_max_backoff(
    name: str,
) -> None:
    """A router that cannot start (a broken config and no last good copy) is retried every
    backoff_max_s for as long as it takes; Envoy fails open meanwhile (issue 39)."""
    sup = Supervisor(RestartPolicy(max_restarts=5, window_s=60))
    now, seen = 0.0, []
    sup.started(name, now)
    for _ in range(20):  # ~2.5 minutes of exiting at once
        now += 0.2
        r = sup.exited(name, now)
        assert isinstance(r, Restart), r
        seen.append((r.delay_s, r.crash_loop, r.loop_began))
        now = r.at_s
        sup.started(name, now)
    assert [d for d, _, _ in seen[:5]] == [0.5, 1, 2, 4, 8]
    assert not any(loop for _, loop, _ in seen[:5])
    # past the rule: every 8 s, in a crash loop, told once (the 6th restart)
    assert seen[5:] == [(8.0, True, True)] + [(8.0, True, False)] * 14
    assert sup.recovered(now + 9.9) == []  # not yet healthy_after_s since its start
    assert sup.recovered(now + 10.0) == [name] and sup.recovered(now + 20) == []
    # healthy since: the next exit starts afresh, and a new loop is told again
    now += 30.0
    r = sup.exited(name, now)
    assert isinstance(r, Restart) and (r.attempt, r.delay_s, r.crash_loop) == (1, 0.5, False)


def test_a_router_loop_that_ran_healthy_is_told_again_next_time() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=1, window_s=1000, healthy_after_s=10))
    sup.started("gorgo-serve", 0.0)
    assert not sup.exited("gorgo-serve", 1.0).loop_began  # type: ignore[union-attr]
    sup.started("gorgo-serve", 2.0)
    r = sup.exited("gorgo-serve", 3.0)
    assert isinstance(r, Restart) and r.crash_loop and r.loop_began
    sup.started("gorgo-serve", r.at_s)
    r = sup.exited("gorgo-serve", r.at_s + 20)  # ran 20 s: its streak is over
    assert isinstance(r, Restart) and r.crash_loop and r.loop_began  # still 2 in 1000 s


def test_which_children_are_never_given_up_on_is_the_policys() -> None:
    assert RestartPolicy().persistent("gorgo-serve")
    assert not RestartPolicy().persistent("envoy")
    assert not RestartPolicy().persistent("engine-us-ashburn")
    sup = Supervisor(RestartPolicy(max_restarts=0, persistent_suffixes=()))
    sup.started("gorgo-serve", 0.0)
    assert sup.exited("gorgo-serve", 1.0) == GiveUp("gorgo-serve", 0, 60)


def test_restarts_older_than_the_window_do_not_count() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=60, healthy_after_s=1000))
    sup.started("nats", 0.0)
    assert isinstance(sup.exited("nats", 1.0), Restart)
    sup.started("nats", 1.5)
    assert isinstance(sup.exited("nats", 2.0), Restart)
    sup.started("nats", 3.0)
    # a third exit 70 s later: the first two restarts left the window
    r = sup.exited("nats", 72.0)
    assert isinstance(r, Restart) and r.attempt == 3  # still a streak: it never ran 1000 s
    sup.started("nats", r.at_s)
    r = sup.exited("nats", 80.0)  # one restart in the window, limit 2
    assert isinstance(r, Restart) and r.attempt == 4
    sup.started("nats", r.at_s)
    assert sup.exited("nats", 90.0) == GiveUp("nats", 2, 60)


def test_children_are_independent_and_forget_drops_one() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=1))
    for name in ("a", "b"):
        sup.started(name, 0.0)
        assert isinstance(sup.exited(name, 1.0), Restart)
    sup.forget("a")  # stopped on purpose: nothing scheduled, no history
    assert [r.name for r in sup.due(5.0)] == ["b"]
    sup.started("a", 5.0)
    assert isinstance(sup.exited("a", 6.0), Restart)
    sup.started("b", 5.0)
    assert isinstance(sup.exited("b", 6.0), GiveUp)


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(backoff_s=2, backoff_max_s=1)
    with pytest.raises(ValueError, match="window_s"):
        RestartPolicy(window_s=0)


# -- a stack's ports --------------------------------------------------------------------


def test_a_port_is_handed_out_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack picks all its ports before any child binds one: a port picked once is not
    picked again, though nothing listens on it yet."""
    import emulator.stack.ports as ports_module

    draws = iter([21000, 21000, 21000, 21001])

    class Draws:
        def randint(self, _lo: int, _hi: int) -> int:
            return next(draws)

    monkeypatch.setattr(ports_module.random, "SystemRandom", Draws)
    monkeypatch.setattr(ports_module, "_HANDED_OUT", set())
    monkeypatch.setattr(ports_module, "port_taken", lambda _port: False)  # nothing listens
    assert free_ports(1) == [21000]
    assert free_ports(1) == [21001]  # 21000 is drawn twice more and passed over


def test_processes_drawing_at_once_draw_from_slices_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two test workers start stacks at once: each draws from its own slice of the range
    (GORGO_PORT_SLICE, set by tests/conftest.py), so one port never goes to both."""
    from emulator.stack.ports import PORT_RANGE, PORT_SLICE_ENV, port_range

    first, second = port_range("0/2"), port_range("1/2")
    assert first[0] == PORT_RANGE[0] and first[1] < second[0] and second[1] <= PORT_RANGE[1]
    assert port_range("") == PORT_RANGE
    for bad in ("2/2", "a/2", "1"):
        with pytest.raises(ValueError, match=PORT_SLICE_ENV):
            port_range(bad)
    monkeypatch.setenv(PORT_SLICE_ENV, "1/2")
    assert all(second[0] <= p <= second[1] for p in free_ports(20))
