"""Envoy's gRPC access log (ext_proc/envoy/codec.py access_log_entries, and the service
that closes requests by them, ext_proc/envoy/access_log.py): any bytes as a
StreamAccessLogsMessage, its entries applied to a router with requests in flight.

Invariant: bytes that are not a message raise protobuf's DecodeError; a message decodes
to entries without an exception, and applying them raises nothing, leaves no count
negative and keeps every backend's in-flight count equal to its requests in flight."""

from __future__ import annotations

import logging
import math

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from google.protobuf.message import DecodeError

    from ext_proc.envoy import codec
    from ext_proc.envoy.access_log import AccessLogService
    from tests.builders import REGIONS, chat, make_router

from tests.fuzz.runner import fuzz

logging.disable(logging.CRITICAL)

NAME = "access_log"
ROUTER, CLOCK = make_router("gorgo", backends=REGIONS)
SERVICE = AccessLogService(ROUTER)
# Requests kept in flight for the entries to close (seeds name them).
IDS = tuple(f"rid-{i}" for i in range(4))


def one_input(data: bytes) -> None:
    try:
        msg = codec.StreamAccessLogsMessage.FromString(data)
    except DecodeError:
        return
    assert isinstance(codec.access_log_node(msg), str)
    CLOCK.advance(600.0)  # past any ejection the last input caused
    for rid in IDS:
        if rid not in ROUTER.in_flight:
            ROUTER.decide(chat(f"prompt of {rid}", rid=rid))
    for e in codec.access_log_entries(msg):
        assert e.e2e_ms is None or math.isfinite(e.e2e_ms)
        assert e.attempts >= 1
        SERVICE.observe(e)
    for b in ROUTER.backends.values():
        load = b.load
        assert min(load.in_flight, load.waiting_first_byte, load.in_flight_tokens) >= 0
        assert load.in_flight == sum(1 for f in ROUTER.in_flight.values() if f.backend == b.id)
        assert all(v >= 0 for v in b.stats.recent_e2e_ms), b.stats.recent_e2e_ms


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
