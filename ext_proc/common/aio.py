"""Small asyncio helpers of the shell."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

# A cancel can be lost: aiohttp times a request out by cancelling its task and turning that
# CancelledError into a TimeoutError, so a cancel arriving as the timer fires becomes a
# timeout the task handles and lives on. Tasks still running this long after a cancel get
# another.
RECANCEL_S = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until each has ended (an error one of them ended with
    is raised)."""
    every = list(tasks)
    pending = set(every)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in every:
        if not t.cancelled() and (error := t.exception()) is not None:
            raise error
