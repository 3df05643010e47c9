"""Progress of the runs longer than a few seconds (replay, simulate, the bench matrices),
drawn by tqdm on stderr when it is a terminal and not at all otherwise: a CI log gets
neither carriage returns nor escape codes, only the lines `say` prints.

    with bar(len(cells), "bench target", unit="run") as cells_done:
        for cell in cells:
            ...
            say(f"{cell}: p95 TTFT ...")  # a line of its own, the bar redrawn under it
            cells_done.update()
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Never, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

# A refresh a user can follow that costs nothing next to what it reports on.
REFRESH_S = 0.5


def bar(
    total: float | None,
    desc: str,
    unit: str = "run",
    *,
    leave: bool = True,
    file: TextIO | None = None,
) -> tqdm[Never]:
    """A bar on `file` (stderr), drawn only when that is a terminal (tqdm's disable=None);
    `total` None: a count without an end. leave=False: gone once done (an inner bar)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, **_drawn(file))


def tracked(items: Iterable[T], total: int, desc: str, unit: str = "run") -> tqdm[T]:
    """`items` as they come (a pool's results, say), counted on a bar of `total`."""
    return tqdm(items, total=total, desc=desc, unit=unit, **_drawn(None))


def _drawn(file: TextIO | None) -> dict[str, Any]:
    return {
        "file": file if file is not None else sys.stderr,
        "disable": None,  # drawn only on a terminal
        "dynamic_ncols": True,
        "mininterval": REFRESH_S,
    }


def say(text: str, file: TextIO | None = None) -> None:
    """A line on stderr (always), written between the bars' redraws on a terminal."""
    tqdm.write(text, file=file if file is not None else sys.stderr)


def counter(progress: tqdm[Never]) -> Callable[[int, int], None]:
    """A callback that moves `progress` to (done so far, of a total)."""

    def to(done: int, total: int) -> None:
        if progress.total != total:
            progress.total = total
        progress.update(done - progress.n)

    return to


@contextlib.contextmanager
def timed(duration_s: float, desc: str, file: TextIO | None = None) -> Iterator[tqdm[Never]]:
    """A bar over a phase that lasts `duration_s` (seconds, as they pass), for the live
    benches' timed phases; it runs on a thread, so around asyncio.run as well as inside."""
    total = round(duration_s)
    seconds = bar(total, desc, unit="s", leave=False, file=file)
    stop = threading.Event()

    t0 = time.monotonic()

    def passed() -> None:
        seconds.update(min(total, int(time.monotonic() - t0)) - seconds.n)

    def tick() -> None:
        while not stop.wait(REFRESH_S):
            passed()

    ticker = threading.Thread(target=tick, name="gorgo-progress", daemon=True)
    if not seconds.disable:
        ticker.start()
    try:
        yield seconds
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()
            passed()
            seconds.refresh()  # where the phase ended, before the bar goes
        seconds.close()
