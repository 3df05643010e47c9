"""The collector's clock: reference cycles are freed within its interval even when the
automatic collector would not run (the service raises its threshold and freezes its
start-up heap), and a dropped cycle is otherwise kept."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from ext_proc.service.collector import Collector


class _Pinned:
    """Stands for a stream's cycle: it holds a buffer, and a reference to itself."""

    def __init__(self) -> None:
        self.buffer = bytearray(256 * 1024)
        self.me = self


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _dropped_cycles(n: int) -> list[weakref.ref[_Pinned]]:
    return [weakref.ref(_Pinned()) for _ in range(n)]


def _alive(refs: list[weakref.ref[_Pinned]]) -> int:
    return sum(r() is not None for r in refs)


@pytest.mark.usefixtures("no_automatic_collection")
def test_a_dropped_cycle_is_kept_until_a_collection() -> None:
    refs = _dropped_cycles(8)
    assert _alive(refs) == 8  # what the router saw: garbage that holds memory
    freed = Collector(every_s=1.0).collect()
    assert _alive(refs) == 0
    assert freed >= 8


@pytest.mark.usefixtures("no_automatic_collection")
def test_the_loop_frees_cycles_within_its_interval() -> None:
    collector = Collector(every_s=0.05)

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(collector.run())
        try:
            refs = _dropped_cycles(16)
            before = _alive(refs)
            await asyncio.sleep(0.05 * 3)  # the bound: one interval (and scheduling slack)
            return before, _alive(refs)
        finally:
            task.cancel()

    before, after = asyncio.run(scenario())
    assert (before, after) == (16, 0)
    assert collector.passes >= 1
    assert collector.freed >= 16
    assert collector.last_pass_ms >= 0.0


@pytest.mark.parametrize("every_s", [0.0, -1.0, float("nan")])
def test_a_bad_interval_is_refused(every_s: float) -> None:
    with pytest.raises(ValueError, match="every_s"):
        Collector(every_s=every_s)
