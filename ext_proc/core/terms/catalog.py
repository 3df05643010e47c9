"""The built-in cost terms, registered, in the order their values are summed (a term may
read those before it: decode stall reads the prefill, the KV wait the queue and LoRA wait;
a term registered later comes after them). Import the registry from here, not from
`vocab.terms` (where it may still be empty)."""

from __future__ import annotations

from ext_proc.core.terms import (  # noqa: F401  (they register on import)
    decode,
    decode_stall,
    kv,
    lora_wait,
    prefill,
    queue,
    rtt,
)
from ext_proc.vocab.terms import TERMS, TermInfo

__all__ = ["BUILT_IN", "TERMS", "TermInfo"]

BUILT_IN = ("rtt", "queue", "lora_wait", "prefill", "decode_stall", "kv", "decode")
_ordered = {name: TERMS[name] for name in BUILT_IN} | TERMS
TERMS.clear()
TERMS.update(_ordered)
