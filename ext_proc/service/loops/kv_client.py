"""The async shell around the engines' KV events: per backend that has them, one supervised
subscriber per DP rank's publisher (`kv_stream.RankStream`), all feeding that backend's
per-engine state (`Router.apply_kv_events`).

A backend is precise while every one of its ranks' streams is up (a ZMTP handshake done,
heartbeats answered) and caught up; otherwise the router's own estimate serves it. A gap
in a rank's sequence numbers is replayed from that rank's replay endpoint when it has one
(SGLang's ROUTER: `[b"", start_seq]` -> `[b"", seq, payload]`..., then seq -1), else the
backend's state is reset. With a replay endpoint a (re)started router also replays from
the start, so it is warm at once. A subscriber that fails (a bind refused, anything
unexpected) is logged in one line, counted and restarted with capped exponential backoff;
`snapshot` shows the counts. A backend added at run time gets its subscribers (`add`); a
removed one's are stopped (`cancel`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.service.loops.kv_stream import RankStream
from ext_proc.vocab.backend import Backend

log = logging.getLogger("gorgo.kv_events")

# Restart backoff of a failed subscriber: from 0.1 s, doubling, at most 5 s (a bind that
# keeps failing costs one log line per 5 s); back to 0.1 s after a run of 30 s.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
BACKOFF_RESET_S = 30.0
# Errors that do not stop a subscriber (an undecodable message) are all counted but
# logged at most once per this interval per backend (a stream of garbage would flood).
REPORT_INTERVAL_S = 10.0


@dataclass
class _Subscribers:
    """One backend's subscribers and what went wrong with them."""

    streams: list[RankStream]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    errors: int = 0
    restarts: int = 0
    last_error: str = ""
    last_error_at: float | None = None
    last_logged_at: float | None = None


def describe(e: BaseException, s: RankStream) -> str:
    """An error as one line, with the fix where there is one."""
    if isinstance(e, zmq.ZMQError) and s.bind and e.errno == zmq.EADDRINUSE:
        return (
            f"cannot bind {s.address}: address in use. With kv_events.mode bind the engine "
            "connects to this address and exactly one router can bind it (another router or "
            "process holds it): give the engine tcp://*:PORT to bind and every router mode "
            "connect with the engine's tcp://HOST:PORT"
        )
    if isinstance(e, zmq.ZMQError) and s.bind and e.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot bind {s.address}: not an address of this host. With kv_events.mode "
            "bind the endpoint is the router's own address (the engine connects to it); to "
            "reach the engine's address, use mode connect"
        )
    return f"{type(e).__name__}: {e}"


class KvEventClients:
    """The KV-event subscribers of every backend that publishes events (a `Feed`)."""

    name = "kv_event_subscribers"

    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self._ctx = zmq.asyncio.Context()
        self._subs: dict[str, _Subscribers] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for b in self.router.cfg.backends:
            self.add(b)

    def add(self, b: Backend) -> None:
        """Subscribe to a backend's events from now on (nothing if it has none). A
        subscriber it had must have been cancelled and have ended first (`cancel`)."""
        assert b.id not in self._subs, f"kv events of {b.id}: subscriber running"
        if not b.kv_events.endpoint:
            return
        subs = _Subscribers([])
        self._subs[b.id] = subs
        for rank in range(b.kv_events.dp_ranks):
            stream = RankStream(
                self._ctx,
                self.router,
                b,
                rank,
                lambda: self._update(b.id),
                lambda text: self._report(b.id, text),
            )
            subs.streams.append(stream)
            subs.tasks.append(asyncio.create_task(self._supervise(subs, stream)))

    def cancel(self, backend: str) -> list[asyncio.Task[None]]:
        """Stop a backend's subscribers: cancelled now (they run no further than their
        cleanup), returned to be awaited."""
        subs = self._subs.pop(backend, None)
        if subs is None:
            return []
        for task in subs.tasks:
            task.cancel()
            self._stopping.add(task)  # a reference until it has ended
            task.add_done_callback(self._stopping.discard)
        return list(subs.tasks)

    @property
    def backends(self) -> list[str]:
        return list(self._subs)

    async def stop(self) -> None:
        await cancel_and_wait([*(t for s in self._subs.values() for t in s.tasks), *self._stopping])
        self._subs.clear()
        self._ctx.destroy(linger=0)

    def snapshot(self, backend: str) -> dict[str, Any] | None:
        """A backend's subscribers for /state (None: it has no KV events)."""
        subs = self._subs.get(backend)
        if subs is None:
            return None
        at = subs.last_error_at
        return {
            "dp_ranks": len(subs.streams),
            "ranks_up": sum(s.precise for s in subs.streams),
            "errors": subs.errors,
            "restarts": subs.restarts,
            "skipped_events": sum(s.skipped_events for s in subs.streams),
            "last_error": subs.last_error or None,
            "last_error_age_s": None if at is None else round(time.monotonic() - at, 1),
        }

    async def _supervise(self, subs: _Subscribers, stream: RankStream) -> None:
        """Run one rank's subscriber; whatever stops it is logged, counted, and it is
        started again after a backoff."""
        delay_s = BACKOFF_MIN_S
        while True:
            started = time.monotonic()
            try:
                await stream.run()
                error = "the subscriber ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error = describe(e, stream)
                log.debug("kv events of %s: subscriber failed", stream.backend, exc_info=True)
            if time.monotonic() - started >= BACKOFF_RESET_S:
                delay_s = BACKOFF_MIN_S
            self._count(subs, error)
            log.warning(
                "kv events of %s, DP rank %d: %s (restart in %.1f s)",
                stream.backend,
                stream.rank,
                error,
                delay_s,
            )
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, BACKOFF_MAX_S)
            subs.restarts += 1

    def _count(self, subs: _Subscribers, error: str) -> None:
        subs.errors += 1
        subs.last_error = error
        subs.last_error_at = time.monotonic()

    def _report(self, backend: str, text: str) -> None:
        """An error the subscriber lives through."""
        subs = self._subs.get(backend)
        if subs is None:
            return
        self._count(subs, text)
        now = time.monotonic()
        if subs.last_logged_at is None or now - subs.last_logged_at >= REPORT_INTERVAL_S:
            subs.last_logged_at = now
            log.warning("kv events of %s: %s (%d errors so far)", backend, text, subs.errors)

    def _update(self, backend: str) -> None:
        """The stream is up while every rank's is up and caught up with its engine (the
        backend is precise then if its token ids are the engine's too)."""
        subs = self._subs.get(backend)
        up = subs is not None and all(s.precise for s in subs.streams)
        b = self.router.backends.get(backend)
        if b is not None and up != b.engine.events_up:
            log.warning(
                "kv events of %s %s",
                backend,
                "up: the engine's own prefix state" if up else "down: approximate prefix state",
            )
            self.router.inputs.set_event_stream(backend, up)
