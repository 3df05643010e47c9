"""Stack.tend applying `gorgo up`'s restart policy to real (trivial) child processes: a
killed child restarted with the same argv, one killed on purpose left down, a crash loop
given up, warm spares. The policy itself, on a fake clock:
tests/unit/emulator/stack/test_supervisor.py."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from emulator.stack.ports import free_ports
from emulator.stack.settings import StackPorts, StackSettings
from emulator.stack.stack import Stack
from emulator.stack.supervisor import RestartPolicy

FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=3, window_s=60)
SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


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
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    assert psutil.Process(new).cmdline() == [*SLEEPER, "--port", "12345"]
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


def test_a_router_in_a_crash_loop_is_restarted_until_it_starts_and_nothing_else_stops(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """A router that exits at once (a broken config, no last good copy) is never given up
    on: past the crash-loop rule it is restarted every backoff_max_s, said once, while the
    other children (Envoy, engines) run on; fixed, it stays up (issue 39, point 4)."""
    fixed = stack.workdir / "fixed"
    code = (
        "import os, sys, time; print('listen.admin: bad', flush=True); "
        f"os.path.exists({str(fixed)!r}) or sys.exit(2); time.sleep(60)"
    )
    stack._spawn("gorgo-serve", [sys.executable, "-c", code])
    stack._spawn("envoy", SLEEPER)
    envoy = stack.procs["envoy"].pid
    policy = RestartPolicy(
        backoff_s=0.05, backoff_max_s=0.2, max_restarts=3, window_s=60, healthy_after_s=0.5
    )
    stack.supervise(policy, interval_s=0.02)
    wait_until(lambda: len(stack.restarts) >= 7)  # 3 within the rule, 4 past it
    assert stack.supervisor_error is None and alive(envoy)
    assert [r.attempt for r in stack.restarts[:7]] == [1, 2, 3, 4, 5, 6, 7]
    fixed.touch()
    said: list[str] = []

    def out_of_the_loop() -> bool:
        said.append(capsys.readouterr().err)
        return "gorgo-serve is out of its crash loop" in said[-1]

    wait_until(out_of_the_loop)  # it ran healthy_after_s since its last restart
    restarts = len(stack.restarts)
    time.sleep(0.3)
    assert len(stack.restarts) == restarts and stack.supervisor_error is None
    err = "".join(said)
    assert err.count("a crash loop. A router is never given up on") == 1
    assert "restarted every 0.2 s until it starts" in err and "listen.admin: bad" in err
    assert "gorgo up: gorgo-serve exited (code 2); restart 5 in 0.2 s" in err
    assert "gorgo-serve is out of its crash loop" in err
    assert alive(envoy) and alive(stack.procs["gorgo-serve"].pid)


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
