"""Config reloads: on SIGHUP and when the file changes, the fleet is reconciled and the
live keys applied; the other keys need a restart (shown on /state).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.dump import changed_keys
from ext_proc.config.load import read_config
from ext_proc.core.fleet import FleetConflict
from ext_proc.core.router import Router
from ext_proc.service.last_good import LAST_GOOD, ConfigSource
from ext_proc.service.telemetry.listener import Telemetry
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import ConfigError

log = logging.getLogger("gorgo")


# The config file is looked at this often (its size, mtime and inode; its hash only when
# they change): a change is applied within about a second, for one stat() a second.
RELOAD_POLL_S = 1.0


class ConfigReloader:
    """Reloads the config file on SIGHUP (`request`) and when it changes (`watch`: its
    stat about once a second, its hash when that moved). The whole file is loaded and
    validated by `load_config`; invalid, it is refused with the loader's message (naming
    the key), logged, shown in /state and counted, and the running config stays. Valid,
    the router's fleet becomes the file's (`Router.reconcile`), the keys read live are
    applied (`Router.apply_live_keys`), and a warning names any other key that changed:
    those need a restart. An accepted file becomes the last good config (`source`)."""

    def __init__(
        self,
        path: str | Path,
        router: Router,
        telemetry: Telemetry,
        source: ConfigSource | None = None,
        discovered: Callable[[], Sequence[Backend]] = tuple,
    ) -> None:
        self.path = Path(path)
        # The backends discovery found (kept beside the file's through a reload).
        self.discovered = discovered
        self.router = router
        self.telemetry = telemetry
        self.source = source or ConfigSource(str(path))
        self._seen = self._stat()
        self._digest = self._hash()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.reloads = self.failures = 0
        self.last_trigger = ""
        self.last_ok_at_s: float | None = None
        self.last_error = ""
        self.last_error_at_s: float | None = None
        self.restart_required: list[str] = []

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _hash(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        await cancel_and_wait([t for t in (self._watcher,) if t is not None])
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def request(self, trigger: str = "SIGHUP") -> None:
        """Reload soon (from a signal handler: the reload runs as a task)."""
        task = asyncio.get_running_loop().create_task(self.reload(trigger))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            seen = self._stat()
            if seen == self._seen:
                continue
            self._seen = seen
            digest = self._hash()
            if digest is None or digest == self._digest:
                continue  # touched, or being replaced: nothing new to read yet
            await self.reload("file changed")

    async def reload(self, trigger: str) -> bool:
        """Load, validate and apply the file; False if it was refused."""
        async with self._lock:
            self._seen, self._digest = self._stat(), self._hash()
            self.last_trigger = trigger
            try:
                # Off the event loop: a configured tokenizer is loaded to validate it.
                new, text = await asyncio.to_thread(read_config, self.path)
                changes = self.router.fleet.reconcile(
                    [*new.backends, *self.discovered()], "reload", not new.discovery.enabled
                )
            except Exception as e:  # ConfigError names the key; anything else: still refused
                if not isinstance(e, ConfigError | FleetConflict):
                    log.exception("config reload (%s) failed", trigger)
                self.failures += 1
                self.last_error, self.last_error_at_s = str(e), time.time()
                self.telemetry.metrics.reloads.labels("error").inc()
                if self.source.source == LAST_GOOD:
                    self.source.error = str(e)  # still not the file's config that runs
                log.error("config reload (%s) refused, the running config stays: %s", trigger, e)
                return False
            live = self.router.fleet.apply_live_keys(new)
            self.restart_required = changed_keys(self.router.cfg, new)
            self.source.running(text)
            self.reloads += 1
            self.last_ok_at_s = time.time()
            self.telemetry.metrics.reloads.labels("ok").inc()
            log.info(
                "config reload (%s): backends added %s, back %s, updated %s, draining %s; "
                "applied live: %s",
                trigger,
                list(changes.added),
                list(changes.reactivated),
                list(changes.updated),
                list(changes.draining),
                live or "nothing else",
            )
            if self.restart_required:
                log.warning(
                    "config reload (%s): %s changed: restart to apply",
                    trigger,
                    ", ".join(self.restart_required),
                )
            return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "reloads": self.reloads,
            "failures": self.failures,
            "last_trigger": self.last_trigger or None,
            "last_ok_at_s": self.last_ok_at_s,
            # The last refusal (the loader's message, naming the key) and when (Unix s).
            "last_error": self.last_error or None,
            "last_error_at_s": self.last_error_at_s,
            # Keys the file changed that only a restart applies.
            "restart_required": self.restart_required,
        }
