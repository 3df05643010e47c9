"""A trace's rows as every reader, generator and runner sees them: `TraceRequest` (sorted
by arrival in a trace), `TraceError`, the block sizes of the two file formats, and the
shared prefix of a set of block id sequences (the readers' session key, the statistics'
conversations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
ART_BLOCK_TOKENS = 256


class TraceError(ValueError):
    """A trace file is unreadable; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    # Prefix block ids (each names its block and everything before it).
    block_ids: tuple[int, ...]
    block_tokens: int
    # The conversation this request belongs to (session affinity's key).
    session: str
    # ART-Chat rows carry the request body itself.
    body: dict[str, Any] | None = None
    # The model it asks for (the request's `model`; None: none named). Mooncake rows may
    # carry it as `model`; `two-models[:PATH]` assigns one per conversation.
    model: str | None = None

    @property
    def id(self) -> str:
        return f"t{self.index}"


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        while n and s[:n] != first[:n]:
            n -= 1
        if not n:
            break
    return n
