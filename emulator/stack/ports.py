"""Port allocation for the local stack: free ports, each handed out once per process.

Every stack, front door, KV publisher and WAN control port of this process draws its ports
here, so two children are never given the same one; processes that draw at once each
draw from a slice of their own (PORT_SLICE_ENV).
"""

from __future__ import annotations

import os
import random
import socket

# Ports for the stack's children, below Linux's ephemeral range (32768-60999): a port the
# kernel picked for us (bind to 0) can be handed to some process's outgoing connection
# before the child that is to listen on it binds it ("address already in use").
PORT_RANGE = (20000, 32767)
# Several processes drawing stacks at once (the test runner's workers) each take a slice of
# the range: GORGO_PORT_SLICE="k/n" (k of n, from 0), so no two hand out one port.
PORT_SLICE_ENV = "GORGO_PORT_SLICE"
# Every port this process has handed out: a stack picks all its ports (its own, its front
# doors', its KV and WAN-control ports) before any child binds one, so "nothing listens on
# it now" alone could give one port to two children.
_HANDED_OUT: set[int] = set()


def port_range(slice_: str | None = None) -> tuple[int, int]:
    """PORT_RANGE, or this process's slice of it (PORT_SLICE_ENV, "k/n")."""
    value = os.environ.get(PORT_SLICE_ENV, "") if slice_ is None else slice_
    if not value:
        return PORT_RANGE
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise ValueError(f"{PORT_SLICE_ENV}: expected k/n with 0 <= k < n, got {value!r}")
    width = (PORT_RANGE[1] - PORT_RANGE[0] + 1) // int(n)
    low = PORT_RANGE[0] + int(k) * width
    return low, low + width - 1


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on now and this process has not handed out
    before, from its port_range() at random."""
    rng = random.SystemRandom()
    low, high = port_range()
    out: list[int] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * n:
            raise RuntimeError(f"no {n} free ports found in {low}-{high}")
        port = rng.randint(low, high)
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
