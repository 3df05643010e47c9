"""`gorgo up`'s supervision: the restart policy on a fake clock, then Stack.tend applying
it to real (trivial) child processes."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from emulator.stack import Stack, StackPorts, StackSettings
from emulator.stack.ports import free_ports
from emulator.supervisor import GiveUp, Restart, RestartPolicy, Supervisor

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
    sup.started("gorgo-serve", now)
    for attempt in range(1, 6):
        now += 0.2  # fails at once, every time
        r = sup.exited("gorgo-serve", now)
        assert isinstance(r, Restart) and r.attempt == attempt
        now = r.at_s
        sup.started("gorgo-serve", now)
    assert now < 60  # 0.5 + 1 + 2 + 4 + 8 s of backoff, 1 s of running
    assert sup.exited("gorgo-serve", now + 0.2) == GiveUp("gorgo-serve", 5, 60)
    assert not sup.pending("gorgo-serve") and sup.due(1e9) == []


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


# -- Stack.tend on real children ---------------------------------------------------------

FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=3, window_s=60)
SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


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


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(StackSettings(ports=StackPorts.ephemeral(3), workdir=tmp_path))
    yield s
    s.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_child_is_restarted_with_the_same_argv_and_logged(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    stack._spawn("sleeper", [*SLEEPER, "--port", "12345"])
    stack.supervise(FAST, interval_s=0.02)
    log = stack.workdir / "sleeper.log"
    wait_until(lambda: log.read_text().count("up") == 1)
    old = stack.procs["sleeper"].pid
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: len(stack.restarts) == 1)
    new = stack.procs["sleeper"].pid
    assert new != old and alive(new) and stack.restarts[0].pid == new
    with open(f"/proc/{new}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[:-1] == [a.encode() for a in [*SLEEPER, "--port", "12345"]]
    err = capsys.readouterr().err
    assert "gorgo up: sleeper exited (signal 9); restart 1 in 0.05 s" in err
    assert f"gorgo up: sleeper restarted (restart 1, pid {new})" in err
    wait_until(lambda: log.read_text().count("up") == 2)  # the same log, appended to
    assert stack.supervised and "supervised: a child that exits is restarted" in stack.ready_line()


def test_a_child_killed_on_purpose_stays_down(stack: Stack) -> None:
    stack._spawn("sleeper", SLEEPER)
    stack._spawn("other", SLEEPER)
    stack.supervise(FAST, interval_s=0.02)
    stack.kill("sleeper")
    time.sleep(0.3)
    assert "sleeper" not in stack.procs and stack.restarts == []


def test_a_crash_loop_gives_up_with_the_last_log_lines_and_the_rest_keep_running(
    stack: Stack,
) -> None:
    stack._spawn("crasher", [sys.executable, "-c", "print('bad key: listen'); raise SystemExit(3)"])
    stack._spawn("sleeper", SLEEPER)
    stack.supervise(FAST, interval_s=0.02)
    wait_until(lambda: stack.supervisor_error is not None)
    message = str(stack.supervisor_error)
    assert "crasher exited (code 3) after 3 restarts within 60 s: a crash loop" in message
    assert message.count("bad key: listen") == 4  # the first run and three restarts
    assert [r.attempt for r in stack.restarts] == [1, 2, 3]
    assert alive(stack.procs["sleeper"].pid)  # the thread's children outlive the give-up


def test_stop_ends_restarted_children_too(stack: Stack) -> None:
    stack._spawn("sleeper", SLEEPER)
    stack.supervise(FAST, interval_s=0.02)
    os.kill(stack.procs["sleeper"].pid, signal.SIGKILL)
    wait_until(lambda: len(stack.restarts) == 1)
    pid = stack.procs["sleeper"].pid
    stack.stop()
    assert not alive(pid) and stack.procs == {}
    time.sleep(0.1)  # and nothing comes back
    assert stack.procs == {}


def test_a_router_restarts_from_its_warm_spare(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    # a stand-in for `python -m ext_proc.cli serve`: the stdlib's HTTP server, json preloaded
    stack.SPARE_FOR, stack.SPARE_PRELOAD, stack.SPARE_AFTER_S = (
        "serve",
        {"http.server": ("json",)},
        0,
    )
    (port,) = free_ports(1)
    stack._spawn("fake-serve", [sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port)])
    stack.supervise(FAST, interval_s=0.02)
    wait_until(lambda: "fake-serve" in stack._spares)
    spare = stack._spares["fake-serve"][0]
    wait_until(lambda: serves(port))
    os.kill(stack.procs["fake-serve"].pid, signal.SIGKILL)
    wait_until(lambda: len(stack.restarts) == 1)
    assert stack.procs["fake-serve"] is spare  # the spare became the child
    wait_until(lambda: serves(port))
    assert "fake-serve restarted from its warm spare (restart 1" in capsys.readouterr().err
    wait_until(lambda: "fake-serve" in stack._spares)  # and a new spare waits
    assert stack._spares["fake-serve"][0] is not spare


def test_stop_ends_the_spares(stack: Stack) -> None:
    stack.SPARE_FOR, stack.SPARE_PRELOAD, stack.SPARE_AFTER_S = "serve", {"http.server": ()}, 0
    (port,) = free_ports(1)
    stack._spawn("fake-serve", [sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port)])
    stack.supervise(FAST, interval_s=0.02)
    wait_until(lambda: "fake-serve" in stack._spares)
    pid = stack._spares["fake-serve"][0].pid
    stack.stop()
    assert not alive(pid) and stack._spares == {}


def serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False
