"""`gorgo up`'s supervision through real Envoy: under 32 concurrent streaming clients, a
`kill -9` of the router or of an engine is healed by the supervisor's restart while the
rest of the stack keeps serving (issue 16, done-when 1)."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from emulator.stack.stack import Stack
from emulator.stack.supervisor import RestartPolicy
from tests.e2e.conftest import FAST_ENGINE, FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import ClosedLoop, router_state

# Long (5 s and more a test): `make test-long`, which CI runs after `make test`.
pytestmark = [pytest.mark.e2e, pytest.mark.long]

ASHBURN = FAST_REGIONS[0].id
CLIENTS = 32
OUTPUT_TOKENS = 200
# ~1 s streams (200 tokens at ~5 ms a step): long enough that many are open across each
# kill, short enough that 100 complete in a few seconds on two cores.
ENGINE_ARGS = (*FAST_ENGINE, "--set", "decode_base_ms=5")


@pytest.fixture(scope="module")  # one stack for both kills: it heals in between
def stack() -> Iterator[Stack]:
    s = Stack(
        fast_settings("gorgo", engine_args=ENGINE_ARGS, probe_interval_s=0.2, tuner_mode="off")
    )
    s.start()
    s.supervise(RestartPolicy(), interval_s=0.05)
    yield s
    s.stop()


def poll(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.01) -> float:
    """Wait for predicate; the monotonic time it first held."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every_s)
    return time.monotonic()


def ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def decisions(stack: Stack) -> int:
    try:
        return int(router_state(stack)["decisions"])
    except (urllib.error.URLError, OSError):
        return 0


def restart_of(stack: Stack, name: str, after_s: float) -> float:
    """When the supervisor restarted `name` after after_s (waits for it)."""

    def found() -> bool:
        return any(r.name == name and r.at_s > after_s for r in stack.restarts)

    poll(found, timeout_s=15)
    return next(r.at_s for r in stack.restarts if r.name == name and r.at_s > after_s)


def test_router_kill_9_under_load_fails_nothing_and_routing_resumes_within_2_s(
    stack: Stack,
) -> None:
    # the steady state of a supervised stack: the router's warm spare is waiting (a router
    # dying within its first seconds restarts cold: a Python start-up more)
    log = stack.workdir / "gorgo-serve.log"
    poll(lambda: "warm spare" in log.read_text(), timeout_s=30, every_s=0.05)
    with ClosedLoop(stack.front_door_url, CLIENTS, OUTPUT_TOKENS) as load:
        poll(lambda: len(load.done) >= CLIENTS, timeout_s=20, every_s=0.05)  # warmed up
        killed_s = time.monotonic()
        os.kill(stack.procs["gorgo-serve"].pid, signal.SIGKILL)
        restarted_s = restart_of(stack, "gorgo-serve", killed_s)
        healthy_s = poll(lambda: ok(f"{stack.admin_url}/healthz"), timeout_s=30)
        routed_s = poll(lambda: decisions(stack) > 0, timeout_s=10)
        # keep the load on until 100 requests have completed since the kill
        poll(lambda: len(load.after(killed_s)) >= 100, timeout_s=30, every_s=0.05)
    across = [d for d in load.done if d.end_s > killed_s]
    failed = [d.result.error for d in across if not d.result.ok]
    open_at_kill = sum(1 for d in across if d.start_s < killed_s)
    fail_open = sum(1 for d in across if killed_s <= d.start_s < routed_s)
    print(
        f"\nrouter kill -9 under {CLIENTS} clients x {OUTPUT_TOKENS} tokens: {len(failed)} of "
        f"{len(across)} requests failed ({open_at_kill} open at the kill, {fail_open} sent "
        f"while routing was down); restarted {restarted_s - killed_s:.2f} s after the kill, "
        f"healthy {healthy_s - restarted_s:.2f} s after the restart, first decision "
        f"{routed_s - healthy_s:.2f} s after healthy ({routed_s - restarted_s:.2f} s after "
        f"the restart); {len(load.done)} requests in all"
    )
    assert failed == [] and len(across) >= 100
    assert all(d.result.output_tokens == OUTPUT_TOKENS for d in across)
    assert routed_s - healthy_s < 2.0
    assert routed_s - restarted_s < 2.0  # the warm spare: no Python start-up to wait for
    assert stack.supervisor_error is None


def test_engine_kill_9_under_load_fails_no_request_sent_after_it_and_it_comes_back(
    stack: Stack,
) -> None:
    name = f"engine-{ASHBURN}"
    with ClosedLoop(stack.front_door_url, CLIENTS, OUTPUT_TOKENS) as load:
        poll(lambda: len(load.done) >= CLIENTS, timeout_s=20, every_s=0.05)
        poll(lambda: any(d.result.backend == ASHBURN for d in load.done), timeout_s=10)
        killed_s = time.monotonic()
        os.kill(stack.procs[name].pid, signal.SIGKILL)
        restarted_s = restart_of(stack, name, killed_s)

        def served_by_it_since_restart() -> bool:
            return any(
                d.result.ok and d.result.backend == ASHBURN and d.start_s > restarted_s
                for d in load.done
            )

        back_s = poll(served_by_it_since_restart, timeout_s=20, every_s=0.05)
        poll(lambda: len(load.after(back_s)) >= CLIENTS, timeout_s=20, every_s=0.05)
    across = [d for d in load.done if d.end_s > killed_s]
    open_at_kill = [d for d in across if d.start_s < killed_s]
    sent_after = [d for d in across if d.start_s >= killed_s]
    lost = [d for d in open_at_kill if not d.result.ok]
    failed_after = [d for d in sent_after if not d.result.ok]
    state = router_state(stack)["backends"][ASHBURN]
    print(
        f"\nengine kill -9 ({ASHBURN}) under {CLIENTS} clients: {len(open_at_kill)} requests "
        f"open at the kill, {len(lost)} of them failed (on the engine killed: "
        f"{sum(d.result.backend == ASHBURN for d in lost)}); {len(failed_after)} of "
        f"{len(sent_after)} sent after the kill failed; restarted "
        f"{restarted_s - killed_s:.2f} s after the kill, serving again "
        f"{back_s - restarted_s:.2f} s after the restart; router: completed "
        f"{state['completed']}, errors {state['errors']}, failovers {state['failovers']}"
    )
    for error, n in Counter(d.result.error[:100] for d in lost).items():
        print(f"  open at the kill, failed: {n} x {error}")
    for d in failed_after:
        print(
            f"  sent after the kill, failed: sent {d.start_s - killed_s:+.3f} s from the kill, "
            f"backend {d.result.backend or '?'}: {d.result.error}"
        )
    assert failed_after == [], [d.result.error for d in failed_after]
    assert all(d.result.backend == ASHBURN for d in lost), [d.result.backend for d in lost]
    assert stack.supervisor_error is None
