"""The bodies of a disaggregated request's two legs (prefill on one engine, decode on
another), in each engine's own protocol. Pure: bytes in, bytes out (one parse, one dump,
as `parse.rewritten`).

- SGLang (`python/sglang/srt/disaggregation/mini_lb.py`): the same body goes to both
  engines with `bootstrap_host` (the prefill engine's host), `bootstrap_port` (its
  bootstrap server's, `--disaggregation-bootstrap-port`) and `bootstrap_room` (a random
  63-bit id pairing the two legs) added.
- vLLM's NIXL connector (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/`, its
  `toy_proxy_server.py`): the prefill leg asks for one token with
  `kv_transfer_params: {"do_remote_decode": true}` and no stream; the `kv_transfer_params`
  of its JSON response go into the decode leg's body as they came.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

# SGLang's mini_lb: random.randint(0, 2**63 - 1).
MAX_BOOTSTRAP_ROOM = 2**63 - 1


class PrefillAnswerError(ValueError):
    """A prefill engine's answer without the `kv_transfer_params` the decode leg needs."""


def bootstrap_room(rng: random.Random) -> int:
    """A fresh room pairing a request's two SGLang legs."""
    return rng.randint(0, MAX_BOOTSTRAP_ROOM)


def host_of(address: str) -> str:
    """The host of a "host:port" / "[v6]:port" address (a bare host as it is)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (":" in host and not host.startswith("[")):
        return address.strip("[]")
    return host.strip("[]")


def sglang_body(body: bytes, host: str, port: int, room: int) -> bytes:
    """The body both SGLang engines get: the client's, with the bootstrap fields."""
    decoded = _object(body)
    decoded["bootstrap_host"] = host
    decoded["bootstrap_port"] = port
    decoded["bootstrap_room"] = room
    return orjson.dumps(decoded)


def vllm_prefill_body(body: bytes) -> bytes:
    """The prefill leg for vLLM's NIXL connector: one token, not streamed, the KV kept for
    a remote decode. The `/generate` style's own limit (`max_new_tokens`) is not vLLM's."""
    decoded = _object(body)
    decoded["kv_transfer_params"] = {"do_remote_decode": True}
    decoded["max_tokens"] = 1
    if "max_completion_tokens" in decoded:
        decoded["max_completion_tokens"] = 1
    decoded["stream"] = False
    decoded.pop("stream_options", None)
    return orjson.dumps(decoded)


def kv_transfer_params(answer: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` of a vLLM prefill engine's JSON answer."""
    try:
        decoded = orjson.loads(answer)
    except orjson.JSONDecodeError as e:
        raise PrefillAnswerError(f"prefill answer: invalid JSON: {e}") from e
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    if not isinstance(params, dict) or not params:
        raise PrefillAnswerError("prefill answer: no kv_transfer_params")
    return params


def vllm_decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    """The decode leg for vLLM: the client's body with the prefill's kv_transfer_params."""
    decoded = _object(body)
    decoded["kv_transfer_params"] = params
    return orjson.dumps(decoded)


def _object(body: bytes) -> dict[str, Any]:
    decoded = orjson.loads(body)
    if not isinstance(decoded, dict):
        raise ValueError(f"body: expected a JSON object, got {type(decoded).__name__}")
    return decoded
