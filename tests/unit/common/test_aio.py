"""cancel_and_wait ends every task, even one whose first cancel was lost."""

import asyncio
import contextlib
import time

import pytest

from ext_proc.common.aio import RECANCEL_S, cancel_and_wait


async def test_a_task_that_swallowed_a_cancel_is_cancelled_again() -> None:
    async def stubborn() -> None:
        # what aiohttp does when a cancel meets its timeout: the CancelledError becomes a
        # TimeoutError, which the task handles
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        await asyncio.sleep(30)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    start = time.monotonic()
    await cancel_and_wait([task])
    assert task.cancelled()
    assert time.monotonic() - start < RECANCEL_S + 0.5


async def test_an_error_a_task_ended_with_is_raised() -> None:
    async def broken() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait([task])
