"""Port allocation for the local stack: free ports, each handed out once per process.

Every stack, front door, KV publisher and WAN control port of this process draws its ports
here, so two children are never given the same one.
"""

from __future__ import annotations

import random
import socket

# Ports for the stack's children, below Linux's ephemeral range (32768-60999): a port the
# kernel picked for us (bind to 0) can be handed to some process's outgoing connection
# before the child that is to listen on it binds it ("address already in use").
PORT_RANGE = (20000, 32767)
# Every port this process has handed out: a stack picks all its ports (its own, its front
# doors', its KV and WAN-control ports) before any child binds one, so "nothing listens on
# it now" alone could give one port to two children.
_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on now and this process has not handed out
    before, from PORT_RANGE at random."""
    rng = random.SystemRandom()
    out: list[int] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * n:
            raise RuntimeError(f"no {n} free ports found in {PORT_RANGE[0]}-{PORT_RANGE[1]}")
        port = rng.randint(*PORT_RANGE)
        if port not in _HANDED_OUT and not port_taken(port):
            _HANDED_OUT.add(port)
            out.append(port)
    return out


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
