"""The async shell around the engines' KV events: one subscriber per backend that has them.

Each subscriber feeds the router's per-engine state (`Router.apply_kv_events`) and tells it
whether the stream is up: a ZMQ socket monitor reports the connection to the engine's
publisher as it opens and drops, so a dead stream is known at once (not from silence: an
idle engine publishes nothing). A gap in the sequence numbers is replayed from the
engine's replay endpoint when it has one (SGLang's ROUTER: `[b"", start_seq]` ->
`[b"", seq, payload]`..., then seq -1), else that backend's state is reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ext_proc.config import Backend, Config, split_host_port
from ext_proc.kv_events import EventBatch, KvEventError, decode_message, subscriber_address
from ext_proc.router import Router

log = logging.getLogger("gorgo.kv_events")

# How long a replay may take before the backend is reset instead.
REPLAY_TIMEOUT_S = 2.0
END_OF_REPLAY = -1
_UP_EVENTS = (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED)


class KvEventClients:
    def __init__(self, cfg: Config, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for b in self.cfg.backends:
            if b.kv_events.endpoint:
                self._tasks.append(asyncio.create_task(self._run(b)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._ctx.destroy(linger=0)

    async def _run(self, b: Backend) -> None:
        host, _ = split_host_port(b.address, "address")
        address, bind = subscriber_address(b.kv_events.endpoint, host)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, b.kv_events.topic)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        (sock.bind if bind else sock.connect)(address)
        watch = asyncio.create_task(self._watch(b.id, monitor))
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_message(frames)
                except KvEventError as e:
                    log.warning("kv events of %s: %s", b.id, e)
                    continue
                applied = self.router.apply_kv_events(b.id, batch)
                if applied.restarted:
                    log.warning("kv events of %s: sequence went back: engine restarted", b.id)
                if applied.gap:
                    await self._recover(b, batch)
        finally:
            watch.cancel()
            self.router.set_event_stream(b.id, False)
            sock.disable_monitor()
            monitor.close()
            sock.close()

    async def _watch(self, backend: str, monitor: zmq.asyncio.Socket) -> None:
        peers = 0
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event in _UP_EVENTS:
                peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                peers = max(0, peers - 1)
            up = peers > 0
            if up != (backend in self.router.precise):
                log.warning(
                    "kv events of %s %s",
                    backend,
                    "up: precise prefix state" if up else "down: approximate prefix state",
                )
                self.router.set_event_stream(backend, up)

    async def _recover(self, b: Backend, batch: EventBatch) -> None:
        """Events before `batch` were lost: replay them (the replay includes `batch`), or
        reset and start again from `batch`."""
        engine = self.router.engine_blocks[b.id]
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
