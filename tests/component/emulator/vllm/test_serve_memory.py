"""The real-vLLM engine's process tree as emulator/vllm/serve.py reads it (psutil): the
processes of its group, their RSS and PSS summed, none once the group is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from emulator.vllm.serve import tree_memory_kib, tree_pids

pytestmark = pytest.mark.component

# A parent and a forked child, each holding 32 MiB of its own (touched) memory.
HOLDER = (
    "import os, sys, time\n"
    "os.fork()\n"
    "block = bytearray(32 * 2**20)\n"
    "block[::4096] = b'x' * len(block[::4096])\n"
    "os.write(1, b'up\\n')\n"  # one write each: the two lines never interleave
    "time.sleep(60)\n"
)


def test_the_group_s_processes_and_their_memory_then_none() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"up\n" and proc.stdout.readline() == b"up\n"
        pids = tree_pids(proc.pid)
        assert len(pids) == 2 and proc.pid in pids and os.getpid() not in pids
        mem = tree_memory_kib(proc.pid)
        assert mem["processes"] == 2
        # 2 x 32 MiB touched, each process's own: in both RSS and PSS (PSS splits only
        # the pages the two share: the interpreter's)
        assert mem["rss"] >= 64 * 1024 and 64 * 1024 <= mem["pss"] <= mem["rss"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    while tree_pids(proc.pid) and time.monotonic() < deadline:  # the orphan: init reaps it
        time.sleep(0.02)
    assert tree_pids(proc.pid) == [] and tree_memory_kib(proc.pid)["processes"] == 0
