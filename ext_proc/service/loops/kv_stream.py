"""One subscriber of one engine publisher (a backend's DP rank): its ZMQ SUB socket, the
socket monitor that says whether the stream is up, the receive loop and the replays.

Up means a ZMTP handshake completed (a TCP connect alone is not a stream: a WAN link that
black-holes traffic still accepts connections). ZMTP heartbeats notice a link that drops
without a FIN in a few seconds (a PUB answers PINGs by itself, libzmq >= 4.2); TCP
keepalive backs them up. A long batch (SGLang page size 1: one event a token) is applied a
part at a time, yielding to the event loop between parts, so routing decisions do not wait
for it. Errors are the caller's (`KvEventClients` supervises and restarts); an undecodable
message is reported and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.kv_endpoints import connect_address, subscriber_address
from ext_proc.core.router import Router
from ext_proc.estimate.engine_index import Applied, EngineBlocks
from ext_proc.feeds.kv_events import (
    PART_EVENTS,
    EventBatch,
    KvEventError,
    decode_parts,
    offset_port,
)
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import split_host_port

log = logging.getLogger("gorgo.kv_events")

# A replay endpoint that has not answered for this long is given up on (reset instead).
REPLAY_TIMEOUT_S = 2.0
END_OF_REPLAY = -1
# How often the receive loop looks up from the socket (a catch-up after a reconnect).
RECONNECT_CHECK_S = 0.1
# ZMTP heartbeats: a PING a second; a connection silent for 3 s (no PONG, no data) is
# closed, so a half-open WAN link turns the backend approximate in ~3-4 s (RTTs here are
# at most ~0.5 s). The publisher drops us after the same silence (TTL).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
HEARTBEAT_TTL_MS = 3000
# A connection whose handshake has not completed in this time is dropped and retried.
HANDSHAKE_IVL_MS = 5000
# TCP keepalive under the heartbeats: probes after 5 s idle, every 2 s, 3 unanswered.
TCP_KEEPALIVE_IDLE_S = 5
TCP_KEEPALIVE_INTVL_S = 2
TCP_KEEPALIVE_CNT = 3
# Batches queued in our socket: the engines' own send HWM (100,000 in both engines'
# kv_events.py), so a busy moment here does not drop batches the engine sent.
RCVHWM = 100_000
# Idle time per busy time between the steps of a long batch (1: at most half the CPU),
# after a step of at least this long (a part is ~0.5 ms; a small batch's whole ~0.05 ms).
PAUSE_PER_BUSY = 1.0
PAUSE_AFTER_S = 0.0002
_MONITORED = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
)


async def _breathe(started: float) -> float:
    """Between two steps of a batch: the event loop runs what else is ready and, after a
    long step, the process idles as long as it took. A router CPU-bound for a whole burst
    (~0.3 s) loses its place to the machine's other processes, and a decision arriving
    then waits for a time slice; at half duty it keeps its place (bench kv-burst: the
    burst's p50 cost 1.0-1.1 ms without, none with). Short steps (small batches, a
    replay's thousands) go on at once."""
    busy_s = time.perf_counter() - started
    await asyncio.sleep(busy_s * PAUSE_PER_BUSY if busy_s >= PAUSE_AFTER_S else 0)
    return time.perf_counter()


def subscriber_socket(ctx: zmq.asyncio.Context, topic: str) -> zmq.asyncio.Socket:
    """A SUB socket for an engine's publisher, with the subscriber's options (heartbeats,
    handshake interval, keepalive, queue), subscribed to `topic`; not yet connected."""
    sock = ctx.socket(zmq.SUB)
    options: list[tuple[int, Any]] = [
        (zmq.LINGER, 0),
        (zmq.RCVHWM, RCVHWM),
        (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
        (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        (zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS),
        (zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS),
        (zmq.TCP_KEEPALIVE, 1),
        (zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S),
        (zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S),
        (zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT),
    ]
    for option, value in options:
        sock.setsockopt(option, value)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    return sock


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends an engine's replay ROUTER: its batches from `start_seq` on."""
    return [b"", start_seq.to_bytes(8, "big", signed=True)]


class RankStream:
    """The stream of one DP rank of one backend's engine."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        router: Router,
        b: Backend,
        rank: int,
        changed: Callable[[], None],
        report: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self.router = router
        self.backend = b.id
        self.rank = rank
        self.host = split_host_port(b.address, "address")[0]
        endpoint = offset_port(b.kv_events.endpoint, rank)
        self.address, self.bind = subscriber_address(endpoint, b.kv_events.mode, self.host)
        self.topic = b.kv_events.topic
        self.replay_endpoint = b.kv_events.replay_endpoint
        self._changed = changed  # up or synced changed
        self._report = report  # a message or replay that failed, not fatal
        # Connections by file descriptor: TCP up, and handshaken (the stream is up).
        self._connecting: list[int] = []
        self._handshaken: list[int] = []
        self.synced = False
        self._dropped = False
        self._reconnected = False
        # Per payload DP rank: the (seq, ts) of the last batch a replay applied; live
        # batches up to it are already applied (they were queued during the replay).
        self._replayed: dict[int | None, tuple[int, float]] = {}
        self.skipped_events = 0

    @property
    def up(self) -> bool:
        return bool(self._handshaken)

    @property
    def precise(self) -> bool:
        return self.up and self.synced

    def _engine(self) -> EngineBlocks:
        engine = self.router.backends[self.backend].engine.blocks
        assert engine is not None  # only backends with kv_events get a subscriber
        return engine

    async def run(self) -> None:
        """Subscribe and apply until cancelled; raises what it cannot handle."""
        sock = subscriber_socket(self._ctx, self.topic)
        monitor = sock.get_monitor_socket(_MONITORED)
        watch: asyncio.Task[None] | None = None
        try:
            (sock.bind if self.bind else sock.connect)(self.address)
            watch = asyncio.create_task(self._watch(monitor))
            await self._receive(sock, watch)
        finally:
            if watch is not None:
                await cancel_and_wait([watch])
            self._connecting.clear()
            self._handshaken.clear()
            self.synced = self._dropped = self._reconnected = False
            self._changed()
            sock.disable_monitor()
            monitor.close()
            sock.close()

    async def _receive(self, sock: zmq.asyncio.Socket, watch: asyncio.Task[None]) -> None:
        if self.replay_endpoint:
            # Warm start: what the engine published before (its replay buffer) rebuilds
            # the state, or catches up after a restart of this subscriber; live batches
            # wait in the socket meanwhile.
            start = self._engine().last_seq_of(self.rank)
            ok = await self._replay(self.rank, 0 if start is None else start + 1)
            log.info(
                "kv events of %s, DP rank %d: %s (%d blocks)",
                self.backend,
                self.rank,
                "replayed" if ok else "no replay: starting cold",
                self._engine().blocks,
            )
        self.synced = True
        self._changed()
        while True:
            if watch.done():
                watch.result()  # the monitor failed: raise its error
            if self._reconnected:
                # Back after a drop: what was published meanwhile is in the replay
                # buffer (the next live batch would only show the gap later).
                self._reconnected = False
                if self.replay_endpoint:
                    start = self._engine().last_seq_of(self.rank)
                    await self._replay(self.rank, 0 if start is None else start + 1)
                self.synced = True
                self._changed()
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), RECONNECT_CHECK_S)
            except TimeoutError:
                continue
            try:
                done = await self._apply(frames, live=True)
            except KvEventError as e:
                self._report(f"undecodable message from {self.address}: {e}")
                continue
            if done is not None and done[1].gap:
                await self._recover(done[0], frames)

    async def _apply(self, frames: list[bytes], live: bool) -> tuple[EventBatch, Applied] | None:
        """Apply one message a part at a time, yielding to the event loop between parts.
        None: a live batch a replay applied already. A gap stops at part 0 (not applied)."""
        head: EventBatch | None = None
        applied = Applied()
        started = time.perf_counter()
        for step in decode_parts(frames, PART_EVENTS, self.rank):
            if step is None:
                started = await _breathe(started)
                continue
            if step.part == 0:
                head = step
                if live and self._already_replayed(step):
                    return None
                applied = self.router.inputs.apply_kv_events(self.backend, step)
                if applied.gap:
                    return step, applied
                if applied.restarted:
                    log.warning(
                        "kv events of %s, DP rank %s: sequence went back: engine restarted",
                        self.backend,
                        step.dp_rank,
                    )
            else:
                self.router.inputs.apply_kv_events(self.backend, step)
            self.skipped_events += step.skipped
            started = await _breathe(started)
        assert head is not None  # decode_parts yields part 0 at least
        return head, applied

    def _already_replayed(self, batch: EventBatch) -> bool:
        mark = self._replayed.get(batch.dp_rank)
        if mark is None:
            return False
        # A batch the replay applied is here again, identical; an older sequence number
        # with a later timestamp is a restarted engine's.
        if batch.seq <= mark[0] and batch.ts <= mark[1]:
            return True
        del self._replayed[batch.dp_rank]
        return False

    async def _recover(self, batch: EventBatch, frames: list[bytes]) -> None:
        """Events before `batch` were lost: replay them (the replay includes `batch` and
        whatever came after it), or reset and start again from `batch`."""
        engine = self._engine()
        before = engine.last_seq_of(batch.dp_rank)
        start = 0 if before is None else before + 1
        if self.replay_endpoint and await self._replay(batch.dp_rank, start):
            log.info("kv events of %s: replayed from seq %d", self.backend, start)
            return
        log.warning(
            "kv events of %s, DP rank %s: lost events %d-%d: state reset",
            self.backend,
            batch.dp_rank,
            start,
            batch.seq - 1,
        )
        engine.reset(batch.dp_rank)  # that rank's blocks: the others' are still right
        await self._apply(frames, live=False)

    def _replay_target(self, rank: int | None) -> str:
        # the engine's ROUTER binds in either mode: always a connect
        return connect_address(offset_port(self.replay_endpoint, rank or 0), self.host)

    async def _replay(self, rank: int | None, start_seq: int) -> bool:
        """Fetch and apply a DP rank's buffered batches from `start_seq` on: True if the
        replay reached its end without a gap."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        target = self._replay_target(rank)
        try:
            sock.connect(target)
            await sock.send_multipart(replay_request(start_seq))
            while True:
                reply = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                # SGLang answers [b"", seq, payload] (disaggregation/kv_events.py), vLLM
                # [b"", topic, seq, payload] (distributed/kv_events.py _service_replay),
                # both then a seq of -1.
                if len(reply) == 3:
                    topic, seq, payload = self.topic.encode(), reply[1], reply[2]
                elif len(reply) == 4:
                    topic, seq, payload = reply[1], reply[2], reply[3]
                else:
                    self._report(f"replay from {target}: a reply of {len(reply)} frames")
                    return False
                if int.from_bytes(seq, "big", signed=True) == END_OF_REPLAY:
                    return True
                try:
                    done = await self._apply([topic, seq, payload], live=False)
                except KvEventError as e:
                    self._report(f"undecodable replayed message from {target}: {e}")
                    continue
                assert done is not None
                if done[1].gap:  # the replay buffer no longer reaches back that far
                    return False
                self._replayed[done[0].dp_rank] = (done[0].seq, done[0].ts)
        except TimeoutError:
            return False
        except zmq.ZMQError as e:
            self._report(f"replay from {target}: {e}")
            return False
        finally:
            sock.close()

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            event, fd = message["event"], int(message["value"])
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._connecting.append(fd)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # The event names no connection: the oldest one still connecting.
                self._handshaken.append(self._connecting.pop(0) if self._connecting else -1)
                if self._dropped:
                    self._dropped = False
                    self._reconnected = True
            elif event == zmq.EVENT_DISCONNECTED:
                for conns in (self._connecting, self._handshaken):
                    if fd in conns:
                        conns.remove(fd)
                        break
                else:
                    if -1 in self._handshaken:  # the one handshaken unattributed
                        self._handshaken.remove(-1)
                if not self._handshaken and not self._dropped:
                    # Not precise again until what was missed is caught up.
                    self._dropped = True
                    self.synced = False
            self._changed()
