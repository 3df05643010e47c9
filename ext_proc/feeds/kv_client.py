"""The async shell around the engines' KV events: one subscriber per backend that has them.

Each subscriber feeds the router's per-engine state (`Router.apply_kv_events`) and tells it
whether the stream is up: a ZMQ socket monitor reports the connection to the engine's
publisher as it opens and drops, so a dead stream is known at once (not from silence: an
idle engine publishes nothing). A gap in the sequence numbers is replayed from the
engine's replay endpoint when it has one (SGLang's ROUTER: `[b"", start_seq]` ->
`[b"", seq, payload]`..., then seq -1), else that backend's state is reset. With a replay
endpoint a (re)started router also replays from the start, so it is warm at once. A
backend added at run time gets its subscriber (`add`); a removed one's is stopped
(`remove`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import Backend, Config, split_host_port
from ext_proc.core.router import Router
from ext_proc.estimate.engine_index import EngineBlocks
from ext_proc.feeds.kv_events import EventBatch, KvEventError, decode_message, subscriber_address

log = logging.getLogger("gorgo.kv_events")

# How long a replay may take before the backend is reset instead.
REPLAY_TIMEOUT_S = 2.0
END_OF_REPLAY = -1
# How often the receive loop looks up from the socket for a catch-up after a reconnect.
RECONNECT_CHECK_S = 0.1
_UP_EVENTS = (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED)


class KvEventClients:
    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self._ctx = zmq.asyncio.Context()
        # Per backend: its subscriber task.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        # Per backend: connected publishers, and whether the state caught up at start.
        self._peers: dict[str, int] = {}
        self._synced: dict[str, bool] = {}
        # Streams that dropped, and those back since (a catch-up replay is due).
        self._dropped: dict[str, bool] = {}
        self._reconnected: set[str] = set()

    async def start(self) -> None:
        for b in self.router.cfg.backends:
            self.add(b)

    def add(self, b: Backend) -> None:
        """Subscribe to a backend's events from now on (nothing if it has none). A
        subscriber it had must have been cancelled and have ended first (`cancel`)."""
        assert b.id not in self._tasks, f"kv events of {b.id}: subscriber running"
        if b.kv_events.endpoint:
            self._tasks[b.id] = asyncio.create_task(self._run(b))

    def cancel(self, backend: str) -> list[asyncio.Task[None]]:
        """Stop a backend's subscriber: cancelled now (it runs no further than its
        cleanup), returned to be awaited."""
        task = self._tasks.pop(backend, None)
        if task is None:
            return []
        task.cancel()
        self._stopping.add(task)  # a reference until it has ended
        task.add_done_callback(self._stopping.discard)
        return [task]

    @property
    def backends(self) -> list[str]:
        return list(self._tasks)

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks.values(), *self._stopping])
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    async def _run(self, b: Backend) -> None:
        host, _ = split_host_port(b.address, "address")
        address, bind = subscriber_address(b.kv_events.endpoint, host)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, b.kv_events.topic)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        monitor = sock.get_monitor_socket(events)
        (sock.bind if bind else sock.connect)(address)
        self._synced[b.id] = not b.kv_events.replay_endpoint
        watch = asyncio.create_task(self._watch(b.id, monitor))
        try:
            if b.kv_events.replay_endpoint:
                # Warm start: what the engine published before this router began (its
                # replay buffer) rebuilds the state; live batches wait in the socket.
                t0 = time.monotonic()
                ok = await self._replay(b, 0)
                log.info(
                    "kv events of %s: %s in %.2f s (%d blocks)",
                    b.id,
                    "replayed from the start" if ok else "no replay: starting cold",
                    time.monotonic() - t0,
                    self._engine(b.id).blocks,
                )
                self._synced[b.id] = True
                self._update(b.id)
            replayed_through = self._engine(b.id).last_seq
            while True:
                if b.id in self._reconnected:
                    # Back after a drop: what was published meanwhile is in the replay
                    # buffer (the next live batch would only show the gap later).
                    self._reconnected.discard(b.id)
                    if b.kv_events.replay_endpoint:
                        engine = self._engine(b.id)
                        start = (engine.last_seq if engine.last_seq is not None else -1) + 1
                        if await self._replay(b, start):
                            replayed_through = engine.last_seq
                    self._synced[b.id] = True
                    self._update(b.id)
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), RECONNECT_CHECK_S)
                except TimeoutError:
                    continue
                try:
                    batch = decode_message(frames)
                except KvEventError as e:
                    log.warning("kv events of %s: %s", b.id, e)
                    continue
                if replayed_through is not None and batch.seq <= replayed_through:
                    continue  # already applied from the replay
                replayed_through = None
                applied = self.router.apply_kv_events(b.id, batch)
                if applied.restarted:
                    log.warning("kv events of %s: sequence went back: engine restarted", b.id)
                if applied.gap:
                    await self._recover(b, batch)
        finally:
            watch.cancel()
            self.router.set_event_stream(b.id, False)
            for per_backend in (self._peers, self._synced, self._dropped):
                per_backend.pop(b.id, None)
            self._reconnected.discard(b.id)
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def _engine(self, backend: str) -> EngineBlocks:
        engine = self.router.backends[backend].engine_blocks
        assert engine is not None  # only backends with kv_events get a subscriber
        return engine

    def _update(self, backend: str) -> None:
        """Precise while the stream is up and the state has caught up with the engine."""
        up = self._peers.get(backend, 0) > 0 and self._synced.get(backend, False)
        if up != self.router.backends[backend].precise:
            log.warning(
                "kv events of %s %s",
                backend,
                "up: precise prefix state" if up else "down: approximate prefix state",
            )
            self.router.set_event_stream(backend, up)

    async def _watch(self, backend: str, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event in _UP_EVENTS:
                self._peers[backend] = self._peers.get(backend, 0) + 1
                if self._dropped.pop(backend, False):
                    self._reconnected.add(backend)
            elif event == zmq.EVENT_DISCONNECTED:
                self._peers[backend] = max(0, self._peers.get(backend, 0) - 1)
                if self._peers[backend] == 0:
                    # Not precise again until what was missed is caught up.
                    self._dropped[backend] = True
                    self._synced[backend] = False
            self._update(backend)

    async def _recover(self, b: Backend, batch: EventBatch) -> None:
        """Events before `batch` were lost: replay them (the replay includes `batch`), or
        reset and start again from `batch`."""
        engine = self._engine(b.id)
        start = (engine.last_seq or 0) + 1
        if b.kv_events.replay_endpoint and await self._replay(b, start):
            log.info("kv events of %s: replayed from seq %d", b.id, start)
            return
        log.warning("kv events of %s: lost events %d-%d: state reset", b.id, start, batch.seq - 1)
        engine.reset()
        self.router.apply_kv_events(b.id, batch)

    async def _replay(self, b: Backend, start_seq: int) -> bool:
        host = split_host_port(b.address, "address")[0]
        parts = urlsplit(b.kv_events.replay_endpoint)
        target = (
            f"tcp://{host}:{parts.port}"
            if parts.hostname in (None, "*")
            else b.kv_events.replay_endpoint
        )
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(target)
        try:
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    _, seq, payload = await sock.recv_multipart()
                    if int.from_bytes(seq, "big", signed=True) == END_OF_REPLAY:
                        return True
                    applied = self.router.apply_kv_events(
                        b.id, decode_message([b.kv_events.topic.encode(), seq, payload])
                    )
                    if applied.gap:  # the replay buffer no longer reaches back that far
                        return False
        except (TimeoutError, ValueError, KvEventError):
            return False
        finally:
            sock.close()
