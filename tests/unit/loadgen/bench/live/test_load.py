"""`gorgo bench load`'s readings of a process (psutil): CPU seconds as the kernel counts
them (user + system, all threads) and the resident set, of this very process."""

import os

from loadgen.bench.live.load import _proc_rss_mb, proc_cpu_s

MIB = 2**20


def test_cpu_seconds_are_the_kernels_user_plus_system_and_grow_with_work() -> None:
    before = proc_cpu_s(os.getpid())
    t = os.times()
    assert before > 0
    # the same count os.times() reads (clock ticks: 10 ms apart at most)
    assert abs(before - (t.user + t.system)) < 0.05
    x = 0
    while proc_cpu_s(os.getpid()) < before + 0.2:  # busy: the reading must move
        x += sum(range(10_000))
    assert x > 0


def test_the_resident_set_is_positive_and_grows_with_touched_memory() -> None:
    before = _proc_rss_mb(os.getpid())
    block = bytearray(64 * MIB)  # zeroed by the allocator: its pages are touched
    for i in range(0, len(block), 4096):
        block[i] = 1
    after = _proc_rss_mb(os.getpid())
    assert before > 1 and after - before > 48  # MiB, whatever the allocator kept before
    del block
