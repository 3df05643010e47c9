"""KV bytes on the wire between two P/D twins, and the scaling that keeps them cheap.

How much KV a transfer moves, as the engines move it:
- SGLang: the prompt's KV, every token of it, from the prefill to the decode
  (disaggregation/prefill.py send_kv_chunk sends the request's req_to_token slots up to
  len(origin_input_ids); the decode asks for the tokens past its own cached prefix, none
  with its radix cache off, the default: decode.py pop_preallocated).
- vLLM NIXL: the prompt's whole blocks (nixl/scheduler.py request_finished returns the
  request's block ids; the decode reads each block).
- bytes = tokens x the engine profile's kv_bytes_per_token, which is 2 x attention layers x
  KV heads x head dim x bytes per element (Llama-3.1-8B in fp16: 2 x 32 x 8 x 128 x 2 =
  131072; ext_proc/estimate/profile.py EngineProfile.kv_bytes_per_token).

Scaling: a 8k-token Llama-8B prompt is 1 GiB of KV, too much to push through loopback
sockets and a Python proxy on a shared test machine. So the twin sends the KV scaled down
by `kv_byte_scale` S (default 1024: a byte per KiB), ceil(bytes / S) real bytes, and a link
between two twins paces each byte as S bytes (`gorgo wan --byte-scale S`, emulator/wan.py).
The time on the link is then the real one: RTT / 2 + bytes / bandwidth, with the bytes and
the bandwidth the engine's. Control traffic on such a link (the bootstrap and handshake
requests, a few hundred bytes each) is scaled too, which adds S x its size / bandwidth:
0.4 ms per 500 bytes at 10 Gbit/s and S = 1024, small beside an RTT. A link whose
byte_scale is not the engines' kv_byte_scale makes transfers S times too fast or too slow:
keep them equal (1 and 1 sends the real bytes).
"""

from __future__ import annotations

import math

# The size of each write of KV bytes (the WAN link reads up to 64 KiB at a time too).
CHUNK_BYTES = 64 * 1024
_ZEROS = bytes(CHUNK_BYTES)


def kv_bytes(tokens: int, bytes_per_token: int) -> int:
    """The KV of `tokens` tokens, in the engine's bytes."""
    return tokens * bytes_per_token


def block_tokens(tokens: int, block: int) -> int:
    """Tokens in the whole blocks holding `tokens` tokens (vLLM moves whole blocks)."""
    return math.ceil(tokens / block) * block


def wire_bytes(engine_bytes: int, scale: float) -> int:
    """What the twin sends for `engine_bytes` of KV: scaled down, at least one byte for any
    KV at all."""
    return math.ceil(engine_bytes / scale) if engine_bytes > 0 else 0


def chunks(total: int) -> list[bytes]:
    """The bytes of a transfer of `total` wire bytes, in writes of CHUNK_BYTES."""
    full, rest = divmod(total, CHUNK_BYTES)
    return [_ZEROS] * full + ([_ZEROS[:rest]] if rest else [])
