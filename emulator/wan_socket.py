"""The WAN link's connection to its target (emulator/wan.py). With a bandwidth set, the
link keeps its receive buffer small (RCVBUF_BYTES, asked before connecting so the TCP
window starts small): the bytes the target has written but the paced wire has not taken
stay in the target's own socket, as over a real link. A target that dies then (its
connections reset) loses them, and what reaches the client is cut short, instead of
kernel buffers on loopback (hundreds of KiB) delivering the rest. Without a bandwidth the
connection is a plain one."""

from __future__ import annotations

import asyncio
import socket

# Linux doubles it and keeps a floor of about 2 KiB: ~8 KiB in the link's kernel buffer.
RCVBUF_BYTES = 4096


async def open_target(
    host: str, port: int, paced: bool
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if not paced:
        return await asyncio.open_connection(host, port)
    loop = asyncio.get_running_loop()
    failure: OSError = OSError(f"cannot resolve {host}:{port}")
    for family, kind, proto, _, addr in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            sock.setblocking(False)
            await loop.sock_connect(sock, addr)
            return await asyncio.open_connection(sock=sock)
        except OSError as e:
            sock.close()
            failure = e
        except BaseException:
            sock.close()
            raise
    raise failure
