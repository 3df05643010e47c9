"""The garbage collector's schedule in a long-running router.

At start the service freezes its start-up objects and raises the young generation's
threshold (service/app.py: GC pauses kept off requests' tails). The cost of that: every
ext_proc stream leaves reference cycles (grpc.aio's per-call objects, the receiver's and
the handler's suspended generators) that hold the stream's last messages, and those live
in protobuf's and gRPC's native memory, which neither tracemalloc nor the collector's own
counts see. A cycle is freed only when its generation is collected: the young one about
every 450 requests at the threshold's 20,000 (a request leaves some 45 tracked objects
behind it, not the few hundred assumed), and a stream open at that moment moves to an
older generation, collected ten times less often. The router's memory then grew with the
requests served (`gorgo soak`: 196 -> 248 MB over 30 minutes; docs/reliability.md).

A full collection on a clock bounds it: what one is left holding is at most
FULL_COLLECTION_EVERY_S of streams. With the start-up heap frozen, a full pass scans only
what came after (the decision log, the streams in flight): a few milliseconds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("gorgo.collector")

# A full pass this often: at 5 requests/s, some 50 finished streams' cycles at most,
# against the ~450 (and the older generations' many more) the thresholds alone leave.
FULL_COLLECTION_EVERY_S = 10.0


class Collector:
    """Runs full collections every `every_s` seconds (on the event loop: a pass must not
    race the loop's objects), counting them and the time they took."""

    def __init__(self, every_s: float = FULL_COLLECTION_EVERY_S) -> None:
        if not every_s > 0:
            raise ValueError(f"collector: every_s must be > 0 seconds, got {every_s!r}")
        self.every_s = every_s
        self.passes = 0
        self.freed = 0
        self.last_pass_ms = 0.0

    def collect(self) -> int:
        start = time.perf_counter()
        freed = gc.collect()
        self.last_pass_ms = (time.perf_counter() - start) * 1e3
        self.passes += 1
        self.freed += freed
        return freed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            freed = self.collect()
            log.debug("full collection: %d objects freed in %.1f ms", freed, self.last_pass_ms)
