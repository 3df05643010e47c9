"""The peer policies by name (each module registers its own on import)."""

from __future__ import annotations

import random

from loadgen.sim.peers import dynamo, llmd, smg, vllm_router  # noqa: F401
from loadgen.sim.peers.base import PEERS, PeerPolicy
from loadgen.sim.peers.names import PEER_NAMES

if set(PEERS) != set(PEER_NAMES):  # the light list of names must say what is registered
    raise ImportError(f"peer names {sorted(PEER_NAMES)} != registered {sorted(PEERS)}")


def make_peer(name: str, rng: random.Random) -> PeerPolicy:
    try:
        factory = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer policy {name!r} (known: {', '.join(PEER_NAMES)})") from None
    return factory(rng)
