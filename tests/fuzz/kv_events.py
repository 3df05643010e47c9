"""Engines' KV cache events (ext_proc/feeds/kv_events.py): any published message (topic,
sequence number, msgpack payload), decoded a part at a time as the subscriber does and
whole, each part applied to a router's index of that engine's blocks. The first byte
shapes the frames (three as published, or a wrong count or sequence length); the next 8
are the sequence number, the rest the payload.

Invariant: a message that is no batch is refused with KvEventError at the first step;
otherwise every part decodes (an unreadable event is skipped and counted) with the
sequence number it came with, the whole decoding holds the same events as the parts,
and applying the parts to the index raises nothing."""

from __future__ import annotations

import logging

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from ext_proc.feeds.kv_events import BlockStored, KvEventError, decode_message, decode_parts
    from tests.builders import make_router

from tests.fuzz.runner import fuzz

logging.disable(logging.CRITICAL)

NAME = "kv_events"
BACKEND = {"id": "a", "address": "127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}
ROUTER, CLOCK = make_router("gorgo", backends=[BACKEND])
ROUTER.inputs.set_event_stream("a", True)
# Small parts: a few events each, so that a message of a few KiB spans several.
PART_EVENTS = 3


def frames_of(data: bytes) -> list[bytes]:
    shape, seq, payload = data[:1], data[1:9], data[9:]
    mode = shape[0] % 8 if shape else 0
    if mode == 1:
        return [b"kv", seq + payload]
    if mode == 2:
        return [b"kv", seq[:5], payload]
    return [b"kv@127.0.0.1:5557", seq.ljust(8, b"\0"), payload]


def one_input(data: bytes) -> None:
    frames = frames_of(data)
    parts = []
    try:
        for step in decode_parts(frames, PART_EVENTS, dp_rank=0, coalesce=True):
            if step is not None:
                parts.append(step)
    except KvEventError:
        assert not parts  # refused at the first step, before any part
        try:
            decode_message(frames)
        except KvEventError:
            return
        raise AssertionError("decode_message took a message decode_parts refused") from None
    assert parts and [p.part for p in parts] == list(range(len(parts)))
    assert len({(p.seq, p.ts, p.dp_rank) for p in parts}) == 1
    whole = decode_message(frames)
    assert whole.skipped == sum(p.skipped for p in parts)
    # coalesced parts hold the same blocks as the whole, in order
    stored = [
        h for p in parts for e in p.events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert stored == [h for e in whole.events if isinstance(e, BlockStored) for h in e.block_hashes]
    CLOCK.advance(1.0)
    for p in parts:
        ROUTER.inputs.apply_kv_events("a", p)


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
