"""`gorgo check` says all is well for `gorgo up`'s own config: the local stack (emulated
SGLang engines behind their WAN links, on free ports) writes the router's config, and the
check, run as a user runs it, finds every backend answering, its queue read from the
engine's /metrics, and nothing to fix."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from emulator.stack.stack import Stack
from tests.e2e.conftest import FAST_REGIONS, fast_settings

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings(policy="gorgo"))
    s.start()
    yield s
    s.stop()


def test_gorgo_check_says_all_is_well_for_gorgo_ups_config(stack: Stack) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ext_proc.cli",
            "check",
            "--config",
            str(stack.workdir / "gorgo.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == f"gorgo check: all is well ({len(FAST_REGIONS)} backends, 1 model)"
    for region in FAST_REGIONS:
        (head,) = [line for line in lines if line.startswith(f"backend {region.id} ")]
        assert "RTT " in head and "no RTT" not in head
    queues = [line for line in lines if line.startswith("  queue ")]
    assert len(queues) == len(FAST_REGIONS)
    assert all(q.startswith("  queue   precise: the engine's /metrics") for q in queues)
    assert "problems:" not in lines
