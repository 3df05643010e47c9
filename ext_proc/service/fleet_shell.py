"""The fleet's shell: it hears each backend change of the router and starts or stops that
backend in every feed (probes, metrics, models, KV events: `vocab.feeds.Feed`), rewrites
Envoy's xDS files, and activates a pending backend once Envoy can route to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from ext_proc.common.aio import cancel_and_wait
from ext_proc.core.router import Router
from ext_proc.envoy.server import ExtProcService
from ext_proc.envoy_config.xds import wait_envoy, write_xds
from ext_proc.vocab.events import BackendChanged, Listener
from ext_proc.vocab.feeds import Feed
from ext_proc.vocab.types import BackendChange, BackendLifecycle

log = logging.getLogger("gorgo")


# A backend added at run time is a candidate once Envoy can route to it (with
# envoy.xds_dir): Envoy applies a rewritten file within ~10-50 ms (measured here), so 5 s
# means it is not reading the files; the backend then stays pending, retried this often.
ENVOY_WAIT_S = 5.0
PENDING_RETRY_S = 5.0
_PENDING = BackendLifecycle.PENDING


class FleetShell(Listener):
    """The shell's side of a fleet change (`BackendChanged`): a removed backend's tasks in
    every feed (probes, metrics scrape, KV-event subscriber) stop at once (cancelled
    before the router's next step, so none of them touches a backend that is gone); one
    worker task then, in
    order, awaits them, starts a new backend's tasks, and tells Envoy: `write_xds` with
    the pending, active and draining backends (once per burst of changes), and for a
    pending backend `wait_envoy` before the router may name it."""

    def __init__(self, router: Router, feeds: Sequence[Feed], ext_proc: ExtProcService) -> None:
        self.router = router
        # Every loop that reads the fleet per backend (vocab.feeds.Feed), driven alike.
        self.feeds = list(feeds)
        self.ext_proc = ext_proc
        # (the change, tasks to await); None: look at the pending backends again.
        self._queue: asyncio.Queue[tuple[BackendChanged | None, list[asyncio.Task[None]]]] = (
            asyncio.Queue()
        )
        self._worker: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self.xds_writes = 0
        self.xds_error = ""

    def on_backend(self, e: BackendChanged) -> None:
        tasks: list[asyncio.Task[None]] = []
        if e.change == BackendChange.REMOVED or (e.change == BackendChange.UPDATED and e.reset):
            tasks = self._cancel(e.backend)
        log.info(
            "backend %s %s (%s)%s",
            e.backend,
            e.change,
            e.reason,
            ": the router forgets what it knew of its engine" if e.reset else "",
        )
        self._queue.put_nowait((e, tasks))

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._worker is not None:
            await cancel_and_wait([self._worker])

    async def settle(self) -> None:
        """Until every change so far has been applied (and Envoy told)."""
        await self._queue.join()

    def snapshot(self) -> dict[str, Any]:
        return {
            "xds_writes": self.xds_writes,
            "xds_error": self.xds_error or None,
            **{f.name: f.backends for f in self.feeds},
        }

    async def _run(self) -> None:
        while True:
            e, tasks = await self._queue.get()
            try:
                try:
                    await cancel_and_wait(tasks)
                except Exception:  # a task that had crashed: its error is old news
                    log.exception("a stopped backend task had failed")
                if e is not None:
                    await self._apply(e)
                if self._queue.empty():
                    await self._tell_envoy()
            except Exception:  # never let one change stop the ones after it
                log.exception("applying a fleet change failed")
            finally:
                self._queue.task_done()

    async def _apply(self, e: BackendChanged) -> None:
        record = self.router.backends.get(e.backend)
        config = None if record is None else record.config
        starts = e.change == BackendChange.ADDED or (e.change == BackendChange.UPDATED and e.reset)
        if starts and config is not None:  # (not removed again meanwhile)
            await cancel_and_wait(self._cancel(e.backend))
            for feed in self.feeds:
                feed.add(config)
        self.ext_proc.encoder.set_backends(self.router.cfg.backends)

    def _cancel(self, backend: str) -> list[asyncio.Task[None]]:
        return [task for feed in self.feeds for task in feed.cancel(backend)]

    async def _tell_envoy(self) -> None:
        try:  # off the loop: the files grow with the fleet (snapshots: cfg, draining)
            await asyncio.to_thread(write_xds, self.router.cfg, self.router.fleet.draining)
            self.xds_writes += 1
            self.xds_error = ""
        except OSError as err:
            self.xds_error = f"envoy.xds_dir: {err}"
            log.error("cannot write Envoy's xDS files (%s): retrying", self.xds_error)
            self._retry_later()
            return
        pending = [b for b, st in self.router.backends.items() if st.lifecycle is _PENDING]
        if not pending:
            return
        missing = await wait_envoy(self.router.cfg, self.router.fleet.draining, ENVOY_WAIT_S)
        for b in pending:
            if b not in missing:
                self.router.fleet.activate(b)
        still = [b for b in pending if b in missing and b in self.router.backends]
        if still:
            log.error(
                "Envoy shows no route to %s %.0f s after its xDS files were written: "
                "pending (no decisions) and retried every %.0f s",
                ", ".join(still),
                ENVOY_WAIT_S,
                PENDING_RETRY_S,
            )
            self._retry_later()

    def _retry_later(self) -> None:
        if self._retry is None or self._retry.cancelled() or self._retry.when() < time.monotonic():
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(PENDING_RETRY_S, self._queue.put_nowait, (None, []))
