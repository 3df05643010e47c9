"""Whether a backend's KV-event endpoints answer, told the way the router tells its stream
is up: a ZMTP handshake completed on a subscriber socket with the router's own options
(loops/kv_stream.py `subscriber_socket`). ZMQ connects lazily and retries forever, so a
`connect` that returns says nothing; a TCP connect alone says little more (a WAN link that
black-holes traffic, or another service on the port, accepts it). The handshake proves a
ZMQ publisher is there: a ROUTER (a replay endpoint given as the event endpoint) or a
non-ZMQ server ends the connection without it, and the socket monitor tells those apart
from a port that accepts and says nothing, and from nothing listening.
No event batch is waited for: an idle engine publishes none. A replay endpoint is asked
for its batches from a sequence number no engine reaches, so that it answers with its end
marker alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ext_proc.config.kv_endpoints import connect_address, subscriber_address
from ext_proc.feeds.kv_events import offset_port
from ext_proc.service.loops.kv_stream import replay_request, subscriber_socket
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.params import split_host_port

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_TCP_UP = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
# A peer that closes the connection before the handshake refused it: libzmq drops a peer
# of an incompatible socket type (a ROUTER for a SUB) with no handshake-failed event.
_REFUSED = _FAILED | zmq.EVENT_DISCONNECTED
_WATCHED = _REFUSED | _TCP_UP | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED
# The replay request's first sequence number: far past any engine's, so the answer is the
# end marker alone (SGLang's and vLLM's replay send each buffered batch from it on, then -1).
PROBE_SEQ = 1 << 62


@dataclass(frozen=True)
class KvLook:
    """One DP rank's endpoints: where the router's subscriber goes, and what failed
    ("" = its handshake completed; `replay_error` None = no replay endpoint)."""

    rank: int
    address: str
    bind: bool
    error: str
    replay_address: str = ""
    replay_error: str | None = None


async def handshake(
    ctx: zmq.asyncio.Context, address: str, bind: bool, topic: str, timeout_s: float
) -> str:
    """ "" once a ZMTP handshake completes on `address` within timeout_s, else why not."""
    sock = subscriber_socket(ctx, topic)
    monitor = sock.get_monitor_socket(_WATCHED)
    seen = 0
    try:
        try:
            (sock.bind if bind else sock.connect)(address)
        except zmq.ZMQError as e:
            verb = "bind" if bind else "connect to"
            held = " (another router or process holds it?)" if e.errno == zmq.EADDRINUSE else ""
            return f"cannot {verb} {address}: {e.strerror}{held}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                frames = await asyncio.wait_for(monitor.recv_multipart(), left)
            except TimeoutError:
                break
            event = int(parse_monitor_message(frames)["event"])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return ""
            seen |= event
            if seen & _REFUSED or (event == zmq.EVENT_CONNECT_RETRIED and not seen & _TCP_UP):
                break  # refused by the peer, or by every address: no need to wait on
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    within = f"within {timeout_s:g} s"
    if seen & _REFUSED:
        return (
            f"something answers at {address} but not as a ZMQ publisher (it ended the "
            "connection without a ZMTP handshake: another socket type, such as the replay "
            "endpoint, or not ZMQ)"
        )
    if seen & _TCP_UP:
        return (
            f"a TCP connection to {address} opens but no ZMTP handshake completes {within} "
            "(not a ZMQ publisher, or a link that swallows the traffic)"
        )
    if bind:
        return f"no engine connected to {address} {within}"
    if seen & zmq.EVENT_CONNECT_RETRIED:
        return f"nothing accepts a connection at {address} (refused)"
    return f"nothing accepts a connection at {address} {within}"


async def replay_answers(ctx: zmq.asyncio.Context, address: str, timeout_s: float) -> str:
    """ "" when the replay endpoint answers a replay request within timeout_s."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)

        async def ask() -> list[bytes]:
            await sock.send_multipart(replay_request(PROBE_SEQ))
            return await sock.recv_multipart()

        reply = await asyncio.wait_for(ask(), timeout_s)
    except TimeoutError:
        return f"no answer to a replay request at {address} within {timeout_s:g} s"
    except zmq.ZMQError as e:
        return f"cannot connect to {address}: {e.strerror}"
    finally:
        sock.close()
    # SGLang answers [b"", seq, payload], vLLM [b"", topic, seq, payload] (kv_stream.py).
    if len(reply) not in (3, 4):
        return f"{address} answers a replay request with {len(reply)} frames, not 3 or 4"
    return ""


async def look_at_kv(ctx: zmq.asyncio.Context, b: Backend, timeout_s: float) -> list[KvLook]:
    """Each DP rank's event endpoint (and replay endpoint), all at once ([] = no events)."""
    kv = b.kv_events
    if not kv.endpoint:
        return []
    host = split_host_port(b.address, "address")[0]

    async def rank(r: int) -> KvLook:
        address, bind = subscriber_address(offset_port(kv.endpoint, r), kv.mode, host)
        replay = ""
        if kv.replay_endpoint:  # the engine's ROUTER binds in either mode: always a connect
            replay = connect_address(offset_port(kv.replay_endpoint, r), host)
        checks = [handshake(ctx, address, bind, kv.topic, timeout_s)]
        if replay:
            checks.append(replay_answers(ctx, replay, timeout_s))
        found = await asyncio.gather(*checks)
        return KvLook(r, address, bind, found[0], replay, found[1] if replay else None)

    return list(await asyncio.gather(*(rank(r) for r in range(kv.dp_ranks))))
