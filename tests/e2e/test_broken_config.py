"""The front door outlives the router (issue 39, point 4): with a broken config on disk
(its SIGHUP refused), a `kill -9` of the router fails no request: the router comes back
from its last good config; with no last good copy either, the supervisor keeps retrying it
past the crash-loop rule while Envoy fails open and the engines stay up, and once the file
is fixed the router is back. The stack's logs outlive it.

GORGO_FAULT_TRAFFIC_S sets how long traffic runs after the kill (default 20 s; the issue's
acceptance run is 60: `GORGO_FAULT_TRAFFIC_S=60 pytest -s -m long tests/e2e/test_broken_config.py`).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.error
from collections.abc import Callable, Iterator

import pytest

from emulator.stack.stack import Stack
from emulator.stack.supervisor import RestartPolicy
from tests.e2e.conftest import FAST_ENGINE, fast_settings
from tests.e2e.stack_harness import ClosedLoop, router_state

pytestmark = [pytest.mark.e2e, pytest.mark.long]

CLIENTS = 4
TRAFFIC_S = float(os.environ.get("GORGO_FAULT_TRAFFIC_S", "20"))
# ~0.25 s streams: requests are open across every kill and restart
ENGINE_ARGS = (*FAST_ENGINE, "--set", "decode_base_ms=5")
# Fewer restarts before the crash-loop rule and a shorter cap than gorgo up's (5, 8 s), so
# the router is past the rule within ~15 s; the rule's shape is the same.
POLICY = RestartPolicy(max_restarts=3, backoff_max_s=2.0)
# What a careless edit leaves: not even YAML.
BROKEN = "listen: {grpc: 127.0.0.1:1\nbackends: [\n"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(
        fast_settings(
            "gorgo", engine_args=ENGINE_ARGS, probe_interval_s=0.2, tuner_mode="off", keep_logs=True
        )
    )
    s.start()
    s.supervise(POLICY, interval_s=0.05)
    yield s
    s.stop()
    shutil.rmtree(s.workdir, ignore_errors=True)  # kept by the stack; checked below


def poll(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every_s)
    return time.monotonic()


def state_or_none(stack: Stack) -> dict[str, object] | None:
    try:
        out: dict[str, object] = router_state(stack)
        return out
    except (urllib.error.URLError, OSError):
        return None


def others_untouched(stack: Stack, pids: dict[str, int]) -> None:
    """Envoy and the engines and links never stopped: same processes, no restarts."""
    assert {n: stack.procs[n].pid for n in pids} == pids
    assert {r.name for r in stack.restarts} <= {"gorgo-serve"}
    assert stack.supervisor_error is None


def test_a_router_kill_with_a_broken_config_on_disk_fails_nothing(stack: Stack) -> None:
    config = stack.workdir / "gorgo.yaml"
    log = stack.workdir / "gorgo-serve.log"
    pids = {n: p.pid for n, p in stack.procs.items() if n != "gorgo-serve"}
    poll(lambda: "warm spare" in log.read_text(), timeout_s=30, every_s=0.05)
    with ClosedLoop(stack.front_door_url, CLIENTS, 50) as load:
        poll(lambda: len(load.done) >= 4 * CLIENTS, timeout_s=20)
        before = router_state(stack)
        config.write_text(BROKEN)
        os.kill(stack.procs["gorgo-serve"].pid, signal.SIGHUP)
        poll(lambda: router_state(stack)["reload"]["failures"] >= 1, timeout_s=10)
        refused = router_state(stack)
        assert refused["config"]["source"] == "file"  # the old config runs on
        assert set(refused["backends"]) == set(before["backends"])
        killed_s = time.monotonic()
        os.kill(stack.procs["gorgo-serve"].pid, signal.SIGKILL)
        poll(lambda: any(r.at_s > killed_s for r in stack.restarts), timeout_s=15)
        restarted_s = next(r.at_s for r in stack.restarts if r.at_s > killed_s)

        def deciding() -> bool:
            s = state_or_none(stack)
            return s is not None and int(s["decisions"]) > 0  # type: ignore[call-overload]

        routed_s = poll(deciding, timeout_s=20)
        state = router_state(stack)
        assert state["config"]["source"] == "last-good"
        assert "not valid YAML" in state["config"]["error"]
        poll(lambda: time.monotonic() >= killed_s + TRAFFIC_S, timeout_s=TRAFFIC_S + 5, every_s=0.2)
        decisions = int(router_state(stack)["decisions"])
    across = load.after(killed_s)
    failed = [d.result.error for d in across if not d.result.ok]
    fail_open = sum(1 for d in across if killed_s <= d.start_s < routed_s)
    print(
        f"\nbroken config (SIGHUP refused) + router kill -9, {CLIENTS} clients, "
        f"{TRAFFIC_S:g} s of traffic after the kill: {len(failed)} of {len(across)} requests "
        f"failed; {fail_open} sent while routing was down (fallback route); restarted "
        f"{restarted_s - killed_s:.2f} s after the kill, first decision from the last good "
        f"config {routed_s - killed_s:.2f} s after the kill; {decisions} decisions since"
    )
    assert failed == [] and len(across) >= 20 * CLIENTS
    assert decisions >= len(across) // 2  # the router decides again, not the fallback
    others_untouched(stack, pids)
    text = log.read_text()
    assert f"config {config} does not load" in text and "last good config" in text


def test_no_last_good_copy_either_the_router_is_retried_until_the_file_is_fixed(
    stack: Stack,
) -> None:
    """Then the stack stops: its logs are kept (the last test of the module stops it)."""
    config = stack.workdir / "gorgo.yaml"
    last_good = stack.workdir / "gorgo-serve.last-good.yaml"
    good = last_good.read_text() if last_good.exists() else config.read_text()
    pids = {n: p.pid for n, p in stack.procs.items() if n != "gorgo-serve"}
    with ClosedLoop(stack.front_door_url, CLIENTS, 50) as load:
        poll(lambda: len(load.done) >= 2 * CLIENTS, timeout_s=20)
        config.write_text(BROKEN)
        last_good.unlink(missing_ok=True)
        killed_s = time.monotonic()
        os.kill(stack.procs["gorgo-serve"].pid, signal.SIGKILL)

        def restarts() -> int:
            return sum(1 for r in stack.restarts if r.at_s > killed_s)

        # past the crash-loop rule (3 restarts in 60 s): not given up, still retried
        poll(lambda: restarts() >= POLICY.max_restarts + 2, timeout_s=60, every_s=0.1)
        assert stack.supervisor_error is None and state_or_none(stack) is None
        down = [d for d in load.after(killed_s) if d.start_s > killed_s]
        assert len(down) >= 10 and all(d.result.ok for d in down)  # Envoy fails open
        fixed_s = time.monotonic()
        config.write_text(good)

        def back() -> bool:
            s = state_or_none(stack)
            return s is not None and int(s["decisions"]) > 0  # type: ignore[call-overload]

        back_s = poll(back, timeout_s=30, every_s=0.05)
        assert router_state(stack)["config"]["source"] == "file"
        poll(lambda: last_good.exists(), timeout_s=5)
        n_restarts = restarts()
        poll(lambda: time.monotonic() >= back_s + 2, timeout_s=5, every_s=0.1)
    across = load.after(killed_s)
    failed = [d.result.error for d in across if not d.result.ok]
    print(
        f"\nbroken config, no last good copy, router kill -9: {n_restarts} restarts (exit 2) "
        f"while {len(across)} requests were served, {len(failed)} failed; back "
        f"{back_s - fixed_s:.2f} s after the file was fixed"
    )
    assert failed == []
    others_untouched(stack, pids)
    assert last_good.read_text() == good
    stack.stop()
    log = (stack.workdir / "gorgo-serve.log").read_text()  # each exit's error is in it
    assert log.count("not valid YAML") >= POLICY.max_restarts + 2
    assert (stack.workdir / "envoy.log").exists() and (stack.workdir / "gorgo.yaml").exists()
