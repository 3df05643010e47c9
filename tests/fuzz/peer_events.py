"""Other routers' messages over NATS (ext_proc/feeds/peers.py PeerEvent.decode): any bytes.

Invariant: a message decodes into an event that encodes back to the same event, or is
refused with ValueError (the bus counts and drops it); nothing else is raised."""

from __future__ import annotations

import math

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from ext_proc.feeds.peers import PeerEvent

from tests.fuzz.runner import fuzz

NAME = "peer_events"


def one_input(data: bytes) -> None:
    try:
        e = PeerEvent.decode(data)
    except ValueError:
        return
    for v in (e.prefill_ms, e.rtt_ms, e.queue_ms, e.e2e_ms):
        assert v is None or not math.isnan(v), e
    again = PeerEvent.decode(e.encode())
    assert again == e, (again, e)


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
